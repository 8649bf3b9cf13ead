package repartiment_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/services/internal/svctest"
	"github.com/km0/km0/internal/services/repartiment"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outcome"
)

type bundle struct {
	pool *pgxpool.Pool
	maps *repartiment.MapsServer
	svc  *repartiment.Service
}

func setup(t *testing.T, fail func(string, int) bool, side *pgxpool.Pool) *bundle {
	t.Helper()
	pool, u := svctest.DB(t, migrate.Outbox, migrate.Inbox, repartiment.Migrations)
	if side == nil {
		side = pgtest.NewPool(t, u, 2)
	}
	maps := &repartiment.MapsServer{Fail: fail}
	srv := httptest.NewServer(maps.Handler())
	t.Cleanup(srv.Close)
	s, err := repartiment.New(repartiment.Config{Pool: pool, SidePool: side, Outbox: svctest.Outbox(t), Maps: &repartiment.MapsClient{BaseURL: srv.URL},
		DeliveryTime: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	return &bundle{pool: pool, maps: maps, svc: s}
}

func paid(id, city string) map[string]any {
	o := map[string]any{"comanda_id": id, "client": "anna", "mercat": "girona", "import_centims": 100}
	if city != "" {
		o["adreca_lliurament"] = map[string]string{"ciutat": city, "codi_postal": "17001"}
	}
	return o
}

func state(t *testing.T, b *bundle, id string) string {
	t.Helper()
	var st string
	_ = b.pool.QueryRow(context.Background(), `SELECT estat FROM lliuraments WHERE comanda_id = $1`, id).Scan(&st)
	return st
}

func events(t *testing.T, b *bundle, tipus string) int {
	return svctest.Count(t, b.pool, "SELECT count(*) FROM outbox WHERE tipus = $1 AND agregat = 'lliurament'", tipus)
}

// Row 1: the maps service answers 503 → transient (retry with backoff, then DLQ).
func TestRowMaps503IsTransient(t *testing.T) {
	t.Parallel()
	b := setup(t, func(_ string, attempt int) bool { return attempt == 1 }, nil)
	m := svctest.Message(t, "comandes.esdeveniments", "comanda.pagada", 1, paid("P-2026-000001", "Girona"))
	err := svctest.Run(t, b.pool, b.svc.HandleOrderPaid, m)
	if k, _ := outcome.Classify(err, repartiment.Classifier); k != outcome.KindTransient || !errors.Is(err, repartiment.ErrMapsUnavailable) {
		t.Fatalf("503: %v (kind %v), want transient", err, k)
	}
	if st := state(t, b, "P-2026-000001"); st != "" {
		t.Fatalf("a failed attempt left state %q", st)
	}
	if err := svctest.Run(t, b.pool, b.svc.HandleOrderPaid, m); err != nil {
		t.Fatalf("retry: %v", err)
	}
	if st := state(t, b, "P-2026-000001"); st != repartiment.StateAssigned || events(t, b, "repartiment.assignat") != 1 {
		t.Fatalf("after retry: %q, %d assignat events", st, events(t, b, "repartiment.assignat"))
	}
}

// Row 2: city not covered → permanent ciutat_no_coberta (DLQ) AND
// repartiment.rebutjat committed, once, although the message is dead-lettered.
func TestRowCityNotCoveredRejectsOnceAndDeadLetters(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, nil)
	m := svctest.Message(t, "comandes.esdeveniments", "comanda.pagada", 1, paid("P-2026-000002", "Perpinyà"))
	for i := range 2 { // the second delivery: the process died before the DLQ copy
		err := svctest.Run(t, b.pool, b.svc.HandleOrderPaid, m)
		if !outcome.IsPermanent(err) || outcome.Reason(outcome.KindPermanent, err)[:len("permanent: ciutat_no_coberta")] != "permanent: ciutat_no_coberta" {
			t.Fatalf("delivery %d: %v, want permanent ciutat_no_coberta", i, err)
		}
	}
	if st := state(t, b, "P-2026-000002"); st != repartiment.StateRejected {
		t.Fatalf("state %q, want rebutjat", st)
	}
	if n := events(t, b, "repartiment.rebutjat"); n != 1 {
		t.Fatalf("rebutjat events %d, want exactly 1", n)
	}
}

// Row 3: adreca_lliurament missing in a versio 1 event → permanent esquema + alert.
func TestRowMissingAddressInVersio1IsSchemaAndAlerts(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, nil)
	m := svctest.Message(t, "comandes.esdeveniments", "comanda.pagada", 1, paid("P-2026-000003", ""))
	err := svctest.Run(t, b.pool, b.svc.HandleOrderPaid, m)
	if !outcome.IsPermanent(err) || !strings.HasPrefix(err.Error(), "esquema: adreca_lliurament missing in comanda.pagada versio 1") {
		t.Fatalf("v1 without address: %v", err)
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM alertes WHERE tipus = 'esquema' AND id_esdeveniment = $1", m.Envelope.ID); n != 1 || b.svc.Alerts() != 1 {
		t.Fatalf("alerts: %d rows, %d raised", n, b.svc.Alerts())
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM lliuraments"); n != 0 {
		t.Fatalf("deliveries %d", n)
	}
}

