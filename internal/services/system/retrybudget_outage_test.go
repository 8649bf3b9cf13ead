package system_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/internal/svctest"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/pagaments/passarella"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/kafka"
)

// Time is scaled in these proofs as in TestDefaultRetryBudgetOutlastsALock:
// the consumers' first backoff is outageBackoff instead of
// consumer.BackoffDefault (1 s), and every wait of the retry budget is a
// multiple of it (1, 2, 4 … backoffs), so an outage of outageLength stands
// for one of 60 s at the default scale. MaxAttempts is left unset: the
// services run with system.MaxAttemptsDefault (10), whose waits add up to
// 511 backoffs (8.5 minutes at 1 s; 31 s here), so the last attempts come
// after the outage. The contract's 3 attempts wait 3 backoffs in all and
// dead-letter every event that arrives during the outage.
const (
	outageBackoff = 60 * time.Millisecond
	outageLength  = 60 * outageBackoff // 3.6 s: 60 s at the default scale
)

// An order of one line each of vi-crianca and tomaquet-rosa (2 units), in
// stock for every order of these tests (inventari's seed: 200 and 120).
func outageOrder(id string) map[string]any {
	return map[string]any{"id": id, "client": "anna", "mercat": "girona", "linies": []map[string]any{
		{"producte": "vi-crianca", "quantitat": 1, "preu_centims": 1200},
		{"producte": "tomaquet-rosa", "quantitat": 2, "preu_centims": 300}}}
}

// outageEvents returns n comanda.creada v2, as comandes publishes them, and
// right behind each of the first cancelled of them its comanda.cancellada
// (same key: parked behind the order while the order waits for a retry).
func outageEvents(t *testing.T, n, cancelled int) []*transport.Message {
	t.Helper()
	var msgs []*transport.Message
	for i := range n {
		id := fmt.Sprintf("P-2026-%06d", 500+i)
		m := svctest.Message(t, comandes.Topic, comandes.TypeCreated, 2, outageOrder(id))
		m.Message.Key = []byte(id)
		msgs = append(msgs, m.Message)
		if i < cancelled {
			c := svctest.Message(t, comandes.Topic, comandes.TypeCancelled, 1, map[string]any{"comanda_id": id, "motiu": "client"})
			c.Message.Key = []byte(id)
			msgs = append(msgs, c.Message)
		}
	}
	return msgs
}

// roleDatabase creates a login role and a database it owns, both unique to
// the test (roles are server-wide), and returns the database's URL as that
// role and the role's name. The database and then the role are dropped at
// cleanup, after any cleanup registered later (the system that uses them).
func roleDatabase(t *testing.T) (connURL, role string) {
	t.Helper()
	ctx := context.Background()
	admin, err := pgx.Connect(ctx, pgtest.URL())
	if err != nil {
		t.Fatalf("PostgreSQL is required: %v", err)
	}
	suffix := make([]byte, 6)
	_, _ = rand.Read(suffix)
	role, db := "km0_outage_"+hex.EncodeToString(suffix), "km0t_outage_"+hex.EncodeToString(suffix)
	r, d := pgx.Identifier{role}.Sanitize(), pgx.Identifier{db}.Sanitize()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+d+" WITH (FORCE)"); err != nil {
			t.Errorf("drop database %s: %v", db, err)
		}
		if _, err := admin.Exec(ctx, "DROP ROLE IF EXISTS "+r); err != nil {
			t.Errorf("drop role %s: %v", role, err)
		}
		admin.Close(ctx)
	})
	for _, q := range []string{"CREATE ROLE " + r + " LOGIN", "CREATE DATABASE " + d + " OWNER " + r} {
		if _, err := admin.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	u, err := url.Parse(pgtest.WithDatabase(pgtest.URL(), db))
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(role)
	return u.String(), role
}

