package relay

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/km0/km0/envelope"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/transport"
)

// Defaults of Config.
const (
	// BatchSizeStart is the first claim size of an adaptive relay (BatchSize
	// 0, the default): the LOT of the textbook polling relay.
	BatchSizeStart = 100
	// BatchSizeAdaptiveMax is the largest claim an adaptive relay grows to
	// under a backlog. Past it a claim only lengthens its transaction: with
	// kfake in another process, 2,000 rows a claim did ~95k events/s against
	// ~55k at 100.
	BatchSizeAdaptiveMax = 2000
	// BatchSizeMax bounds a fixed BatchSize: larger claims only lengthen
	// transactions.
	BatchSizeMax = 10_000
	// PollIntervalDefault is the fallback poll when no notification arrives.
	PollIntervalDefault = 200 * time.Millisecond
	// WorkersDefault is the most claim workers an instance with Workers 0 (the
	// default) runs, each with its own session and its own shards. The second
	// one joins under a backlog and overlaps its claims and marks in
	// PostgreSQL with the first one's publication to the broker; when idle one
	// worker serves every shard, which keeps the latency of a lone event low.
	WorkersDefault = 2
	// extraWorkerIdle is how long an extra worker of an adaptive instance
	// (Workers 0) goes without a claim at least a quarter full before it
	// hands its shards back and leaves.
	extraWorkerIdle = time.Second
	// PublishTimeoutDefault bounds one Publish call (waiting for every
	// confirmation); past it the batch is rolled back and retried.
	PublishTimeoutDefault = 30 * time.Second
	// BackoffMinDefault and BackoffMaxDefault bound the exponential backoff
	// after a failed cycle (broker or database down).
	BackoffMinDefault = 100 * time.Millisecond
	BackoffMaxDefault = 5 * time.Second
	// RebalanceIntervalDefault is how often a worker recounts the relay
	// instances and gives up or takes shards.
	RebalanceIntervalDefault = time.Second
	// MaxRecordBytesDefault is the largest record (key + value + headers) the
	// relay hands to the broker: the consumers' 1 MiB envelope limit less 1 KiB,
	// so that with Kafka's framing it stays under the producer's batch limit
	// (1 MiB in transport/kafka). Larger rows are parked unsent.
	MaxRecordBytesDefault = envelope.DefaultMaxBytes - 1024
	// ListenCheckTimeoutDefault is how long the LISTEN self-test at start
	// waits for its notification (CheckListen). On a working connection it
	// arrives within milliseconds.
	ListenCheckTimeoutDefault = 2 * time.Second
	// ApplicationNameDefault is the application_name of the relay's sessions.
	ApplicationNameDefault = "km0-relay"
)

// ShardCount is the fixed number of shards: a row belongs to shard
// (hashtext(agregat_id) & 2147483647) % 64. It is part of the protocol between
// relay instances and must not change while any of them runs.
const ShardCount = 64

// ErrConfig is wrapped by every error New returns for an invalid Config.
var ErrConfig = errors.New("relay: invalid config")

// Transform turns one row (and its default envelope) into the envelopes to
// publish for it, in order, all with the row's agregat_id as key. Returning an
// error parks the row with the error as its reason; so does returning no
// envelope or a nil one (the row is never marked published with nothing sent).
type Transform func(row *outbox.Row, env *envelope.Envelope) ([]*envelope.Envelope, error)