// Row 4: the database refuses connections → transient. The consumer cannot
// even begin its transaction; and the handler must not dead-letter an
// uncovered order whose rejection it could not commit.
func TestRowDatabaseRefusingConnectionsIsTransient(t *testing.T) {
	t.Parallel()
	down := pgtest.NewPool(t, "postgres://postgres@127.0.0.1:1/km0?sslmode=disable&connect_timeout=2", 2)
	_, err := down.Begin(context.Background())
	if err == nil {
		t.Fatal("expected a refused connection")
	}
	if k, _ := outcome.Classify(err, repartiment.Classifier); k != outcome.KindTransient {
		t.Fatalf("refused connection classified %v", k)
	}
	b := setup(t, nil, down)
	m := svctest.Message(t, "comandes.esdeveniments", "comanda.pagada", 1, paid("P-2026-000004", "Andorra"))
	err = svctest.Run(t, b.pool, b.svc.HandleOrderPaid, m)
	if k, _ := outcome.Classify(err, repartiment.Classifier); k != outcome.KindTransient {
		t.Fatalf("uncovered city with the database down: %v (%v), want transient", err, k)
	}
	if n := events(t, b, "repartiment.rebutjat"); n != 0 {
		t.Fatalf("rebutjat events %d", n)
	}
}

// Row 5: no courier free → persisted as pending, acked; the periodic assigner
// assigns it when a courier is free again.
func TestRowNoCourierFreeIsPendingThenAssigned(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, nil)
	// vic has one courier: the first order takes it, the second waits.
	for _, id := range []string{"P-2026-000005", "P-2026-000006"} {
		if err := svctest.Run(t, b.pool, b.svc.HandleOrderPaid, svctest.Message(t, "comandes.esdeveniments", "comanda.pagada", 1, paid(id, "Vic"))); err != nil {
			t.Fatalf("%s: %v (must ack)", id, err)
		}
	}
	if st := state(t, b, "P-2026-000006"); st != repartiment.StatePending {
		t.Fatalf("second order %q, want pendent", st)
	}
	if n, err := b.svc.AssignPending(context.Background()); err != nil || n != 0 {
		t.Fatalf("assigner with no courier free: %d %v", n, err)
	}
	// The delivery ends: the courier is free again.
	if _, err := b.pool.Exec(context.Background(), `UPDATE repartidors SET ocupat_fins = now() - interval '1 second' WHERE id = 'vic-1'`); err != nil {
		t.Fatal(err)
	}
	if n, err := b.svc.AssignPending(context.Background()); err != nil || n != 1 {
		t.Fatalf("assigner: %d %v, want 1", n, err)
	}
	if st := state(t, b, "P-2026-000006"); st != repartiment.StateAssigned || events(t, b, "repartiment.assignat") != 2 {
		t.Fatalf("after assigner: %q, %d assignat", st, events(t, b, "repartiment.assignat"))
	}
	// A redelivered comanda.pagada (new event id) changes nothing.
	if err := svctest.Run(t, b.pool, b.svc.HandleOrderPaid, svctest.Message(t, "c", "comanda.pagada", 1, paid("P-2026-000006", "Vic"))); err != nil || events(t, b, "repartiment.assignat") != 2 {
		t.Fatalf("redelivery: %v", err)
	}
	sum, err := b.svc.Summary(context.Background())
	if err != nil || sum[repartiment.StateAssigned] != 2 || sum[repartiment.StatePending] != 0 {
		t.Fatalf("summary %v %v", sum, err)
	}
}

// A backlog of pending deliveries in a city with no courier free must not
// starve a city whose courier is free: the assigner only looked at the 50
// oldest pending rows, all of them Girona, and never reached Vic.
func TestAssignerIsNotStarvedByABusyCity(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, nil)
	ctx := context.Background()
	run := func(id, city string) {
		t.Helper()
		if err := svctest.Run(t, b.pool, b.svc.HandleOrderPaid, svctest.Message(t, "comandes.esdeveniments", "comanda.pagada", 1, paid(id, city))); err != nil {
			t.Fatalf("%s: %v", id, err)
		}
	}
	// Girona's 3 couriers take the first 3 orders; 50 more wait.
	for i := range 53 {
		run(fmt.Sprintf("P-2026-%06d", 100+i), "Girona")
	}
	// Vic's courier is busy with one order when the next one arrives.
	run("P-2026-000001", "Vic")
	run("P-2026-000002", "Vic")
	if st := state(t, b, "P-2026-000002"); st != repartiment.StatePending {
		t.Fatalf("second Vic order %q, want pendent", st)
	}
	// The Vic delivery ends; Girona's couriers stay busy.
	if _, err := b.pool.Exec(ctx, `UPDATE repartidors SET ocupat_fins = now() - interval '1 second' WHERE id = 'vic-1'`); err != nil {
		t.Fatal(err)
	}
	if n, err := b.svc.AssignPending(ctx); err != nil || n != 1 {
		t.Fatalf("assigner: %d %v, want 1", n, err)
	}
	if st := state(t, b, "P-2026-000002"); st != repartiment.StateAssigned {
		t.Fatalf("Vic order %q after the assigner, want assignat", st)
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM lliuraments WHERE estat = 'pendent'"); n != 50 {
		t.Fatalf("pending %d, want the 50 Girona orders", n)
	}
}