// A database outage that is not the events' fault: inventari's role loses
// INSERT on comandes_estoc, the table its handler writes for every order,
// for 60 s at the default scale (see outageBackoff), then gets it back.
// Every attempt meanwhile fails with insufficient_privilege (SQLSTATE
// 42501), which the consumer counts as a failed attempt (a transient error
// of the handler, retried through <topic>.retry with backoff), unlike a
// lost connection (retried in place, spending no attempt).
// With system.MaxAttemptsDefault the outage leaves 0 dead letters, no key
// blocked and nothing parked (0 operator actions): every order is applied
// once, each cancellation after its order, and the stock is exact.
func TestDefaultRetryBudgetOutlastsADatabaseOutage(t *testing.T) {
	t.Parallel()
	roleURL, role := roleDatabase(t)
	sys, b := startWith(t, []string{inventari.Name}, func(c *system.Config) {
		c.DatabaseURLs = map[string]string{inventari.Name: roleURL}
		c.Backoff = outageBackoff
	})
	t.Cleanup(sys.Close)
	ctx := context.Background()
	pool := sys.Pool(inventari.Name)
	var owner string
	if err := pool.QueryRow(ctx, `SELECT current_user`).Scan(&owner); err != nil || owner != role {
		t.Fatalf("inventari connects as %q (%v), want the test's role %q", owner, err, role)
	}
	// The privileges are taken and given back by a superuser in inventari's
	// database (the role owns the table; an owner's privileges can be revoked).
	admin := pgtest.NewPool(t, pgtest.WithDatabase(pgtest.URL(), pool.Config().ConnConfig.Database), 1)
	grant := func(q string) {
		t.Helper()
		if _, err := admin.Exec(ctx, q+" "+pgx.Identifier{role}.Sanitize()); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}

	// The outage: INSERT on comandes_estoc revoked before the events arrive.
	grant("REVOKE INSERT ON comandes_estoc FROM")
	const orders, cancelled = 20, 5
	if err := kafka.NewPublisher(kafkatest.Client(t, b)).Publish(ctx, outageEvents(t, orders, cancelled)); err != nil {
		t.Fatal(err)
	}
	stats := func() string { return fmt.Sprintf("%+v", sys.ConsumerStats()[inventari.ConsumerDecrement]) }
	// The outage must be felt before it is timed.
	testkit.Eventuallyf(t, 30*time.Second, "a first failed attempt during the outage", func() (bool, string) {
		return sys.ConsumerStats()[inventari.ConsumerDecrement].Retried > 0, stats()
	})
	time.Sleep(outageLength) // the outage's length, not a wait for work
	if n := svctest.Count(t, pool, `SELECT count(*) FROM comandes_estoc`); n != 0 {
		t.Fatalf("%d orders applied during the outage, want 0", n)
	}
	grant("GRANT INSERT ON comandes_estoc TO")

	testkit.Eventuallyf(t, time.Minute, "every order applied, or a dead letter", func() (bool, string) {
		st := sys.ConsumerStats()[inventari.ConsumerDecrement]
		served := svctest.Count(t, pool, `SELECT count(*) FROM comandes_estoc WHERE estat = 'servida'`)
		restored := svctest.Count(t, pool, `SELECT count(*) FROM comandes_estoc WHERE estat = 'cancellada' AND restaurada`)
		return st.DeadLettered > 0 || served == orders-cancelled && restored == cancelled && st.Released == cancelled,
			fmt.Sprintf("%d served, %d cancelled and restored, stats %s", served, restored, stats())
	})
	st := sys.ConsumerStats()[inventari.ConsumerDecrement]
	served := svctest.Count(t, pool, `SELECT count(*) FROM comandes_estoc WHERE estat = 'servida'`)
	restored := svctest.Count(t, pool, `SELECT count(*) FROM comandes_estoc WHERE estat = 'cancellada' AND restaurada`)
	wine := svctest.Count(t, pool, `SELECT unitats FROM estoc WHERE producte = 'vi-crianca'`)
	tomato := svctest.Count(t, pool, `SELECT unitats FROM estoc WHERE producte = 'tomaquet-rosa'`)
	blocked := svctest.Count(t, pool, `SELECT count(*) FROM claus_bloquejades`)
	parked := svctest.Count(t, pool, `SELECT count(*) FROM missatges_aparcats`)
	if st.DeadLettered != 0 || st.Retried == 0 || st.Released != cancelled || served != orders-cancelled || restored != cancelled ||
		wine != 200-(orders-cancelled) || tomato != 120-2*(orders-cancelled) || blocked != 0 || parked != 0 {
		t.Fatalf("after a %v outage (60 s at 1 s backoff): stats %+v; %d served, %d cancelled and restored; stock vi-crianca %d, tomaquet-rosa %d; "+
			"%d keys blocked, %d parked; want 0 dead letters, some retries, %d released, %d served, %d restored, stock %d and %d, 0 blocked, 0 parked",
			outageLength, st, served, restored, wine, tomato, blocked, parked,
			cancelled, orders-cancelled, cancelled, 200-(orders-cancelled), 120-2*(orders-cancelled))
	}
}

