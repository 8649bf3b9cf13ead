// Package lag measures whether asynchrony keeps up or piles up invisible
// debt: each transactional outbox's pending rows and the age of the oldest,
// each Kafka consumer group's lag per partition (committed offset against
// the end) and the age of its oldest unprocessed record, and each RabbitMQ
// queue's ready and unacknowledged messages.
//
// The brokers are measured through the probes this package declares
// (GroupProbe, QueueProbe), so it links no broker client: the Kafka probe
// is package transport/kafka/kafkalag, the RabbitMQ one
// transport/amqp/amqplag.
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
	"strconv"
	"time"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/relay"
)

// OldestTimeoutDefault bounds the reads of the oldest unprocessed records of
// one Measure.
const OldestTimeoutDefault = 3 * time.Second

// Outbox is one transactional outbox to watch.
type Outbox struct {
	Name  string        // shown and used as the outbox label, e.g. "comandes"
	DB    relay.Querier // its database
	Names migrate.Names // schema and table; default public.outbox
	// WAL marks an outbox in WAL mode (outbox.ModeWAL): its events are
	// logical decoding messages, and what is pending is its replication
	// slot's lag (Measurer.outboxWAL), not rows.
	WAL bool
	// Slot is the WAL-mode outbox's replication slot. Default
	// migrate.WALSlot(<the database>, Names), the relay's and km0
	// migrate's default.
	Slot string
}

// Config configures a Measurer. Every part is optional: what is not
// configured is not measured.
type Config struct {
	Outboxes []Outbox
	// Kafka measures the consumer groups (kafkalag.New); nil: no consumer
	// groups. The Measurer closes it.
	Kafka GroupProbe
	// Groups are the system's consumer groups: the ones reported. A group
	// of another Kafka client is not shown (its name, its topics) unless
	// AllGroups. With Kafka, Groups or AllGroups is required.
	Groups []string
	// OmitUnlisted drops a group of Groups that the cluster does not list
	// (one that has never joined nor committed), for a default list of
	// groups of which a deployment may run only some. Default false: every
	// group of Groups is reported, an unknown one with no partitions.
	OmitUnlisted bool
	// AllGroups also reports every other group the cluster lists, marked
	// Foreign. Default false: only Groups.
	AllGroups bool
	// RabbitMQ measures Queues (amqplag.New).
	RabbitMQ QueueProbe
	// Queues are the RabbitMQ queues to report (their .dlq too, if it exists).
	Queues []string
	// ManagementURL is the base URL of the RabbitMQ management API
	// (http://user:password@host:15672; amqplag.ManagementURLFor derives it
	// from the AMQP URL). AMQP tells a queue's ready messages only; the
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
	Pending       int64   `json:"pendents"`     // table mode: the unpublished rows
	OldestSeconds float64 `json:"antiguitat_s"` // of the oldest pending row or unconfirmed WAL message; 0 when none or unknown
	Err           string  `json:"error,omitempty"`
	// WAL is set for an outbox in WAL mode: its slot, instead of rows.
	WAL *SlotLag `json:"wal,omitempty"`
}

