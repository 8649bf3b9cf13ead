// Package lag measures whether asynchrony keeps up or piles up invisible
// debt: each transactional outbox's pending rows and the age of the oldest,
// each Kafka consumer group's lag per partition (committed offset against
// the end) and the age of its oldest unprocessed record, and each RabbitMQ
// queue's ready and unacknowledged messages.
//
// A Measurer takes one Snapshot; a Sampler takes one every interval, keeps
// the last hour in memory (History, for charts), exports the latest as
// Prometheus metrics (Collector) and feeds a Watch, which sends the DLQ
// webhook a notice when a lag stays over a threshold for a duration.
package lag

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/transport/amqp"
	"github.com/km0/km0/transport/kafka"
)

// OldestTimeoutDefault bounds the reads of the oldest unprocessed records of
// one Measure.
const OldestTimeoutDefault = 3 * time.Second

// Outbox is one transactional outbox to watch.
type Outbox struct {
	Name  string        // shown and used as the outbox label, e.g. "comandes"
	DB    relay.Querier // its database
	Names migrate.Names // schema and table; default public.outbox
}

// Config configures a Measurer. Every part is optional: what is not
// configured is not measured.
type Config struct {
	Outboxes []Outbox
	// Brokers are the Kafka bootstrap brokers; empty: no consumer groups.
	Brokers []string
	// Groups are the system's consumer groups: the ones reported. A group
	// of another Kafka client is not shown (its name, its topics) unless
	// AllGroups. With Brokers, Groups or AllGroups is required.
	Groups []string
	// OmitUnlisted drops a group of Groups that the cluster does not list
	// (one that has never joined nor committed), for a default list of
	// groups of which a deployment may run only some. Default false: every
	// group of Groups is reported, an unknown one with no partitions.
	OmitUnlisted bool
	// AllGroups also reports every other group the cluster lists, marked
	// Foreign. Default false: only Groups.
	AllGroups bool
	// ClientOpts are extra franz-go options (TLS, SASL).
	ClientOpts []kgo.Opt
	// AMQP is the RabbitMQ connection of Queues.
	AMQP *amqp.Conn
	// Queues are the RabbitMQ queues to report (their .dlq too, if it exists).
	Queues []string
	// ManagementURL is the base URL of the RabbitMQ management API
	// (http://user:password@host:15672; ManagementURLFor derives it from the
	// AMQP URL). AMQP tells a queue's ready messages only; the
	// unacknowledged ones need the API. Empty: unacked unknown (-1).
	ManagementURL string
	// ManagementBestEffort marks ManagementURL as a guess (the default
	// listener of a plugin that may be disabled): when the API does not
	// answer, unacked is unknown and the Snapshot says so in Notes, not in
	// Errors. Otherwise a silent API is an error of the queue's part.
	ManagementBestEffort bool
	// VHost is the virtual host of Queues for the management API. Default "/".
	VHost string
	// OldestTimeout bounds the reads of the oldest unprocessed records.
	// Default OldestTimeoutDefault.
	OldestTimeout time.Duration
	// Logger gets the full text of measurement errors. Default slog.Default().
	Logger *slog.Logger
	// Now is the clock. Default time.Now.
	Now func() time.Time
	// HTTPClient reaches the management API. Default a client with a 5 s timeout.
	HTTPClient *http.Client
}

// Snapshot is one measurement. Errors hold a short text per part that could
// not be measured (without hosts or SQL; the log has the details).
type Snapshot struct {
	At       time.Time   `json:"en"`
	Outboxes []OutboxLag `json:"outboxes"`
	Groups   []GroupLag  `json:"grups"`
	Queues   []QueueLag  `json:"cues"`
	Errors   []string    `json:"errors,omitempty"`
	// Notes say what is unknown and why, short of an error (an optional
	// source that does not answer).
	Notes []string `json:"notes,omitempty"`
}

// OutboxLag is one outbox's relay lag.
type OutboxLag struct {
	Name          string  `json:"outbox"`
	Pending       int64   `json:"pendents"`
	OldestSeconds float64 `json:"antiguitat_s"` // of the oldest pending row; 0 when none
	Err           string  `json:"error,omitempty"`
}

