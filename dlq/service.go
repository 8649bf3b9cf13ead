package dlq

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/km0/km0/inbox"
	"github.com/km0/km0/transport"
)

// Source is what `km0 dlq` and Handler operate on: one dead-letter backend
// with its index. Service implements it for any Backend.
type Source interface {
	// Sync brings the index up to date with what the broker holds now.
	Sync(ctx context.Context) (SyncResult, error)
	// List returns the letters f selects and their counts by topic and reason class.
	List(ctx context.Context, f Filter) (*Listing, error)
	// Get returns one letter, or an error wrapping ErrNotFound.
	Get(ctx context.Context, id string) (*Letter, error)
	// Replay republishes the letters f selects to their original topics.
	Replay(ctx context.Context, f Filter, o ReplayOptions) (*Report, error)
	// Purge marks the letters f selects purged (and may delete records).
	Purge(ctx context.Context, f Filter, o PurgeOptions) (*Report, error)
	// Snapshot returns the IDs of the letters f selects now, in DLQ order,
	// without their bytes (f.Limit caps them; 0 = all): what a dry run
	// shows, and what its confirmation must then act on (Filter{IDs: ...})
	// rather than resolving f again.
	Snapshot(ctx context.Context, f Filter) ([]string, error)
	// Arrived counts the letters f selects now that ids does not hold: the
	// letters that died after the snapshot ids was taken, which a
	// confirmation bound to ids leaves alone and should report.
	Arrived(ctx context.Context, f Filter, ids []string) (int, error)
	// ReplayEdited replays one letter with an operator's edit of its
	// envelope, validated against its schema first (Service.ReplayEdited).
	ReplayEdited(ctx context.Context, id string, value []byte, o EditOptions) (*Report, error)
	// Watch reports, per letter the reports replayed, whether its consumer
	// dead-lettered the event again within a bound (Service.Watch).
	Watch(ctx context.Context, within, poll time.Duration, reps ...*Report) ([]Take, error)
	// AuditLog lists the audit log of replays, purges and edits.
	AuditLog(ctx context.Context, f AuditFilter) ([]AuditEntry, error)
	// CreateJob, RunJob, CancelJob and JobStatus are bulk replay jobs:
	// capped, paced, cancellable, resumable (job.go).
	CreateJob(ctx context.Context, ids []string, rate float64, actor string) (string, error)
	RunJob(ctx context.Context, id string, o ReplayOptions) (*JobStatus, error)
	CancelJob(ctx context.Context, id string) error
	JobStatus(ctx context.Context, id string) (*JobStatus, error)
	// PendingJobs lists the jobs not finished nor cancelled, oldest first:
	// what a restarted runner resumes.
	PendingJobs(ctx context.Context) ([]string, error)
}

// Backend is the broker-specific part of a Source, the driver of River's
// pattern: package dlq imports no broker client, and each broker's backend
// lives in its own package: kafkadlq.Backend (topics <topic>.dlq) and
// amqpdlq.Backend (queues <queue>.dlq). Each implements these three methods
// and gets listing, replay rules, purge, alerts and the admin API from
// Service.
type Backend interface {
	// Sync indexes into s every dead letter the broker holds now (up to the
	// current end of each DLQ) and returns the letters that were new.
	Sync(ctx context.Context, s *Store) (SyncResult, error)
	// Publish republishes msgs (Topic = the original topic or work queue)
	// and returns once the broker confirmed them, with transport.Publisher's
	// error contract. A message carrying the header grup_consumidor is
	// addressed to that consumer alone: Kafka's backend sends it to
	// <topic>.retry, where the sources of other groups skip it (counted as
	// Foreign); RabbitMQ's sends it to the work queue, which only that
	// consumer reads. A message without it reaches every consumer of the
	// topic.
	transport.Publisher
	// DeletePurged physically removes what it can of the letters now purged
	// and returns what it deleted. A broker that cannot returns
	// ErrDeleteUnsupported.
	DeletePurged(ctx context.Context, s *Store, purged []*Letter) ([]Position, error)
}

// SyncTimeoutDefault bounds one Sync of the backends (their SyncTimeout).
const SyncTimeoutDefault = 30 * time.Second