// SlotLag is the replication slot of a WAL-mode outbox, read from
// pg_replication_slots (the figures of relay/cdc's
// km0_relay_cdc_slot_lag_bytes and km0_relay_cdc_slot_retained_wal_bytes).
type SlotLag struct {
	Slot          string `json:"slot"`
	LagBytes      int64  `json:"lag_bytes"`          // current WAL position - confirmed_flush_lsn: written, not confirmed by the relay
	RetainedBytes int64  `json:"wal_retingut_bytes"` // current WAL position - restart_lsn: the WAL the server keeps for the slot
	WALStatus     string `json:"wal_status"`         // reserved, extended, unreserved or lost (events lost)
	Active        bool   `json:"actiu"`              // a relay streams from it
	// OldestKnown says whether OldestSeconds is the age of the oldest
	// unconfirmed message: read (without consuming it) from a slot no relay
	// streams from; a streaming slot cannot be read from outside, and its
	// age is the relay's km0_relay_cdc_slot_lag_seconds.
	OldestKnown bool `json:"antiguitat_coneguda"`
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

// GroupProbe measures consumer groups on a broker: what a Measurer needs
// of Kafka (kafkalag.Probe implements it).
type GroupProbe interface {
	// ListGroups returns the groups the cluster lists.
	ListGroups(ctx context.Context) ([]string, error)
	// Describe returns the state and the lag per partition of each of
	// groups, sorted by group, then topic and partition; a group that
	// cannot be described has Err set. An error fails every group.
	Describe(ctx context.Context, groups []string) ([]GroupState, error)
	// Oldest returns the timestamp of the first record at or after each
	// position, reading until ctx ends; a position it could not read is
	// missing.
	Oldest(ctx context.Context, at []Position) map[Position]time.Time
	// Close releases the probe's clients.
	Close()
}

// GroupState is what a GroupProbe tells of one group.
type GroupState struct {
	Group   string
	State   string
	Members int
	// Partitions hold the group's partitions with Committed, End and Lag
	// (≥ 0); OldestSeconds is the Measurer's to fill.
	Partitions []PartitionLag
	// Err: the group could not be described.
	Err error
}

// Position is a record's place: topic, partition, offset.
type Position struct {
	Topic     string
	Partition int32
	Offset    int64
}

// QueueProbe measures queues on a broker: what a Measurer needs of
// RabbitMQ (amqplag.Probe implements it).
type QueueProbe interface {
	// Queue returns the ready messages and the consumers of the queue name;
	// an error when it does not exist or the broker does not answer.
	Queue(ctx context.Context, name string) (ready, consumers int, err error)
}

// Measurer takes Snapshots. Close releases its Kafka probe.
type Measurer struct {
	cfg Config
}

// ErrNoGroups is returned by NewMeasurer for Kafka without Groups nor
// AllGroups: which consumer groups are the system's is not guessed.
var ErrNoGroups = errors.New("lag: Config.Kafka needs Config.Groups (the system's consumer groups) or Config.AllGroups")

// NewMeasurer returns a Measurer. The brokers are first contacted by
// Measure. It fails with ErrNoGroups, or when Queues come without RabbitMQ.
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
	if len(cfg.Queues) > 0 && cfg.RabbitMQ == nil {
		return nil, errors.New("lag: Config.Queues needs Config.RabbitMQ")
	}
	if cfg.Kafka != nil && len(cfg.Groups) == 0 && !cfg.AllGroups {
		return nil, ErrNoGroups
	}
	return &Measurer{cfg: cfg}, nil
}

// Close closes the Kafka probe.
func (m *Measurer) Close() {
	if m.cfg.Kafka != nil {
		m.cfg.Kafka.Close()
	}
}