// GroupLag is one consumer group's lag.
type GroupLag struct {
	Group         string         `json:"grup"`
	State         string         `json:"estat"`
	Members       int            `json:"membres"`
	Total         int64          `json:"lag"`
	OldestSeconds float64        `json:"antiguitat_s"` // the oldest of its partitions
	Partitions    []PartitionLag `json:"particions"`
	Err           string         `json:"error,omitempty"`
	// Foreign marks a group that is not one of Config.Groups (reported with
	// Config.AllGroups only). Its failures are logged and in Err, never in
	// Snapshot.Errors.
	Foreign bool `json:"extern,omitempty"`
}

// PartitionLag is one partition of a group.
type PartitionLag struct {
	Topic     string `json:"topic"`
	Partition int32  `json:"particio"`
	Committed int64  `json:"confirmat"` // -1: the group committed nothing here
	End       int64  `json:"final"`
	Lag       int64  `json:"lag"`
	// OldestSeconds is the age of the first unprocessed record (its
	// timestamp against now); 0 when there is none or it could not be read.
	OldestSeconds float64 `json:"antiguitat_s"`
}

// QueueLag is one RabbitMQ queue.
type QueueLag struct {
	Queue     string `json:"cua"`
	Ready     int    `json:"llestos"`
	Unacked   int    `json:"sense_ack"` // -1: unknown (no management API)
	Consumers int    `json:"consumidors"`
	Err       string `json:"error,omitempty"`
}

// Measurer takes Snapshots. Close releases its Kafka client.
type Measurer struct {
	cfg Config
	cl  *kgo.Client
	adm *kadm.Client
}

// ErrNoGroups is returned by NewMeasurer for Brokers without Groups nor
// AllGroups: which consumer groups are the system's is not guessed.
var ErrNoGroups = errors.New("lag: Config.Brokers needs Config.Groups (the system's consumer groups) or Config.AllGroups")

// NewMeasurer returns a Measurer. Brokers are first contacted by Measure.
// It fails with ErrNoGroups, or when Queues come without AMQP.
func NewMeasurer(cfg Config) (*Measurer, error) {
	cfg.OldestTimeout = cmp.Or(cfg.OldestTimeout, OldestTimeoutDefault)
	cfg.VHost = cmp.Or(cfg.VHost, "/")
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.HTTPClient == nil {
		cfg.HTTPClient = &http.Client{Timeout: 5 * time.Second}
	}
	if len(cfg.Queues) > 0 && cfg.AMQP == nil {
		return nil, errors.New("lag: Config.Queues needs Config.AMQP")
	}
	if len(cfg.Brokers) > 0 && len(cfg.Groups) == 0 && !cfg.AllGroups {
		return nil, ErrNoGroups
	}
	m := &Measurer{cfg: cfg}
	if len(cfg.Brokers) > 0 {
		cl, err := kafka.NewClient(cfg.Brokers, cfg.ClientOpts...)
		if err != nil {
			return nil, err
		}
		m.cl, m.adm = cl, kadm.NewClient(cl)
	}
	return m, nil
}

// Close closes the Kafka client.
func (m *Measurer) Close() {
	if m.cl != nil {
		m.cl.Close()
	}
}

// Measure takes a Snapshot. A part that fails is reported in the Snapshot
// (Errors and the part's Err) and logged; Measure itself fails only when ctx
// ends.
func (m *Measurer) Measure(ctx context.Context) (*Snapshot, error) {
	s := &Snapshot{At: m.cfg.Now(), Outboxes: []OutboxLag{}, Groups: []GroupLag{}, Queues: []QueueLag{}}
	for _, o := range m.cfg.Outboxes {
		l, err := relay.MeasureLag(ctx, o.DB, o.Names)
		ol := OutboxLag{Name: o.Name, Pending: l.Pending, OldestSeconds: l.Oldest.Seconds()}
		if err != nil {
			ol.Err = m.fail(s, "outbox "+o.Name, "its database does not answer", err)
		}
		s.Outboxes = append(s.Outboxes, ol)
	}
	if m.adm != nil {
		m.groups(ctx, s)
	}
	for _, q := range m.cfg.Queues {
		s.Queues = append(s.Queues, m.queues(ctx, s, q)...)
	}
	return s, ctx.Err()
}

// fail records a part that could not be measured: msg (no internals) in the
// snapshot, err in the log.
func (m *Measurer) fail(s *Snapshot, what, msg string, err error) string {
	m.cfg.Logger.Warn("lag: measure", "part", what, "err", err)
	text := what + ": " + msg
	s.Errors = append(s.Errors, text)
	return msg
}

