package system

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/services/cataleg"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/svc"
)

// startStuck starts inventari and cataleg with cataleg's consumer stuck in
// block, inside its transaction (a pool connection held), and returns once
// it is stuck there.
func startStuck(t *testing.T, block func(ctx context.Context)) *System {
	t.Helper()
	b := kafkatest.New(t, DomainTopics()...)
	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	entered := make(chan struct{}, 1)
	cfg := Config{DatabaseURL: pgtest.URL(), DatabaseSuffix: "s" + hex.EncodeToString(suffix), Brokers: b.Addrs(),
		Services: []string{inventari.Name, cataleg.Name},
		ConsumerFaults: map[string]faults.Consumer[*consumer.Message]{cataleg.ConsumerLowStock: {BeforeTxCommit: func(ctx context.Context, _ pgx.Tx, _ []*consumer.Message) error {
			select {
			case entered <- struct{}{}:
			default:
			}
			block(ctx)
			return ctx.Err()
		}}}}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	s, err := Start(ctx, cfg)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		for _, name := range []string{inventari.Name, cataleg.Name} {
			_ = svc.DropDatabase(context.Background(), pgtest.URL(), svc.DatabaseName(name, cfg.DatabaseSuffix))
		}
	})
	if err := s.Inventari.Restock(ctx, "carbasso", 1); err != nil {
		t.Fatal(err)
	}
	select {
	case <-entered:
	case <-ctx.Done():
		t.Fatal("cataleg's consumer never reached its transaction")
	}
	return s
}

// closeWithin calls Close and reports whether it returned within d.
func closeWithin(s *System, d time.Duration) bool {
	closed := make(chan struct{})
	go func() { s.Close(); close(closed) }()
	select {
	case <-closed:
		return true
	case <-time.After(d):
		return false
	}
}

// A worker that ignores its context and holds a pool connection is left
// behind, as Close promises: Close must still return (closing a pgxpool
// waits for every acquired connection).
func TestCloseReturnsWhenAWorkerHoldsAConnectionForever(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	s := startStuck(t, func(context.Context) { <-release })
	t.Cleanup(func() { close(release) })
	if !closeWithin(s, 2*ShutdownGraceDefault+5*time.Second) {
		t.Fatalf("Close did not return; still running: %v", s.sup.stillRunning())
	}
}

// A consumer whose in-flight transaction waits for its context gives up
// within Close's grace: it returns (its work rolled back, to be redelivered)
// instead of being left behind.
func TestCloseStopsAConsumerStuckInFlightWithinTheGrace(t *testing.T) {
	t.Parallel()
	s := startStuck(t, func(ctx context.Context) { <-ctx.Done() })
	if !closeWithin(s, 2*ShutdownGraceDefault+5*time.Second) {
		t.Fatalf("Close did not return; still running: %v", s.sup.stillRunning())
	}
	if left := s.sup.stillRunning(); len(left) != 0 {
		t.Fatalf("workers left behind by Close: %v", left)
	}
}
