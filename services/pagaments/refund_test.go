package pagaments_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/inbox"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/services/internal/svctest"
	"github.com/km0/km0/services/pagaments"
	"github.com/km0/km0/services/pagaments/passarella"
)

func cancellation(t *testing.T, id string) *consumer.Message {
	return svctest.Message(t, "comandes.esdeveniments", pagaments.TypeOrderCancelled, 1, map[string]any{"comanda_id": id, "motiu": "client"})
}

// TestCancellationRefundsOnceEvenAfterACrashAndAGatewayFailure: anna's order
// is charged 2900; its cancellation first meets a gateway 503 (transient,
// nothing recorded), then dies after the gateway refunded and before the
// COMMIT, then commits: 1 refund of 2900 at the gateway (3 requests, the
// last two with the same key), 1 refund recorded. A second cancellation
// event asks the gateway nothing.
func TestCancellationRefundsOnceEvenAfterACrashAndAGatewayFailure(t *testing.T) {
	b := setup(t, passarella.Faults{Fail: func(key string, attempt int) bool {
		return strings.HasPrefix(key, "reemborsament-") && attempt == 1
	}})
	var crashes atomic.Int32
	s := b.service(t, time.Second, pagaments.Hooks{AfterRefund: func(string) error {
		if crashes.Add(1) == 1 {
			return errors.New("simulated crash after the gateway refunded, before COMMIT")
		}
		return nil
	}})
	ctx := context.Background()
	if err := svctest.Run(t, b.pool, s.HandleOrder, svctest.Message(t, "comandes.esdeveniments", "comanda.creada", 2, anna)); err != nil {
		t.Fatal(err)
	}
	m := cancellation(t, "P-2026-000123")
	ib := inbox.New(inbox.Config{})
	run := func(m *consumer.Message) error {
		_, err := ib.Process(ctx, b.pool, pagaments.ConsumerCharge, m.Envelope.ID, func(tx pgx.Tx) error { return s.HandleOrder(ctx, tx, m) })
		return err
	}
	if k, _ := outcome.Classify(err0(run(m)), nil); k != outcome.KindTransient {
		t.Fatalf("gateway 503: kind %v, want transient", k)
	}
	if err := run(m); err == nil {
		t.Fatal("the second attempt should have died")
	}
	if n := svctest.Count(t, b.pool, `SELECT count(*) FROM reemborsaments`); n != 0 {
		t.Fatalf("%d refunds recorded after the crash, want 0", n)
	}
	if err := run(m); err != nil {
		t.Fatal(err)
	}
	if err := run(cancellation(t, "P-2026-000123")); err != nil {
		t.Fatal(err)
	}
	refunds, err := b.gw.Refunds(ctx)
	if err != nil {
		t.Fatal(err)
	}
	rf, ok := refunds[pagaments.RefundKey("P-2026-000123")]
	if len(refunds) != 1 || !ok || rf.TotalCents != 2900 || rf.Calls != 2 {
		t.Fatalf("gateway refunds %+v, want 1 of 2900 asked twice", refunds)
	}
	if st := b.gw.Stats(); st.RefundRequests != 3 || st.Refunded != 1 {
		t.Fatalf("gateway %+v, want 3 refund requests, 1 refund", st)
	}
	got, _ := s.Refunds(ctx)
	if len(got) != 1 || got["P-2026-000123"] != 2900 {
		t.Fatalf("recorded refunds %v", got)
	}
}

// TestACancellationBeforeTheCreationChargesNothing: the cancellation
// overtook the creation (its creation in retry): the creation then charges
// nothing, records no payment and publishes no pagament.confirmat.
func TestACancellationBeforeTheCreationChargesNothing(t *testing.T) {
	b := setup(t, passarella.Faults{})
	s := b.service(t, time.Second, pagaments.Hooks{})
	if err := svctest.Run(t, b.pool, s.HandleOrder, cancellation(t, "P-2026-000123")); err != nil {
		t.Fatal(err)
	}
	if err := svctest.Run(t, b.pool, s.HandleOrder, svctest.Message(t, "comandes.esdeveniments", "comanda.creada", 2, anna)); err != nil {
		t.Fatal(err)
	}
	if st := b.gw.Stats(); st.Requests != 0 || st.RefundRequests != 0 {
		t.Fatalf("gateway asked %+v, want nothing", st)
	}
	if n := svctest.Count(t, b.pool, `SELECT (SELECT count(*) FROM pagaments) + (SELECT count(*) FROM outbox)`); n != 0 {
		t.Fatalf("%d payments and events, want 0", n)
	}
}

// TestRefundOfAnUnknownChargeIsRefused: the gateway answers 422 for a ref it
// never charged, and for a second key on a refunded charge.
func TestRefundOfAnUnknownChargeIsRefused(t *testing.T) {
	b := setup(t, passarella.Faults{})
	c := &passarella.Client{BaseURL: b.url}
	ctx := context.Background()
	if _, err := c.Refund(ctx, "k1", "P-2026-000001", "ch_nope", 100); !errors.Is(err, passarella.ErrRefused) {
		t.Fatalf("unknown charge: %v", err)
	}
	ch, err := c.Charge(ctx, "cobrament-P-2026-000001", "P-2026-000001", 100)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Refund(ctx, "k1", "P-2026-000001", ch.Ref, 100); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Refund(ctx, "k2", "P-2026-000001", ch.Ref, 100); !errors.Is(err, passarella.ErrRefused) {
		t.Fatalf("second key on a refunded charge: %v", err)
	}
	if _, err := c.Refund(ctx, "k1", "P-2026-000001", ch.Ref, 100); err != nil {
		t.Fatalf("same key again: %v", err)
	}
}

// err0 turns a nil error into one that Classify would call transient, so
// that the check above fails on nil.
func err0(err error) error {
	if err == nil {
		return outcome.Permanentf("no error")
	}
	return err
}
