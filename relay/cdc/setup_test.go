package cdc_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/relaytest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/relay/cdc"
)

// The machine's shared server has wal_level = replica: --mode cdc refuses
// at once, naming the setting and its fix, instead of retrying for ever.
func TestRefusesAServerWithoutLogicalWALLevel(t *testing.T) {
	t.Parallel()
	shared := "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	pool := pgtest.NewPool(t, shared, 2)
	var level string
	if err := pool.QueryRow(context.Background(), "SHOW wal_level").Scan(&level); err != nil {
		t.Fatalf("the machine's PostgreSQL is required at 127.0.0.1:5432: %v", err)
	}
	if level == "logical" {
		t.Fatal("the shared server is logical already; this proof needs a server with wal_level below logical")
	}
	r, err := cdc.New(cdc.Config{Config: relay.Config{Pool: pool, Publisher: transportNop{}, Topic: "t", Origin: "o", Logger: testLogger()}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = r.Run(ctx)
	if !errors.Is(err, cdc.ErrSetup) || !strings.Contains(err.Error(), "wal_level = "+level) ||
		!strings.Contains(err.Error(), "wal_level = logical") {
		t.Fatalf("Run on a %s server: %v", level, err)
	}
}

// A role without the REPLICATION privilege is refused with the privilege
// named and the statement that grants it.
func TestRefusesARoleWithoutReplication(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	role := "km0_norepl_" + b.s.Name
	if _, err := b.s.Pool.Exec(ctx, "CREATE ROLE "+pgx.Identifier{role}.Sanitize()+" LOGIN"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = b.s.Pool.Exec(context.Background(), "DROP OWNED BY "+pgx.Identifier{role}.Sanitize())
		_, _ = b.s.Pool.Exec(context.Background(), "DROP ROLE "+pgx.Identifier{role}.Sanitize())
	})
	if _, err := b.s.Pool.Exec(ctx, "GRANT USAGE ON SCHEMA "+pgx.Identifier{b.s.Name}.Sanitize()+" TO "+pgx.Identifier{role}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	u := strings.Replace(b.s.URL, "postgres://postgres@", "postgres://"+role+"@", 1)
	rc := b.config()
	rc.Pool = pgtest.NewPool(t, u, 2)
	r := newRelay(t, rc)
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	err := r.Run(rctx)
	if !errors.Is(err, cdc.ErrSetup) || !strings.Contains(err.Error(), "REPLICATION") {
		t.Fatalf("Run as a role without REPLICATION: %v", err)
	}
}

// While the outbox is idle and other tables write WAL, the slot still
// advances (keepalives answered with the server's position), so it does not
// hold WAL back; the slot metrics are exported.
func TestIdleOutboxAdvancesTheSlotAndExportsItsLag(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	reg := prometheus.NewRegistry()
	cfg := b.config()
	cfg.Metrics = reg
	r := newRelay(t, cfg)
	start(t, r)
	testkit.Eventually(t, 10*time.Second, "the relay to hold the slot", r.Active)
	b.enqueue(t, "P-1", relaytest.SeqPayload{Seq: 1})
	testkit.Eventually(t, 10*time.Second, "the row published", func() bool { return b.pending(t) == 0 })
	if _, err := b.s.Pool.Exec(ctx, "CREATE TABLE altra (n int)"); err != nil {
		t.Fatal(err)
	}
	if _, err := b.s.Pool.Exec(ctx, "INSERT INTO altra SELECT generate_series(1, 20000)"); err != nil {
		t.Fatal(err)
	}
	var target int64
	if err := b.s.Pool.QueryRow(ctx, "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8").Scan(&target); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 15*time.Second, "the slot to advance past the other table's WAL", func() bool { return b.confirmedLSN(t) >= target })
	got := gather(t, reg)
	for _, name := range []string{cdc.MetricSlotLagBytes, cdc.MetricSlotRetained, cdc.MetricSlotLagSeconds, relay.MetricPending, relay.MetricTableBytes} {
		if _, ok := got[name]; !ok {
			t.Errorf("metric %s missing: %v", name, got)
		}
	}
	if got[relay.MetricPublished] != 1 || got[cdc.MetricActive] != 1 {
		t.Fatalf("%s = %v (want 1), %s = %v (want 1)", relay.MetricPublished, got[relay.MetricPublished], cdc.MetricActive, got[cdc.MetricActive])
	}
}

// gather returns the value of every single-series metric of reg.
func gather(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		if len(mf.Metric) != 1 {
			continue
		}
		switch m := mf.Metric[0]; {
		case m.Counter != nil:
			out[mf.GetName()] = m.Counter.GetValue()
		case m.Gauge != nil:
			out[mf.GetName()] = m.Gauge.GetValue()
		}
	}
	return out
}

