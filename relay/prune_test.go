package relay_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/km0/km0/internal/relaytest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/relay"
)

// insertRows writes n rows of aggregate agg straight into the outbox and
// sets their publicat_en to now() - age (NULL when pending), so a test
// controls which rows are past the retention.
func insertRows(t testing.TB, b *bundle, agg string, n int, published bool, age time.Duration) {
	t.Helper()
	ctx := context.Background()
	var pub any
	if published {
		pub = age.Seconds()
	}
	if _, err := b.s.Pool.Exec(ctx, `INSERT INTO outbox (id, agregat, agregat_id, tipus, carrega)
		SELECT gen_random_uuid(), 'comanda', $1, 'comanda.creada', jsonb_build_object('seq', g) FROM generate_series(1, $2) g`,
		agg, n); err != nil {
		t.Fatal(err)
	}
	if _, err := b.s.Pool.Exec(ctx, `UPDATE outbox SET publicat_en = now() - make_interval(secs => $2::float8),
		creat_en = now() - interval '30 days' WHERE agregat_id = $1 AND $2::float8 IS NOT NULL`, agg, pub); err != nil {
		t.Fatal(err)
	}
}

// docs/design/outbox-relay.md O3. Failure points: a pruning DELETE that touched pending rows
// (even ones created long ago, or parked), rows published within the
// retention, a row another transaction holds (it must be skipped, not waited
// for), or that ran as one big statement. The end state is counted per kind,
// and a statement trigger records each DELETE's transaction and size.
func TestPruneDeletesOnlyPublishedRowsPastTheRetentionInBatches(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	insertRows(t, b, "VELL", 2500, true, 2*time.Hour)
	insertRows(t, b, "RECENT", 300, true, 10*time.Minute)
	insertRows(t, b, "PENDENT", 200, false, 0)
	// Pending rows created long ago: their age must not matter.
	if _, err := b.s.Pool.Exec(ctx, "UPDATE outbox SET creat_en = now() - interval '30 days' WHERE publicat_en IS NULL"); err != nil {
		t.Fatal(err)
	}
	if _, err := b.s.Pool.Exec(ctx, `INSERT INTO outbox_aparcats (id, agregat_id, motiu)
		SELECT id, agregat_id, 'massa gran' FROM outbox WHERE agregat_id = 'PENDENT' LIMIT 1`); err != nil {
		t.Fatal(err)
	}
	if _, err := b.s.Pool.Exec(ctx, `CREATE TABLE esborrats (xid xid8, n int);
		CREATE FUNCTION registra() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN INSERT INTO esborrats SELECT pg_current_xact_id(), count(*) FROM vells; RETURN NULL; END $$;
		CREATE TRIGGER registra AFTER DELETE ON outbox REFERENCING OLD TABLE AS vells
			FOR EACH STATEMENT EXECUTE FUNCTION registra()`); err != nil {
		t.Fatal(err)
	}
	// Another transaction holds one old published row.
	held, err := b.s.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Rollback(ctx) //nolint:errcheck
	if _, err := held.Exec(ctx, "SELECT 1 FROM outbox WHERE agregat_id = 'VELL' ORDER BY publicat_en DESC LIMIT 1 FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	pctx, cancel := context.WithTimeout(ctx, 30*time.Second) // bounds a hang on the held row
	defer cancel()
	n, err := relay.Prune(pctx, b.s.Pool, b.s.Names(), time.Hour, 1000)
	if err != nil {
		t.Fatal(err)
	}
	if n != 2499 {
		t.Errorf("pruned %d, want 2499 (2,500 past the retention less the held one)", n)
	}
	for agg, want := range map[string]int{"VELL": 1, "RECENT": 300, "PENDENT": 200} {
		if got := b.count(t, "SELECT count(*) FROM outbox WHERE agregat_id = $1", agg); got != want {
			t.Errorf("%s rows left: %d, want %d", agg, got, want)
		}
	}
	rows, err := b.s.Pool.Query(ctx, "SELECT n FROM esborrats ORDER BY xid")
	if err != nil {
		t.Fatal(err)
	}
	sizes, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		t.Fatal(err)
	}
	if len(sizes) != 3 || sizes[0] != 1000 || sizes[1] != 1000 || sizes[2] != 499 {
		t.Errorf("DELETE statements removed %v rows, want [1000 1000 499], each in its own transaction", sizes)
	}
	if d := b.count(t, "SELECT count(DISTINCT xid) FROM esborrats"); d != len(sizes) {
		t.Errorf("%d DELETEs ran in %d transactions, want one each", len(sizes), d)
	}
	// The held row goes once released.
	if err := held.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if n, err := relay.Prune(ctx, b.s.Pool, b.s.Names(), time.Hour, 0); err != nil || n != 1 {
		t.Errorf("second pass pruned %d (%v), want 1", n, err)
	}
}