// groupsToMeasure returns the groups of Config.Groups (less the unlisted
// ones with OmitUnlisted) and, with AllGroups, every other listed group;
// foreign tells the latter.
func (m *Measurer) groupsToMeasure(ctx context.Context) (groups []string, foreign map[string]bool, err error) {
	groups = slices.Clone(m.cfg.Groups)
	if !m.cfg.OmitUnlisted && !m.cfg.AllGroups {
		return groups, nil, nil
	}
	listed, err := m.adm.ListGroups(ctx)
	if err != nil {
		return nil, nil, err
	}
	names := listed.Groups()
	if m.cfg.OmitUnlisted {
		groups = slices.DeleteFunc(groups, func(g string) bool { return !slices.Contains(names, g) })
	}
	if m.cfg.AllGroups {
		foreign = map[string]bool{}
		for _, g := range names {
			if !slices.Contains(m.cfg.Groups, g) {
				groups = append(groups, g)
				foreign[g] = true
			}
		}
	}
	return groups, foreign, nil
}

func (m *Measurer) groups(ctx context.Context, s *Snapshot) {
	groups, foreign, err := m.groupsToMeasure(ctx)
	if err != nil {
		m.fail(s, "Kafka", "the brokers do not answer", err)
		return
	}
	if len(groups) == 0 {
		return
	}
	lags, err := m.adm.Lag(ctx, groups...)
	if err != nil {
		m.fail(s, "Kafka", "the brokers do not answer", err)
		return
	}
	want := map[partKey]bool{} // records whose timestamps tell the oldest age
	for _, dl := range lags.Sorted() {
		g := GroupLag{Group: dl.Group, State: dl.State, Members: len(dl.Members), Partitions: []PartitionLag{}, Foreign: foreign[dl.Group]}
		if err := dl.Error(); err != nil {
			if g.Foreign { // logged, not in Errors: its name is not shown by default
				m.cfg.Logger.Warn("lag: measure", "part", "foreign group "+dl.Group, "err", err)
				g.Err = "cannot be described"
			} else {
				g.Err = m.fail(s, "group "+dl.Group, "cannot be described", err)
			}
			s.Groups = append(s.Groups, g)
			continue
		}
		for _, ml := range dl.Lag.Sorted() {
			p := PartitionLag{Topic: ml.Topic, Partition: ml.Partition, Committed: ml.Commit.At, End: ml.End.Offset, Lag: max(ml.Lag, 0)}
			if ml.Err != nil {
				m.cfg.Logger.Warn("lag: partition", "group", dl.Group, "topic", ml.Topic, "partition", ml.Partition, "err", ml.Err)
			}
			if p.Lag > 0 {
				want[partKey{ml.Topic, ml.Partition, p.End - p.Lag}] = true
			}
			g.Total += p.Lag
			g.Partitions = append(g.Partitions, p)
		}
		s.Groups = append(s.Groups, g)
	}
	if len(want) == 0 {
		return
	}
	times := m.oldest(ctx, want)
	for i := range s.Groups {
		g := &s.Groups[i]
		for j := range g.Partitions {
			p := &g.Partitions[j]
			if p.Lag == 0 {
				continue
			}
			if ts, ok := times[partKey{p.Topic, p.Partition, p.End - p.Lag}]; ok {
				p.OldestSeconds = max(s.At.Sub(ts).Seconds(), 0)
				g.OldestSeconds = max(g.OldestSeconds, p.OldestSeconds)
			}
		}
	}
}

// partKey is a record position: topic, partition, offset.
type partKey struct {
	topic     string
	partition int32
	offset    int64
}