// Measure takes a Snapshot. A part that fails is reported in the Snapshot
// (Errors and the part's Err) and logged; Measure itself fails only when ctx
// ends.
func (m *Measurer) Measure(ctx context.Context) (*Snapshot, error) {
	s := &Snapshot{At: m.cfg.Now(), Outboxes: []OutboxLag{}, Groups: []GroupLag{}, Queues: []QueueLag{}}
	for _, o := range m.cfg.Outboxes {
		if o.WAL {
			s.Outboxes = append(s.Outboxes, m.outboxWAL(ctx, s, o))
			continue
		}
		l, err := relay.MeasureLag(ctx, o.DB, o.Names)
		ol := OutboxLag{Name: o.Name, Pending: l.Pending, OldestSeconds: l.Oldest.Seconds()}
		if err != nil {
			ol.Err = m.fail(s, "outbox "+o.Name, "its database does not answer", err)
		}
		s.Outboxes = append(s.Outboxes, ol)
	}
	if m.cfg.Kafka != nil {
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
	names, err := m.cfg.Kafka.ListGroups(ctx)
	if err != nil {
		return nil, nil, err
	}
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
	states, err := m.cfg.Kafka.Describe(ctx, groups)
	if err != nil {
		m.fail(s, "Kafka", "the brokers do not answer", err)
		return
	}
	var want []Position // records whose timestamps tell the oldest age
	for _, dl := range states {
		g := GroupLag{Group: dl.Group, State: dl.State, Members: dl.Members, Partitions: []PartitionLag{}, Foreign: foreign[dl.Group]}
		if err := dl.Err; err != nil {
			if g.Foreign { // logged, not in Errors: its name is not shown by default
				m.cfg.Logger.Warn("lag: measure", "part", "foreign group "+dl.Group, "err", err)
				g.Err = "cannot be described"
			} else {
				g.Err = m.fail(s, "group "+dl.Group, "cannot be described", err)
			}
			s.Groups = append(s.Groups, g)
			continue
		}
		for _, p := range dl.Partitions {
			p.Lag, p.OldestSeconds = max(p.Lag, 0), 0
			if p.Lag > 0 {
				if at := (Position{p.Topic, p.Partition, p.End - p.Lag}); !slices.Contains(want, at) {
					want = append(want, at)
				}
			}
			g.Total += p.Lag
			g.Partitions = append(g.Partitions, p)
		}
		s.Groups = append(s.Groups, g)
	}
	if len(want) == 0 {
		return
	}
	octx, cancel := context.WithTimeout(ctx, m.cfg.OldestTimeout)
	times := m.cfg.Kafka.Oldest(octx, want)
	cancel()
	for i := range s.Groups {
		g := &s.Groups[i]
		for j := range g.Partitions {
			p := &g.Partitions[j]
			if p.Lag == 0 {
				continue
			}
			if ts, ok := times[Position{p.Topic, p.Partition, p.End - p.Lag}]; ok {
				p.OldestSeconds = max(s.At.Sub(ts).Seconds(), 0)
				g.OldestSeconds = max(g.OldestSeconds, p.OldestSeconds)
			}
		}
	}
}

// maxShards bounds the shard queues of one ordered consumer looked up.
const maxShards = 1024

// queues measures a queue of Config.Queues and its DLQ, if it exists. A
// queue that does not exist may be the logical queue of an ordered
// consumer, which has no queue of its own: its shard queues <queue>.0,
// <queue>.1, ... (CONTRACT.md) are measured instead, and its one DLQ.
func (m *Measurer) queues(ctx context.Context, s *Snapshot, queue string) []QueueLag {
	var out []QueueLag
	q, err := m.queue(ctx, s, queue)
	if err == nil {
		out = append(out, q)
	} else {
		for i := 0; i < maxShards; i++ {
			sq, serr := m.queue(ctx, s, queue+"."+strconv.Itoa(i))
			if serr != nil {
				break
			}
			out = append(out, sq)
		}
		if len(out) == 0 {
			q.Err = m.fail(s, "queue "+queue, "does not exist or the broker does not answer", err)
			out = append(out, q)
		}
	}
	if dl, err := m.queue(ctx, s, contract.DLQName(queue)); err == nil {
		out = append(out, dl)
	}
	return out
}

// queue measures one queue; it fails, recording nothing, when the queue
// does not exist or the broker does not answer.
func (m *Measurer) queue(ctx context.Context, s *Snapshot, name string) (QueueLag, error) {
	q := QueueLag{Queue: name, Unacked: -1}
	ready, consumers, err := m.cfg.RabbitMQ.Queue(ctx, name)
	q.Ready, q.Consumers = ready, consumers
	if err != nil {
		return q, err
	}
	if m.cfg.ManagementURL == "" {
		return q, nil
	}
	st, err := m.management(ctx, name)
	switch {
	case err != nil && m.cfg.ManagementBestEffort:
		m.cfg.Logger.Debug("lag: management API", "queue", name, "err", err)
		note(s, NoteNoManagement)
	case err != nil:
		m.fail(s, "queue "+name, "the management API does not answer", err)
	case st.Unacked == nil:
		note(s, noteNotSampled)
	default:
		q.Unacked = *st.Unacked
	}
	return q, nil
}

// Notes of a Snapshot.
const (
	// noteWALStreaming: the age of a WAL outbox's oldest message is the relay's.
	noteWALStreaming = "the oldest unconfirmed message of a WAL outbox whose slot a relay streams from is the relay's km0_relay_cdc_slot_lag_seconds"
	// NoteNoManagement: the RabbitMQ management API did not answer.
	NoteNoManagement = "unacked unknown: the RabbitMQ management API does not answer (enable the rabbitmq_management plugin, or name its URL)"
	// noteNotSampled: the management API has no counts for a queue yet.
	noteNotSampled = "unacked unknown for a queue the management API has not sampled yet"
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
