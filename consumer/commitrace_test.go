package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// TestCommitThatRacedACrashIsCounted: three partitions, one record each.
// Lane 1's COMMIT is held in the server (a deferred trigger waits for an
// advisory lock the test holds); lane 2's handler waits for its context.
// Crash point: lane 0 dies right after its COMMIT and before its offset is
// committed (faults AfterCommit), while lane 1's COMMIT is in flight. The
// crash cancels the work of every lane; lane 2's handler sees it, and only
// then the test lets lane 1's COMMIT through. Lane 1's batch is committed,
// so it is counted: Stats.Processed is 2, the effects committed are 2.
func TestCommitThatRacedACrashIsCounted(t *testing.T) {
	t.Parallel()
	b := setupWith(t, kafkaembed.Config{Partitions: 3})
	ctx := context.Background()
	lockKey := rand.Int64()
	schema := pgx.Identifier{b.s.Name}.Sanitize()
	for _, q := range []string{
		fmt.Sprintf(`CREATE FUNCTION %s.commit_gate() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF current_setting('km0test.commit_gate', true) = 'on' THEN
				PERFORM pg_advisory_xact_lock_shared(%d);
			END IF;
			RETURN NULL;
		END $$`, schema, lockKey),
		fmt.Sprintf(`CREATE CONSTRAINT TRIGGER commit_gate AFTER INSERT ON %s.efectes
			DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION %s.commit_gate()`, schema, schema),
	} {
		if _, err := b.s.Pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	holder, err := b.s.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Release()
	if _, err := holder.Exec(ctx, `SELECT pg_advisory_lock($1)`, lockKey); err != nil {
		t.Fatal(err)
	}
	var unlockOnce sync.Once
	unlock := func() {
		unlockOnce.Do(func() {
			if _, err := holder.Exec(ctx, `SELECT pg_advisory_unlock($1)`, lockKey); err != nil {
				t.Error(err)
			}
		})
	}
	defer unlock()

	pub := kafkatest.Client(t, b.b, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	for p := range int32(3) {
		r := newEvent(fmt.Sprint("K-", p), comanda{ID: fmt.Sprint(p), N: int(p)}).record()
		r.Partition = p
		if err := pub.ProduceSync(ctx, r).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}

	var (
		lane1Committing = make(chan struct{})
		lane2Waiting    = make(chan struct{})
		lane2Cancelled  = make(chan struct{})
		once1, once2    sync.Once
	)
	waitFor := func(ch <-chan struct{}) error {
		select {
		case <-ch:
			return nil
		case <-time.After(60 * time.Second):
			return errors.New("timed out")
		}
	}
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if m.Partition == 2 {
			once2.Do(func() { close(lane2Waiting) })
			<-ctx.Done()
			close(lane2Cancelled)
			return ctx.Err()
		}
		return effect(ctx, tx, m)
	})
	cfg.BatchSize = 1
	cfg.Concurrency = 3
	cfg.Hooks.BeforeTxCommit = func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
		if msgs[0].Partition != 1 {
			return nil
		}
		if _, err := tx.Exec(ctx, `SELECT set_config('km0test.commit_gate', 'on', true)`); err != nil {
			return err
		}
		once1.Do(func() { close(lane1Committing) })
		return nil
	}
	cfg.Hooks.AfterCommit = func(_ context.Context, msgs []*consumer.Message) error {
		if msgs[0].Partition != 0 {
			return nil
		}
		if err := waitFor(lane1Committing); err != nil {
			return fmt.Errorf("lane 1 never reached its COMMIT: %w", err)
		}
		if err := waitFor(lane2Waiting); err != nil {
			return fmt.Errorf("lane 2 never reached its handler: %w", err)
		}
		return faults.ErrCrashed
	}
	r := b.run(cfg)
	if err := waitFor(lane2Cancelled); err != nil {
		t.Fatal("the crash did not cancel the lanes' work")
	}
	unlock() // lane 1's COMMIT goes on, after its context was cancelled
	if err := r.wait(t); !errors.Is(err, faults.ErrCrashed) {
		t.Fatalf("Run: %v, want ErrCrashed", err)
	}
	testkit.Eventually(t, time.Minute, "lanes 0 and 1 committed", func() bool { return b.effects() == 2 })
	if got := b.count(`SELECT count(*) FROM efectes WHERE n IN (0, 1)`); got != 2 {
		t.Fatalf("effects of lanes 0 and 1: %d, want 2", got)
	}
	if got := r.c.Stats().Processed; got != int64(b.effects()) {
		t.Fatalf("Stats.Processed %d, committed effects %d", got, b.effects())
	}
}
