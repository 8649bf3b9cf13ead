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
	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/services/internal/svctest"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/pagaments/passarella"
	"github.com/km0/km0/outcome"
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
	t.Parallel()
	b := setup(t, passarella.Faults{Fail: func(key string, attempt int) bool {
		return strings.HasPrefix(key, "reemborsament-") && attempt == 1
	}})
	var crashes atomic.Int32
	s := b.service(t, time.Second)
	ctx := faults.WithPayments(context.Background(), faults.Payments{AfterRefund: func(string) error {
		if crashes.Add(1) == 1 {
			return errors.New("simulated crash after the gateway refunded, before COMMIT")
		}
		return nil
	}})
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
// overtook the creation (its creation in retry): it voids the charge key at
// the gateway, the creation then charges nothing, records no payment and
// publishes no pagament.confirmat, and a charge request still in flight
// with the key is refused.
func TestACancellationBeforeTheCreationChargesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t, passarella.Faults{})
	s := b.service(t, time.Second)
	if err := svctest.Run(t, b.pool, s.HandleOrder, cancellation(t, "P-2026-000123")); err != nil {
		t.Fatal(err)
	}
	if err := svctest.Run(t, b.pool, s.HandleOrder, svctest.Message(t, "comandes.esdeveniments", "comanda.creada", 2, anna)); err != nil {
		t.Fatal(err)
	}
	if st := b.gw.Stats(); st.Requests != 0 || st.RefundRequests != 1 || st.Refunded != 1 {
		t.Fatalf("gateway %+v, want no charge request and one refund request (a void)", st)
	}
	if n := svctest.Count(t, b.pool, `SELECT (SELECT count(*) FROM pagaments) + (SELECT count(*) FROM outbox) + (SELECT count(*) FROM reemborsaments)`); n != 0 {
		t.Fatalf("%d payments, events and refunds, want 0", n)
	}
	c := &passarella.Client{BaseURL: b.url, APIKey: b.gw.APIKey()}
	if _, err := c.Charge(context.Background(), pagaments.ChargeKey("P-2026-000123"), "P-2026-000123", 2900); !errors.Is(err, passarella.ErrRefused) {
		t.Fatalf("a late charge with the voided key: %v, want refused", err)
	}
	if cs, _ := b.gw.Charges(context.Background()); len(cs) != 0 {
		t.Fatalf("charges %v, want none", cs)
	}
}

// TestACancellationAfterAHungChargeRefundsIt: the gateway charged and then
// hung past the client's timeout (the attempt rolled back: no payment
// recorded); the cancellation comes before the retry: the gateway refunds
// that charge (2900, once) and the retry charges nothing more.
func TestACancellationAfterAHungChargeRefundsIt(t *testing.T) {
	t.Parallel()
	b := setup(t, passarella.Faults{HangFor: 2 * time.Second, Hang: func(key string, attempt int) bool {
		return strings.HasPrefix(key, "cobrament-") && attempt == 1
	}})
	s := b.service(t, 300*time.Millisecond)
	created := svctest.Message(t, "comandes.esdeveniments", "comanda.creada", 2, anna)
	if err := svctest.Run(t, b.pool, s.HandleOrder, created); err == nil {
		t.Fatal("the hung charge should have failed the attempt")
	}
	if err := svctest.Run(t, b.pool, s.HandleOrder, cancellation(t, "P-2026-000123")); err != nil {
		t.Fatal(err)
	}
	if err := svctest.Run(t, b.pool, s.HandleOrder, created); err != nil { // the retry
		t.Fatal(err)
	}
	ctx := context.Background()
	charges, _ := b.gw.Charges(ctx)
	refunds, _ := b.gw.Refunds(ctx)
	rf := refunds[pagaments.RefundKey("P-2026-000123")]
	if len(charges) != 1 || len(refunds) != 1 || rf.Void || rf.TotalCents != 2900 || rf.ChargeRef != charges[pagaments.ChargeKey("P-2026-000123")].Ref {
		t.Fatalf("charges %v, refunds %v: want the hung charge refunded", charges, refunds)
	}
	got, _ := s.Refunds(ctx)
	if got["P-2026-000123"] != 2900 || svctest.Count(t, b.pool, `SELECT count(*) FROM pagaments`) != 0 {
		t.Fatalf("recorded refunds %v", got)
	}
}

// TestRefundVoidsAnUnchargedKeyAndRefundsAChargeOnce: at the gateway, a
// refund of a key that charged nothing voids it (a charge with it is then
// refused); a charge is refunded once, its key's refund repeated returns the
// same refund, another refund key for it is refused, and so is a refund
// naming another order.
func TestRefundVoidsAnUnchargedKeyAndRefundsAChargeOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, passarella.Faults{})
	c := &passarella.Client{BaseURL: b.url, APIKey: b.gw.APIKey()}
	ctx := context.Background()
	if rf, err := c.Refund(ctx, "r0", "P-2026-000009", "cobrament-P-2026-000009"); err != nil || !rf.Void || rf.TotalCents != 0 {
		t.Fatalf("refund of an uncharged key: %+v %v, want a void", rf, err)
	}
	if _, err := c.Charge(ctx, "cobrament-P-2026-000009", "P-2026-000009", 100); !errors.Is(err, passarella.ErrRefused) ||
		!strings.Contains(err.Error(), `"codi":"clau_anullada","camp":"Idempotency-Key"`) {
		t.Fatalf("charge with a voided key: %v, want 422 clau_anullada", err)
	}
	ch, err := c.Charge(ctx, "cobrament-P-2026-000001", "P-2026-000001", 100)
	if err != nil {
		t.Fatal(err)
	}
	first, err := c.Refund(ctx, "k1", "P-2026-000001", "cobrament-P-2026-000001")
	if err != nil || first.Void || first.TotalCents != 100 || first.ChargeRef != ch.Ref {
		t.Fatalf("refund: %+v %v", first, err)
	}
	if _, err := c.Refund(ctx, "k2", "P-2026-000001", "cobrament-P-2026-000001"); !errors.Is(err, passarella.ErrRefused) ||
		!strings.Contains(err.Error(), `"codi":"reemborsament_refusat","camp":"clau_cobrament"`) {
		t.Fatalf("second key on a refunded charge: %v, want 422 reemborsament_refusat", err)
	}
	if again, err := c.Refund(ctx, "k1", "P-2026-000001", "cobrament-P-2026-000001"); err != nil || again.Ref != first.Ref {
		t.Fatalf("same key again: %+v %v", again, err)
	}
	if _, err := c.Refund(ctx, "k3", "P-2026-000002", "cobrament-P-2026-000001"); !errors.Is(err, passarella.ErrRefused) ||
		!strings.Contains(err.Error(), `"codi":"reemborsament_refusat"`) {
		t.Fatalf("another order's charge key: %v, want 422 reemborsament_refusat", err)
	}
	if st := b.gw.Stats(); st.Refunded != 2 {
		t.Fatalf("gateway %+v, want 2 refunds (one a void)", st)
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