// ErrDeleteUnsupported is returned by a Backend that cannot delete records.
var ErrDeleteUnsupported = errors.New("dlq: this backend cannot delete records")

// SyncResult says what a Sync did.
type SyncResult struct {
	Read int       // records read from the broker
	New  []*Letter // letters indexed for the first time
	// Refused are the letters the index refused for the first time, set
	// aside in cartes_refusades (Store.Refused) instead of stopping the
	// letters behind them.
	Refused []Refusal
}

// Listing is the answer of List.
type Listing struct {
	Groups  []Group   `json:"grups"`
	Letters []*Letter `json:"-"`
	// Refused counts the letters the index refused and set aside
	// (Store.Refused) of the Filter's topic, or of every topic.
	Refused int `json:"refusades"`
}

// ReplayOptions tune Replay.
type ReplayOptions struct {
	// DryRun reports what would be replayed and publishes and marks nothing.
	DryRun bool
	// Force replays letters that are not pending (already replayed or
	// purged) and letters older than Retention.
	Force bool
	// Retention is the consumers' idempotency retention: a letter whose
	// oldest time (Letter.Oldest) is older than this is refused, because a
	// duplicate could no longer be recognised. Default inbox.RetentionDefault.
	Retention time.Duration
	// Actor names who replays, for the audit log (auditoria_cartes): the
	// console session's or the CLI's identity. Default "unknown".
	Actor string
	// action is the audit action (ActionReplay unless an edit or a skip).
	action string
	// values replace the value of these letters (ReplayEdited).
	values map[string][]byte
	// noAudit leaves the audit entry to the caller (RunJob: one per run).
	noAudit bool
}

// PurgeOptions tune Purge.
type PurgeOptions struct {
	// Confirmed must be true: without it Purge returns ErrNotConfirmed.
	Confirmed bool
	// DeleteRecords also asks the backend to delete the purged records on
	// the broker (Kafka: DeleteRecords up to the lowest pending offset).
	DeleteRecords bool
	// Actor names who purges, for the audit log. Default "unknown".
	Actor string
	// action is the audit action (ActionPurge unless a skip).
	action string
	// note is the audit result in place of "fet" (a skip's reason).
	note string
}

// ErrNotConfirmed is returned by Purge without PurgeOptions.Confirmed.
var ErrNotConfirmed = errors.New("dlq: purge not confirmed")

// Item is the fate of one letter in a Replay or Purge.
type Item struct {
	ID      string `json:"id"`
	Topic   string `json:"topic_original"`
	EventID string `json:"id_esdeveniment,omitempty"`
	Group   string `json:"grup_consumidor,omitempty"` // the consumer a replay is addressed to
	Done    bool   `json:"fet"`                       // replayed/purged (in a dry run: would be)
	Refused string `json:"refusat,omitempty"`         // why not, when Done is false
}

// Report says what Replay or Purge did.
type Report struct {
	DryRun   bool       `json:"simulacio"`
	Selected int        `json:"seleccionades"`
	Done     int        `json:"fetes"`
	Refused  int        `json:"refusades"`
	Items    []Item     `json:"cartes"`
	Deleted  []Position `json:"esborrat_fins_a,omitempty"` // Purge with DeleteRecords
	// Started is when Replay began publishing (zero for a dry run): a
	// letter of the same event and consumer dead at or after it means the
	// replay did not take (Service.Watch).
	Started time.Time `json:"iniciada,omitempty"`

	replayed []Item // what Replay republished (Items may also hold a sequence's purged letters)
}

// doneIDs returns the IDs of the letters r replayed or purged.
func (r *Report) doneIDs() []string {
	var out []string
	for _, it := range r.Items {
		if it.Done {
			out = append(out, it.ID)
		}
	}
	return out
}

func (r *Report) add(it Item) {
	r.Items = append(r.Items, it)
	if it.Done {
		r.Done++
	} else {
		r.Refused++
	}
}