// A payment gateway outage: the simulated gateway answers 503 to every
// charge and refund for 60 s at the default scale (see outageBackoff),
// then heals. pagaments' charging consumer (one order per transaction, per
// key order, as System runs it) counts each 503 as a failed attempt
// (outcome.Transient), and with system.MaxAttemptsDefault the outage leaves
// 0 dead letters and no key blocked: every order is charged once (one
// successful charge per key, none replayed), every cancellation refunded
// once after its charge.
func TestDefaultRetryBudgetOutlastsAGatewayOutage(t *testing.T) {
	t.Parallel()
	var down atomic.Bool
	down.Store(true)
	sys, b := startWith(t, []string{pagaments.Name}, func(c *system.Config) {
		c.Backoff = outageBackoff
		c.GatewayFaults = passarella.Faults{Fail: func(string, int) bool { return down.Load() }}
	})
	t.Cleanup(sys.Close)
	ctx := context.Background()
	pool := sys.Pool(pagaments.Name)
	const orders, cancelled = 10, 3
	if err := kafka.NewPublisher(kafkatest.Client(t, b)).Publish(ctx, outageEvents(t, orders, cancelled)); err != nil {
		t.Fatal(err)
	}
	stats := func() string {
		return fmt.Sprintf("consumer %+v, gateway %+v", sys.ConsumerStats()[pagaments.ConsumerCharge], sys.Gateway.Stats())
	}
	// The outage must be felt before it is timed.
	testkit.Eventuallyf(t, 30*time.Second, "a first failed attempt during the outage", func() (bool, string) {
		return sys.ConsumerStats()[pagaments.ConsumerCharge].Retried > 0, stats()
	})
	time.Sleep(outageLength) // the outage's length, not a wait for work
	if gw := sys.Gateway.Stats(); gw.Charged != 0 || gw.Failed == 0 {
		t.Fatalf("during the outage: gateway %+v, want 0 charged and some failed", gw)
	}
	down.Store(false)

	testkit.Eventuallyf(t, time.Minute, "every order charged and every cancellation refunded, or a dead letter", func() (bool, string) {
		st := sys.ConsumerStats()[pagaments.ConsumerCharge]
		payments := svctest.Count(t, pool, `SELECT count(*) FROM pagaments`)
		refunds := svctest.Count(t, pool, `SELECT count(*) FROM reemborsaments`)
		return st.DeadLettered > 0 || payments == orders && refunds == cancelled, fmt.Sprintf("%d payments, %d refunds, %s", payments, refunds, stats())
	})
	st, gw := sys.ConsumerStats()[pagaments.ConsumerCharge], sys.Gateway.Stats()
	charges, err := sys.Gateway.Charges(ctx)
	if err != nil {
		t.Fatal(err)
	}
	perOrder := svctest.Count(t, pool, `SELECT count(DISTINCT comanda_id) FROM pagaments`)
	blocked := svctest.Count(t, pool, `SELECT count(*) FROM claus_bloquejades`)
	parked := svctest.Count(t, pool, `SELECT count(*) FROM missatges_aparcats`)
	if st.DeadLettered != 0 || st.Retried == 0 || len(charges) != orders || gw.Charged != orders || gw.Replayed != 0 ||
		gw.Refunded != cancelled || perOrder != orders || blocked != 0 || parked != 0 {
		t.Fatalf("after a %v gateway outage (60 s at 1 s backoff): consumer %+v, gateway %+v, %d charge keys, %d orders paid, %d keys blocked, %d parked; "+
			"want 0 dead letters, some retries, %d charges made once (none replayed), %d refunds, 0 blocked, 0 parked",
			outageLength, st, gw, len(charges), perOrder, blocked, parked, orders, cancelled)
	}
}