// oldest reads the timestamp of the first record at or after each wanted
// position, within OldestTimeout. One client reads one offset per
// partition, so positions of the same partition (groups at different
// offsets) are read in rounds.
func (m *Measurer) oldest(ctx context.Context, want map[partKey]bool) map[partKey]time.Time {
	ctx, cancel := context.WithTimeout(ctx, m.cfg.OldestTimeout)
	defer cancel()
	byPart := map[[2]any][]int64{}
	for k := range want {
		pk := [2]any{k.topic, k.partition}
		byPart[pk] = append(byPart[pk], k.offset)
	}
	out := map[partKey]time.Time{}
	for round := 0; ctx.Err() == nil; round++ {
		parts := map[string]map[int32]kgo.Offset{}
		pending := map[[2]any]int64{}
		for pk, offs := range byPart {
			if round >= len(offs) {
				continue
			}
			slices.Sort(offs)
			t, p := pk[0].(string), pk[1].(int32)
			if parts[t] == nil {
				parts[t] = map[int32]kgo.Offset{}
			}
			parts[t][p] = kgo.NewOffset().At(offs[round])
			pending[pk] = offs[round]
		}
		if len(pending) == 0 {
			break
		}
		opts := append(slices.Clip(m.cfg.ClientOpts), kgo.SeedBrokers(m.cfg.Brokers...), kgo.ConsumePartitions(parts),
			kgo.FetchMaxWait(200*time.Millisecond))
		cl, err := kgo.NewClient(opts...)
		if err != nil {
			m.cfg.Logger.Warn("lag: oldest records", "err", err)
			break
		}
		for len(pending) > 0 && ctx.Err() == nil {
			fs := cl.PollFetches(ctx)
			fs.EachRecord(func(r *kgo.Record) {
				pk := [2]any{r.Topic, r.Partition}
				off, ok := pending[pk]
				if !ok || r.Offset < off {
					return
				}
				out[partKey{r.Topic, r.Partition, off}] = r.Timestamp
				delete(pending, pk)
			})
		}
		cl.Close()
	}
	return out
}

func (m *Measurer) queues(ctx context.Context, s *Snapshot, queue string) []QueueLag {
	out := []QueueLag{m.queue(ctx, s, queue, true)}
	if dl := m.queue(ctx, s, contract.DLQName(queue), false); dl.Err == "" {
		out = append(out, dl)
	}
	return out
}

// queue measures one queue; a missing one is an error only when required.
func (m *Measurer) queue(ctx context.Context, s *Snapshot, name string, required bool) QueueLag {
	q := QueueLag{Queue: name, Unacked: -1}
	err := m.cfg.AMQP.Do(ctx, func(ch *amqpChannel) error {
		info, err := ch.QueueDeclarePassive(name, true, false, false, false, nil)
		q.Ready, q.Consumers = info.Messages, info.Consumers
		return err
	})
	if err != nil {
		if required {
			q.Err = m.fail(s, "queue "+name, "does not exist or the broker does not answer", err)
		} else {
			q.Err = "absent"
		}
		return q
	}
	if m.cfg.ManagementURL == "" {
		return q
	}
	st, err := m.management(ctx, name)
	switch {
	case err != nil && m.cfg.ManagementBestEffort:
		m.cfg.Logger.Debug("lag: management API", "queue", name, "err", err)
		note(s, NoteNoManagement)
	case err != nil:
		m.fail(s, "queue "+name, "the management API does not answer", err)
	case st.Unacked == nil:
		note(s, NoteNotSampled)
	default:
		q.Unacked = *st.Unacked
	}
	return q
}

// Notes of a Snapshot.
const (
	// NoteNoManagement: the RabbitMQ management API did not answer.
	NoteNoManagement = "unacked unknown: the RabbitMQ management API does not answer (enable the rabbitmq_management plugin, or name its URL)"
	// NoteNotSampled: the management API has no counts for a queue yet.
	NoteNotSampled = "unacked unknown for a queue the management API has not sampled yet"
)

// note adds text to s.Notes once.
func note(s *Snapshot, text string) {
	if !slices.Contains(s.Notes, text) {
		s.Notes = append(s.Notes, text)
	}
}

// WithoutForeign returns s without its Foreign groups (s itself when it
// has none): what is shown by default.
func (s *Snapshot) WithoutForeign() *Snapshot {
	if s == nil || !slices.ContainsFunc(s.Groups, func(g GroupLag) bool { return g.Foreign }) {
		return s
	}
	c := *s
	c.Groups = slices.DeleteFunc(slices.Clone(s.Groups), func(g GroupLag) bool { return g.Foreign })
	return &c
}

// Total is the lag of every group, the pending rows of every outbox and the
// ready messages of every queue (a headline number).
func (s *Snapshot) Total() int64 {
	var n int64
	for _, g := range s.Groups {
		n += g.Total
	}
	for _, o := range s.Outboxes {
		n += o.Pending
	}
	for _, q := range s.Queues {
		n += int64(q.Ready)
	}
	return n
}

// String is a one-line summary, for logs.
func (s *Snapshot) String() string {
	return fmt.Sprintf("%d outboxes, %d groups, %d queues, total %d, %d errors",
		len(s.Outboxes), len(s.Groups), len(s.Queues), s.Total(), len(s.Errors))
}