// Config configures a Relay. Publisher, Topic and Origin are required, and
// one of Pool or DatabaseURL.
type Config struct {
	// Pool supplies the connection settings (the relay opens its own dedicated
	// sessions with Pool's ConnConfig, because it holds session advisory locks)
	// and runs the lag queries.
	Pool *pgxpool.Pool
	// DatabaseURL is used when Pool is nil.
	DatabaseURL string
	// Names of the schema and outbox table; default public.outbox.
	Names migrate.Names
	// Publisher publishes with confirmation (transport/kafka.Publisher).
	Publisher transport.Publisher
	// Topic receives every event, e.g. "comandes.esdeveniments".
	Topic string
	// Origin is the envelope's origen, e.g. "comandes".
	Origin string
	// BatchSize fixes the number of rows per claim, at most BatchSizeMax. The
	// default, 0, adapts it to the backlog, per worker: the first claim takes
	// BatchSizeStart rows, a claim that comes back full doubles the next one
	// (up to BatchSizeAdaptiveMax), and one that comes back with less than a
	// quarter of its size halves it (down to BatchSizeStart). A batch is
	// published in chunks of a quarter of its claim size, at least 100 rows.
	BatchSize int
	// PollInterval is the fallback poll. Default PollIntervalDefault.
	PollInterval time.Duration
	// Workers fixes the number of claim workers, 1..ShardCount, all running
	// from the start. The default, 0, adapts it: one worker serves every
	// shard; when its claims come back full (at least 4 × BatchSizeStart rows,
	// or a full fixed BatchSize) a second one joins (up to WorkersDefault in
	// all) and takes half of them, and it leaves again after a second
	// without a claim at least a quarter full, handing them back.
	Workers int
	// PublishTimeout bounds one Publish. Default PublishTimeoutDefault.
	PublishTimeout time.Duration
	// BackoffMin and BackoffMax bound the retry backoff. Defaults
	// BackoffMinDefault and BackoffMaxDefault.
	BackoffMin, BackoffMax time.Duration
	// RebalanceInterval is how often shard ownership is recomputed. Default
	// RebalanceIntervalDefault.
	RebalanceInterval time.Duration
	// MaxRecordBytes parks rows whose record (key + value + headers) is
	// larger, without sending them, so no later row of their aggregate goes
	// out ahead of them. Keep it below the producer's batch limit and the
	// topic's max.message.bytes: a record the broker refuses after it was
	// sent is parked too, but a later row of its aggregate in the same chunk
	// of the batch has then already been confirmed. Default
	// MaxRecordBytesDefault.
	MaxRecordBytes int
	// ListenCheckTimeout bounds the wait of the LISTEN self-test that Run
	// and the first RunOnce make before anything else (CheckListen). When no
	// notification arrives in time, the relay logs a warning naming the
	// cause and falls back to polling every PollInterval, with shards owned
	// per claim transaction. Default ListenCheckTimeoutDefault.
	ListenCheckTimeout time.Duration
	// ApplicationName is the application_name of the relay's sessions.
	// Default ApplicationNameDefault.
	ApplicationName string
	// Logger receives the relay's logs. Default slog.Default().
	Logger *slog.Logger
	// Metrics, if set, receives the relay's Prometheus metrics (labelled with
	// the outbox table). Registration errors fail New.
	Metrics prometheus.Registerer
	// PruneOlderThan, if positive, makes Run delete published rows marked
	// more than this long ago (see Prune), a pass at start and then every
	// PruneInterval. Keep it at least as long as the window you may want to
	// replay from the outbox. Default 0: rows are never deleted.
	PruneOlderThan time.Duration
	// DeletePublished makes the mark a DELETE: each row is deleted as soon
	// as the broker confirmed it, instead of getting publicat_en, so the
	// outbox holds only pending (and parked) rows and no pruning is needed
	// (a retention of zero, which the contract allows). Nothing can then be
	// replayed from the outbox, and publicat_en tells nothing. It costs
	// PostgreSQL less than the mark (no new row version, no index entries):
	// docs/outbox-and-relay.md, Keeping the outbox small. Default false.
	DeletePublished bool
	// PruneInterval is the time between pruning passes. Default
	// PruneIntervalDefault.
	PruneInterval time.Duration
	// PruneBatch is the rows per pruning DELETE, 1..PruneBatchMax. Default
	// PruneBatchDefault.
	PruneBatch int
	// Transform, if set, replaces the default of one envelope per row.
	Transform Transform
}