// capcaleres is read by name from the stream's Relation message: with the
// column added (after other new columns, so positions shift), its string
// values become record headers (reserved names and non-strings dropped, as
// outbox.DecodeHeaders says); without it, or NULL, the row goes out without
// them. A null is dropped like a number, never published as "".
func TestCapcaleresBecomeHeadersWhateverTheColumnOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	// An outbox from before the column (migration 004).
	if _, err := b.s.Pool.Exec(ctx, "ALTER TABLE outbox DROP COLUMN capcaleres"); err != nil {
		t.Fatal(err)
	}
	r := newRelay(t, b.config())
	start(t, r)
	testkit.Eventually(t, 10*time.Second, "the relay to hold the slot", r.Active)
	b.enqueue(t, "P-1", relaytest.SeqPayload{Seq: 1}) // no capcaleres column yet
	testkit.Eventually(t, 10*time.Second, "P-1 #1 published", func() bool { return b.pending(t) == 0 })
	for _, stmt := range []string{"ALTER TABLE outbox ADD COLUMN extra TEXT", "ALTER TABLE outbox ADD COLUMN capcaleres JSONB",
		"ALTER TABLE outbox DROP COLUMN extra"} {
		if _, err := b.s.Pool.Exec(ctx, stmt); err != nil {
			t.Fatal(err)
		}
	}
	const ins = `INSERT INTO outbox (id, agregat, agregat_id, tipus, carrega, capcaleres)
		VALUES (gen_random_uuid(), 'comanda', 'P-1', 'comanda.creada', jsonb_build_object('seq', $1::int), $2::jsonb)`
	if _, err := b.s.Pool.Exec(ctx, ins, 2, `{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "n": 3, "tipus": "spoofed", "nul": null, "cert": false}`); err != nil {
		t.Fatal(err)
	}
	if _, err := b.s.Pool.Exec(ctx, ins, 3, nil); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 10*time.Second, "3 rows published", func() bool { return b.pending(t) == 0 })
	recs := b.read(t, 3)
	perKey, _ := relaytest.FirstSeqs(t, recs)
	relaytest.CheckCommitOrder(t, perKey, map[string]int{"P-1": 3})
	for i, rec := range recs {
		hs := map[string]string{}
		for _, h := range rec.Headers {
			if _, dup := hs[h.Key]; dup {
				t.Fatalf("record %d: header %s twice", i, h.Key)
			}
			hs[h.Key] = string(h.Value)
		}
		tp, has := hs["traceparent"]
		if want := i == 1; has != want || (want && !strings.HasPrefix(tp, "00-0af7")) || hs["tipus"] != "comanda.creada" {
			t.Fatalf("record %d headers %v", i, hs)
		}
		for _, k := range []string{"n", "nul", "cert"} {
			if _, ok := hs[k]; ok {
				t.Fatalf("record %d: the non-string capcalera %s became a header: %v", i, k, hs)
			}
		}
	}
}

// A row pending at the first start goes out from the catch-up, not the
// stream: its capcaleres become headers there too.
func TestCapcaleresOfPendingRowsAtTheFirstStartBecomeHeaders(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	if _, err := b.s.Pool.Exec(ctx, `INSERT INTO outbox (id, agregat, agregat_id, tipus, carrega, capcaleres)
		VALUES (gen_random_uuid(), 'comanda', 'P-1', 'comanda.creada', '{"seq": 1}', '{"traceparent": "00-abc-def-01"}')`); err != nil {
		t.Fatal(err)
	}
	start(t, newRelay(t, b.config()))
	testkit.Eventually(t, 10*time.Second, "the row published", func() bool { return b.pending(t) == 0 })
	rec := b.read(t, 1)[0]
	for _, h := range rec.Headers {
		if h.Key == "traceparent" && string(h.Value) == "00-abc-def-01" {
			return
		}
	}
	t.Fatalf("headers %v: no traceparent from capcaleres", rec.Headers)
}
