package relay_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/km0/km0/migrate"
	"github.com/km0/km0/relay"
)

// The defaults a zero Config gets (New applies WithDefaults), and the limit
// of BatchSize.
func ExampleConfig_WithDefaults() {
	c := relay.Config{}.WithDefaults()
	fmt.Println("ApplicationName", c.ApplicationName == relay.ApplicationNameDefault, c.ApplicationName)
	fmt.Println("PublishTimeout", c.PublishTimeout == relay.PublishTimeoutDefault, c.PublishTimeout)
	fmt.Println("Backoff", c.BackoffMin == relay.BackoffMinDefault, c.BackoffMin, c.BackoffMax == relay.BackoffMaxDefault, c.BackoffMax)
	fmt.Println("RebalanceInterval", c.RebalanceInterval == relay.RebalanceIntervalDefault, c.RebalanceInterval)
	fmt.Println("ListenCheckTimeout", c.ListenCheckTimeout == relay.ListenCheckTimeoutDefault, c.ListenCheckTimeout)
	fmt.Println("PruneInterval", c.PruneInterval == relay.PruneIntervalDefault, c.PruneInterval)
	fmt.Println("BatchSize at most", relay.BatchSizeMax)
	// Output:
	// ApplicationName true km0-relay
	// PublishTimeout true 30s
	// Backoff true 100ms true 5s
	// RebalanceInterval true 1s
	// ListenCheckTimeout true 2s
	// PruneInterval true 1m0s
	// BatchSize at most 10000
}

// New checks the Config before it connects to anything: an invalid one (here
// a BatchSize over BatchSizeMax, and no Publisher) wraps ErrConfig.
func ExampleNew_invalidConfig() {
	_, err := relay.New(relay.Config{DatabaseURL: "postgres://127.0.0.1/app", BatchSize: relay.BatchSizeMax + 1})
	fmt.Println(errors.Is(err, relay.ErrConfig))
	// Output:
	// true
}

// Prune checks its retention and batch before it touches the database: out
// of range, they wrap ErrPruneConfig. db is a relay.DBTX: a *pgxpool.Pool,
// a *pgx.Conn or a pgx.Tx.
func ExamplePrune_invalid() {
	var db relay.DBTX
	_, err := relay.Prune(context.Background(), db, migrate.Names{}, 0, relay.PruneBatchDefault)
	fmt.Println(errors.Is(err, relay.ErrPruneConfig))
	// Output:
	// true
}

// Behind a transaction pooler (PgBouncer in transaction mode) LISTEN never
// hears a notification; the relay notices at its first run and polls
// instead. Pooled says which way it runs, for a health page.
func ExampleRelay_Pooled() {
	var r *relay.Relay // from relay.New
	if _, err := r.RunOnce(context.Background()); err == nil && r.Pooled() {
		fmt.Println("behind a transaction pooler: polling every PollInterval")
	}
}