// WithDefaults returns c with zero fields set to their defaults.
func (c Config) WithDefaults() Config {
	c.Names = c.Names.WithDefaults()
	c.PollInterval = cmp.Or(c.PollInterval, PollIntervalDefault)
	c.PublishTimeout = cmp.Or(c.PublishTimeout, PublishTimeoutDefault)
	c.BackoffMin = cmp.Or(c.BackoffMin, BackoffMinDefault)
	c.BackoffMax = cmp.Or(c.BackoffMax, BackoffMaxDefault)
	c.RebalanceInterval = cmp.Or(c.RebalanceInterval, RebalanceIntervalDefault)
	c.MaxRecordBytes = cmp.Or(c.MaxRecordBytes, MaxRecordBytesDefault)
	c.ApplicationName = cmp.Or(c.ApplicationName, ApplicationNameDefault)
	c.ListenCheckTimeout = cmp.Or(c.ListenCheckTimeout, ListenCheckTimeoutDefault)
	c.PruneInterval = cmp.Or(c.PruneInterval, PruneIntervalDefault)
	c.PruneBatch = cmp.Or(c.PruneBatch, PruneBatchDefault)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

func (c Config) validate() error {
	errs := c.CheckShared()
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if err := CheckSizes(c.BatchSize, c.Workers, "BatchSize", "Workers"); err != nil {
		errs = append(errs, err)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"PollInterval", c.PollInterval}, {"RebalanceInterval", c.RebalanceInterval}, {"ListenCheckTimeout", c.ListenCheckTimeout}} {
		if d.v < 0 {
			bad("%s %v is negative", d.name, d.v)
		}
	}
	if len(errs) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %w", ErrConfig, errors.Join(errs...))
}

// CheckSizes returns what New would refuse in a fixed BatchSize (batch,
// 0..BatchSizeMax) or Workers (workers, 0..ShardCount), 0 being the
// adaptive default of both, nil when both are in range. The errors call them
// batchName and workersName, so that a command can check its flags before
// anything connects and name them (--batch, --workers) as the user typed them.
func CheckSizes(batch, workers int, batchName, workersName string) error {
	var errs []error
	if batch < 0 || batch > BatchSizeMax {
		errs = append(errs, fmt.Errorf("%s %d is outside 0 (adaptive)..%d", batchName, batch, BatchSizeMax))
	}
	if workers < 0 || workers > ShardCount {
		errs = append(errs, fmt.Errorf("%s %d is outside 0 (adaptive)..%d", workersName, workers, ShardCount))
	}
	return errors.Join(errs...)
}

// CheckShared returns what is wrong with the fields every relay reads, the
// polling one and the CDC one (package relay/cdc) alike: Pool or
// DatabaseURL, Publisher, Topic and Origin required; PublishTimeout,
// BackoffMin, BackoffMax, PruneOlderThan and PruneInterval not negative,
// BackoffMax not below BackoffMin; PruneBatch within 0..PruneBatchMax;
// MaxRecordBytes not negative. nil when all is well.
func (c Config) CheckShared() []error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if c.Pool == nil && c.DatabaseURL == "" {
		bad("Pool or DatabaseURL is required")
	}
	if c.Publisher == nil {
		bad("Publisher is required")
	}
	if c.Topic == "" {
		bad("Topic is required")
	}
	if c.Origin == "" {
		bad("Origin is required")
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"PublishTimeout", c.PublishTimeout}, {"BackoffMin", c.BackoffMin}, {"BackoffMax", c.BackoffMax},
		{"PruneOlderThan", c.PruneOlderThan}, {"PruneInterval", c.PruneInterval}} {
		if d.v < 0 {
			bad("%s %v is negative", d.name, d.v)
		}
	}
	if c.BackoffMax < c.BackoffMin {
		bad("BackoffMax %v is below BackoffMin %v", c.BackoffMax, c.BackoffMin)
	}
	if c.PruneBatch < 0 || c.PruneBatch > PruneBatchMax {
		bad("PruneBatch %d is outside 0 (default %d)..%d", c.PruneBatch, PruneBatchDefault, PruneBatchMax)
	}
	if c.MaxRecordBytes < 0 {
		bad("MaxRecordBytes %d is negative", c.MaxRecordBytes)
	}
	return errs
}