func TestPruneRefusesBadSettings(t *testing.T) {
	b := setup(t)
	for _, c := range []struct {
		older time.Duration
		batch int
	}{{0, 10}, {-time.Hour, 10}, {time.Hour, -1}, {time.Hour, relay.PruneBatchMax + 1}} {
		if _, err := relay.Prune(context.Background(), b.s.Pool, b.s.Names(), c.older, c.batch); !errors.Is(err, relay.ErrPruneConfig) {
			t.Errorf("Prune(%v, %d): %v, want ErrPruneConfig", c.older, c.batch, err)
		}
	}
	cfg := b.config()
	cfg.PruneOlderThan, cfg.PruneBatch = -time.Second, relay.PruneBatchMax+1
	if _, err := relay.New(cfg); !errors.Is(err, relay.ErrConfig) {
		t.Errorf("relay.New with a negative PruneOlderThan and a huge PruneBatch: %v, want ErrConfig", err)
	}
}

// docs/design/outbox-relay.md O4 with I3. Failure points: pruning that deletes a row before
// it is published (lost event), that blocks the claims, or that disturbs
// commit order. 4 writers commit 2 events each on 200 aggregates while the
// relay runs with an aggressive retention (5 ms, a pass every 5 ms, 50 rows a
// DELETE); every event must reach the topic once in commit order, the table
// must end with rows pruned, and the metrics must count them.
func TestPruneWhileTheRelayAndWritersRunLosesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	w := newWriters(t, b, 200)
	cfg := b.config()
	cfg.Workers = 0
	cfg.PruneOlderThan, cfg.PruneInterval, cfg.PruneBatch = 5*time.Millisecond, 5*time.Millisecond, 50
	reg := prometheus.NewRegistry()
	cfg.Metrics = reg
	start(t, b.newRelay(t, cfg))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := w.Run(ctx, 4, 150, 42); err != nil {
		t.Fatal(err)
	}
	want := w.Counts(t)
	events := relaytest.Total(want)
	testkit.Eventually(t, 60*time.Second, "every event published", func() bool { return b.pending(t) == 0 })
	perKey, copies := relaytest.FirstSeqs(t, b.read(t, events))
	if len(copies) != events {
		t.Fatalf("%d distinct events on the topic, want %d", len(copies), events)
	}
	relaytest.CheckCommitOrder(t, perKey, want)
	testkit.Eventually(t, 30*time.Second, "the published rows to be pruned", func() bool {
		return b.count(t, "SELECT count(*) FROM outbox") == 0
	})

	testkit.Eventually(t, 10*time.Second, "the pruned counter", func() bool { return gauge(t, reg, relay.MetricPruned) == float64(events) })
	if size := gauge(t, reg, relay.MetricTableBytes); size <= 0 {
		t.Errorf("%s = %v, want the table's size", relay.MetricTableBytes, size)
	}
}

// gauge reads the one value of metric name from reg (a counter or gauge).
func gauge(t testing.TB, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name || len(mf.GetMetric()) == 0 {
			continue
		}
		m := mf.GetMetric()[0]
		if c := m.GetCounter(); c != nil {
			return c.GetValue()
		}
		return m.GetGauge().GetValue()
	}
	t.Fatalf("metric %s not found", name)
	return 0
}
