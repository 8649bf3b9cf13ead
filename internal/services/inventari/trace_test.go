package inventari_test

import (
	"context"
	"fmt"
	"testing"

	"go.opentelemetry.io/otel/trace"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/services/internal/svctest"
	"github.com/km0/km0/internal/services/inventari"
)

// In a batch, each estoc.actualitzat continues the trace of the order that
// caused it (its message's Message.Context), not the batch's ctx: the
// capcaleres of every event hold its own order's traceparent.
func TestEachStockEventCarriesTheTraceOfItsOwnOrder(t *testing.T) {
	t.Parallel()
	pool, s := setup(t)
	batchCtx := trace.ContextWithSpanContext(context.Background(), spanContext(99))
	var msgs []*consumer.Message
	for i := range 3 {
		m := svctest.Message(t, ordersTopic, inventari.TypeOrderCreated, 2,
			order(fmt.Sprintf("P-2026-%06d", i), inventari.Line{Product: "carbasso", Quantity: 1}, inventari.Line{Product: "vi-crianca", Quantity: 1}))
		m.SetContext(trace.ContextWithSpanContext(context.Background(), spanContext(i)))
		msgs = append(msgs, m)
	}
	tx, err := pool.Begin(batchCtx)
	if err != nil {
		t.Fatal(err)
	}
	if outcomes, err := s.HandleOrdersCreated(batchCtx, tx, msgs); err != nil || outcomes[0] != nil || outcomes[1] != nil || outcomes[2] != nil {
		t.Fatalf("%v %v", outcomes, err)
	}
	if err := tx.Commit(batchCtx); err != nil {
		t.Fatal(err)
	}
	rows, err := pool.Query(context.Background(), `SELECT carrega->>'comanda_id', capcaleres->>'traceparent' FROM outbox WHERE tipus = 'estoc.actualitzat'`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	n := 0
	for rows.Next() {
		var id string
		var tp *string
		if err := rows.Scan(&id, &tp); err != nil {
			t.Fatal(err)
		}
		var i int
		_, _ = fmt.Sscanf(id, "P-2026-%06d", &i)
		sc := spanContext(i)
		want := "00-" + sc.TraceID().String() + "-" + sc.SpanID().String() + "-01"
		if tp == nil || *tp != want {
			got := "NULL"
			if tp != nil {
				got = *tp
			}
			t.Fatalf("event of %s: traceparent %s, want %s (its own order's)", id, got, want)
		}
		n++
	}
	if n != 6 {
		t.Fatalf("%d events, want 6", n)
	}
}

func spanContext(i int) trace.SpanContext {
	tid, _ := trace.TraceIDFromHex(fmt.Sprintf("4bf92f3577b34da6a3ce929d0e0e%04x", i))
	sid, _ := trace.SpanIDFromHex(fmt.Sprintf("00f067aa0ba9%04x", i))
	return trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled})
}