// ServiceConfig configures a Service.
type ServiceConfig struct {
	Store   *Store   // required
	Backend Backend  // required
	Alerter *Alerter // alerts on letters Sync finds new; nil = none
	Logger  *slog.Logger
	// Now is the clock of the retention check. Default time.Now.
	Now func() time.Time
}

// Service is a Source over a Backend and a Store.
type Service struct {
	cfg ServiceConfig
}

// NewService returns a Service. It fails if Store or Backend is missing.
func NewService(cfg ServiceConfig) (*Service, error) {
	if cfg.Store == nil || cfg.Backend == nil {
		return nil, errors.New("dlq: ServiceConfig needs Store and Backend")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Service{cfg: cfg}, nil
}

var _ Source = (*Service)(nil)

// Sync implements Source; new letters go to the Alerter.
func (s *Service) Sync(ctx context.Context) (SyncResult, error) {
	res, err := s.cfg.Backend.Sync(ctx, s.cfg.Store)
	if s.cfg.Alerter != nil {
		for _, l := range res.New {
			s.cfg.Alerter.DeadLetter(ctx, l)
		}
	}
	ReportRefused(ctx, s.cfg.Alerter, s.cfg.Logger, res.Refused)
	return res, err
}

// List implements Source.
func (s *Service) List(ctx context.Context, f Filter) (*Listing, error) {
	g, err := s.cfg.Store.Summary(ctx, f)
	if err != nil {
		return nil, err
	}
	var l []*Letter
	if f.Fold {
		l, err = s.cfg.Store.listFolded(ctx, f)
	} else {
		l, err = s.cfg.Store.List(ctx, f)
	}
	if err != nil {
		return nil, err
	}
	n, err := s.cfg.Store.refusedCount(ctx, f)
	if err != nil {
		return nil, err
	}
	return &Listing{Groups: g, Letters: l, Refused: n}, nil
}

// Snapshot implements Source.
func (s *Service) Snapshot(ctx context.Context, f Filter) ([]string, error) {
	return s.cfg.Store.selectIDs(ctx, f)
}

// Arrived implements Source.
func (s *Service) Arrived(ctx context.Context, f Filter, ids []string) (int, error) {
	f.IDs, f.exclude = nil, ids
	return s.cfg.Store.count(ctx, f)
}

// Get implements Source.
func (s *Service) Get(ctx context.Context, id string) (*Letter, error) {
	return s.cfg.Store.Get(ctx, id)
}

// replayBatch is how many letters one transaction of Replay locks and publishes.
const replayBatch = 500

// Replay implements Source. A Filter without IDs or States selects pending
// letters only (all states with Force); letters named by ID are selected in
// any state, and refused unless pending or forced. A letter whose value is not
// a valid envelope is refused unless forced: no fix in a handler makes it
// decodable, and without an id_esdeveniment no consumer could deduplicate it.
// Per batch of letters, in one transaction: it locks
// the selected rows (FOR UPDATE SKIP LOCKED), refuses letters not pending or
// older than the retention (unless Force), publishes the others to their
// original topic with the same key, value and id_esdeveniment, waits for the
// broker's confirmation, then marks them replayed and commits. If publishing
// fails nothing is marked; some records may have gone out, and replaying again
// is safe because consumers recognise the id_esdeveniment.
func (s *Service) Replay(ctx context.Context, f Filter, o ReplayOptions) (*Report, error) {
	if o.Retention <= 0 {
		o.Retention = inbox.RetentionDefault
	}
	if len(f.States) == 0 && len(f.IDs) == 0 && !o.Force {
		// A selection by filter means "what is still dead"; letters named by
		// ID are selected in any state so a refusal can say why.
		f.States = []State{StatePending}
	}
	rep := &Report{DryRun: o.DryRun}
	if !o.DryRun {
		rep.Started = s.cfg.Now().UTC().Truncate(time.Millisecond) // Kafka timestamps are milliseconds
	}
	seen := map[string]bool{}
	for {
		n, err := s.replayBatch(ctx, f, o, rep, seen)
		if err == nil && n < replayBatch {
			reportMissing(rep, f.IDs, seen)
		}
		if err != nil || n < replayBatch {
			if !o.DryRun && !o.noAudit {
				s.auditReport(ctx, o.Actor, cmpOr(o.action, ActionReplay), rep, err)
			}
			return rep, err
		}
	}
}

// auditReport records what Replay or Purge did (rep) and how it ended.
func (s *Service) auditReport(ctx context.Context, actor, action string, rep *Report, err error) {
	result := "fet"
	if err != nil {
		result = "stopped: " + err.Error()
	}
	_ = s.audit(ctx, actor, action, rep.doneIDs(), rep.Refused, result)
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// reportMissing refuses the requested IDs no selection returned: unknown
// letters, or letters another operator holds locked right now.
func reportMissing(rep *Report, ids []string, seen map[string]bool) {
	for _, id := range ids {
		if !seen[id] {
			seen[id] = true
			rep.Selected++
			rep.add(Item{ID: id, Refused: "not in the index (or being replayed or purged by someone else)"})
		}
	}
}

func (s *Service) replayBatch(ctx context.Context, f Filter, o ReplayOptions, rep *Report, seen map[string]bool) (int, error) {
	tx, err := s.cfg.Store.db.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("dlq: begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after Commit
	f.Limit = replayBatch
	f.IDs = append([]string(nil), f.IDs...)
	letters, err := s.cfg.Store.lockTx(ctx, tx, f.excluding(seen))
	if err != nil {
		return 0, err
	}
	now := s.cfg.Now()
	var (
		msgs []*transport.Message
		sent []*Letter
	)
	for _, l := range letters {
		seen[l.ID] = true
		rep.Selected++
		it := Item{ID: l.ID, Topic: l.OriginalTopic, EventID: l.EventID, Group: l.ConsumerGroup}
		if why := refuse(l, o, now); why != "" {
			it.Refused = why
			rep.add(it)
			continue
		}
		m := replayMessage(l)
		if v, ok := o.values[l.ID]; ok {
			m.Value = v // an edit-and-replay: the edited envelope, same key and id_esdeveniment
		}
		msgs = append(msgs, m)
		sent = append(sent, l)
	}
	if o.DryRun || len(sent) == 0 {
		for _, l := range sent {
			rep.add(Item{ID: l.ID, Topic: l.OriginalTopic, EventID: l.EventID, Group: l.ConsumerGroup, Done: true})
		}
		return len(letters), nil
	}
	err = s.cfg.Backend.Publish(ctx, msgs)
	rejected := map[int]string{}
	var rej *transport.RejectedError
	switch {
	case errors.As(err, &rej):
		for i, idx := range rej.Index {
			rejected[idx] = "the broker refused the record for good: " + rej.Errs[i].Error()
		}
	case err != nil:
		return 0, fmt.Errorf("dlq: replay: publish (nothing marked; replaying again is safe): %w", err)
	}
	var ids []string
	for i, l := range sent {
		if why, bad := rejected[i]; bad {
			rep.add(Item{ID: l.ID, Topic: l.OriginalTopic, EventID: l.EventID, Group: l.ConsumerGroup, Refused: why})
			continue
		}
		ids = append(ids, l.ID)
	}
	if err := s.cfg.Store.markReplayedTx(ctx, tx, ids); err != nil {
		return 0, err
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("dlq: replay: published but not marked (replaying again is safe): %w", err)
	}
	for i, l := range sent {
		if _, bad := rejected[i]; !bad {
			it := Item{ID: l.ID, Topic: l.OriginalTopic, EventID: l.EventID, Group: l.ConsumerGroup, Done: true}
			rep.add(it)
			rep.replayed = append(rep.replayed, it)
			s.cfg.Logger.Info("dlq: letter replayed", "id", l.ID, "topic", l.OriginalTopic,
				"id_esdeveniment", l.EventID, "motiu", l.Reason)
		}
	}
	return len(letters), nil
}

// refuse returns why l may not be replayed under o, or "".
func refuse(l *Letter, o ReplayOptions, now time.Time) string {
	// No Kafka topic (249 bytes at most) or RabbitMQ queue (255) has a name
	// this long: the index cut a forged topic_original or cua_origen, and
	// the letter has nowhere to go back to, forced or not.
	if len(l.OriginalTopic) >= MaxIndexedText {
		return fmt.Sprintf("its original topic or queue was cut in the index (%d bytes or more): no topic or queue has such a name",
			MaxIndexedText)
	}
	if o.Force {
		return ""
	}
	switch l.State {
	case StateReplayed:
		return fmt.Sprintf("already replayed %d time(s), last at %s (use --force to replay again)",
			l.Replays, l.ReplayedAt.Format(time.RFC3339))
	case StatePurged:
		return "purged (use --force to replay it anyway)"
	}
	if _, err := l.Envelope(); err != nil {
		return "the value is not a valid envelope (" + err.Error() + "): replayed as it is, it would " +
			"dead-letter again (use --force to replay it anyway)"
	}
	if l.TimeUnknown || l.Oldest().IsZero() {
		return "its age is unknown (a time out of range was indexed as unknown): a duplicate might no " +
			"longer be recognised (use --force if the effect is known not to have been applied)"
	}
	if age := now.Sub(l.Oldest()); age > o.Retention {
		return fmt.Sprintf("older than the idempotency retention (%s > %s): a duplicate could no longer "+
			"be recognised (use --force if the effect is known not to have been applied)",
			age.Truncate(time.Hour), o.Retention)
	}
	return ""
}

// excluding returns f without the letters already handled in this run (a
// refused letter stays pending and would be selected again).
func (f Filter) excluding(seen map[string]bool) Filter {
	if len(seen) == 0 {
		return f
	}
	f.exclude = make([]string, 0, len(seen))
	for id := range seen {
		f.exclude = append(f.exclude, id)
	}
	return f
}

// Purge implements Source. It marks the letters f selects that are not yet
// purged as purged, in one transaction (a Filter without IDs or States
// selects pending and replayed letters). Kafka cannot delete a single record:
// the records stay on the topic until its retention removes them, unless
// DeleteRecords asks the backend to delete, per partition, every record
// before the lowest still-pending offset (see Store.DeletableBefore).
func (s *Service) Purge(ctx context.Context, f Filter, o PurgeOptions) (*Report, error) {
	if !o.Confirmed {
		return nil, ErrNotConfirmed
	}
	tx, err := s.cfg.Store.db.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("dlq: begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after Commit
	f.Limit = 0
	if len(f.States) == 0 && len(f.IDs) == 0 {
		f.States = []State{StatePending, StateReplayed}
	}
	letters, err := s.cfg.Store.lockIDsTx(ctx, tx, f) // without their bytes: a DLQ may be huge
	if err != nil {
		return nil, err
	}
	rep := &Report{}
	var ids []string
	var purged []*Letter
	seen := map[string]bool{}
	for _, l := range letters {
		seen[l.ID] = true
		rep.Selected++
		it := Item{ID: l.ID, Topic: l.OriginalTopic, EventID: l.EventID}
		if l.State == StatePurged {
			it.Refused = "already purged"
			rep.add(it)
			continue
		}
		it.Done = true
		rep.add(it)
		ids = append(ids, l.ID)
		purged = append(purged, l)
	}
	reportMissing(rep, f.IDs, seen)
	if err := s.cfg.Store.markPurgedTx(ctx, tx, ids); err != nil {
		return nil, err
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("dlq: purge: %w", err)
	}
	if o.note != "" {
		_ = s.audit(ctx, o.Actor, cmpOr(o.action, ActionPurge), rep.doneIDs(), rep.Refused, o.note)
	} else {
		s.auditReport(ctx, o.Actor, cmpOr(o.action, ActionPurge), rep, nil)
	}
	for _, l := range purged {
		s.cfg.Logger.Info("dlq: letter purged", "id", l.ID, "id_esdeveniment", l.EventID, "motiu", l.Reason)
	}
	if o.DeleteRecords && len(purged) > 0 {
		rep.Deleted, err = s.cfg.Backend.DeletePurged(ctx, s.cfg.Store, purged)
		if err != nil {
			return rep, fmt.Errorf("dlq: purge: letters marked purged, records not deleted: %w", err)
		}
	}
	return rep, nil
}