// A side pool shared with the consumer's transactions could deadlock (every
// transaction waiting for a second connection): New refuses it.
func TestNewRefusesASharedSidePool(t *testing.T) {
	t.Parallel()
	pool, _ := svctest.DB(t, repartiment.Migrations)
	for _, side := range []*pgxpool.Pool{nil, pool} {
		if _, err := repartiment.New(repartiment.Config{Pool: pool, SidePool: side, Maps: &repartiment.MapsClient{BaseURL: "http://127.0.0.1:1"}}); err == nil {
			t.Fatalf("New accepted SidePool %v", side)
		}
	}
}

// A delivery that waited for a courier keeps its maps estimate: the
// assigner's repartiment.assignat carries the same minuts_estimats as one
// assigned at once. And a second comanda.pagada for a handled order is a
// no-op even while maps is down (it used to ask maps first, so the no-op was
// retried and dead-lettered).
func TestPendingKeepsItsEstimateAndARepeatNeedsNoMaps(t *testing.T) {
	t.Parallel()
	var down atomic.Bool
	b := setup(t, func(string, int) bool { return down.Load() }, nil)
	ctx := context.Background()
	for _, id := range []string{"P-2026-000031", "P-2026-000032"} { // vic has one courier
		if err := svctest.Run(t, b.pool, b.svc.HandleOrderPaid, svctest.Message(t, "c", "comanda.pagada", 1, paid(id, "Vic"))); err != nil {
			t.Fatalf("%s: %v", id, err)
		}
	}
	if _, err := b.pool.Exec(ctx, `UPDATE repartidors SET ocupat_fins = now() - interval '1 second' WHERE id = 'vic-1'`); err != nil {
		t.Fatal(err)
	}
	if n, err := b.svc.AssignPending(ctx); err != nil || n != 1 {
		t.Fatalf("assigner: %d %v, want 1", n, err)
	}
	var atOnce, waited int
	q := `SELECT (carrega->>'minuts_estimats')::int FROM outbox WHERE tipus = 'repartiment.assignat' AND agregat_id = $1`
	if err := b.pool.QueryRow(ctx, q, "P-2026-000031").Scan(&atOnce); err != nil {
		t.Fatal(err)
	}
	if err := b.pool.QueryRow(ctx, q, "P-2026-000032").Scan(&waited); err != nil {
		t.Fatal(err)
	}
	if atOnce == 0 || waited != atOnce {
		t.Fatalf("minuts_estimats: %d assigned at once, %d after waiting; want equal and non-zero", atOnce, waited)
	}
	down.Store(true)
	before := b.maps.Failed()
	for _, id := range []string{"P-2026-000031", "P-2026-000032"} {
		if err := svctest.Run(t, b.pool, b.svc.HandleOrderPaid, svctest.Message(t, "c", "comanda.pagada", 1, paid(id, "Vic"))); err != nil {
			t.Fatalf("repeat of %s with maps down: %v, want a no-op", id, err)
		}
	}
	if n := events(t, b, "repartiment.assignat"); n != 2 || b.maps.Failed() != before {
		t.Fatalf("after repeats: %d assignat events, %d maps calls; want 2 and no maps call", n, b.maps.Failed()-before)
	}
}

// A comanda.pagada whose dades another decoder reads differently (a
// repeated member, or one named like a field but for case) is a permanent
// "esquema" failure and assigns nothing.
func TestAmbiguousOrderPaidIsSchema(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, nil)
	for _, d := range []string{
		`{"comanda_id":"P-2026-000005","adreca_lliurament":{"ciutat":"Girona","codi_postal":"17001"},"adreca_lliurament":{"ciutat":"Paris","codi_postal":"75001"}}`,
		`{"comanda_id":"P-2026-000005","adreca_lliurament":{"ciutat":"Girona","Ciutat":"Paris","codi_postal":"17001"}}`,
	} {
		m := svctest.Message(t, "comandes.esdeveniments", "comanda.pagada", 2, json.RawMessage(d))
		if err := svctest.Run(t, b.pool, b.svc.HandleOrderPaid, m); !outcome.IsPermanent(err) || !strings.HasPrefix(err.Error(), "esquema") {
			t.Errorf("%s: got %v, want a permanent esquema failure", d, err)
		}
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM lliuraments"); n != 0 {
		t.Fatalf("deliveries %d", n)
	}
}
