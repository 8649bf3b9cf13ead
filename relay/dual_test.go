package relay_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/schema"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/kafka"
)

// Producer transition: the relay publishes a comanda.creada v2 row as
// v2 and as v1, two records with distinct ids and one shared correlacio header;
// a consumer that accepts both versions applies the effect once.
func TestDualPublishedPairReachesAConsumerOnce(t *testing.T) {
	b := setup(t)
	transform, err := schema.DualPublish(nil, schema.Dual{Type: "comanda.creada", Version: 2, Also: 1,
		Convert: schema.DropFields(1, "adreca_lliurament")})
	if err != nil {
		t.Fatal(err)
	}
	cfg := b.config()
	cfg.Transform = transform
	r := b.newRelay(t, cfg)

	ctx := context.Background()
	tx, err := b.s.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	e := &outbox.Event{Aggregate: "comanda", AggregateID: "P-2026-000001", Type: "comanda.creada", Version: 2,
		Payload: []byte(`{"id":"P-2026-000001","client":"anna","mercat":"girona",` +
			`"linies":[{"producte":"formatge-curat","quantitat":2,"preu_centims":1450}],` +
			`"adreca_lliurament":{"ciutat":"Girona","codi_postal":"17001"}}`)}
	if err := b.ob.Enqueue(ctx, tx, e); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n := b.drainOnce(t, r); n != 1 {
		t.Fatalf("published %d rows, want 1", n)
	}
	recs := b.read(t, 2)
	ids := map[string]bool{}
	for _, rec := range recs {
		m := &transport.Message{}
		for _, h := range rec.Headers {
			m.SetHeader(h.Key, string(h.Value))
		}
		if c, _ := m.Header(contract.HeaderCorrelator); c != e.ID.String() {
			t.Fatalf("record without the pair's correlacio header: %v", rec.Headers)
		}
		id, _ := m.Header(contract.HeaderEventID)
		ids[id] = true
	}
	if len(recs) != 2 || len(ids) != 2 {
		t.Fatalf("%d records with %d distinct ids, want 2 and 2", len(recs), len(ids))
	}

	var effects atomic.Int64
	src, err := kafka.NewSource(kafka.SourceConfig{Brokers: b.b.Addrs(), Group: "g", Topics: []string{topic}})
	if err != nil {
		t.Fatal(err)
	}
	c, err := consumer.New(consumer.Config{
		Source: src,
		Name:   "t.dual",
		Pool:   b.s.Pool, Names: b.s.Names(), Types: []string{"comanda.creada"},
		Handle: func(context.Context, pgx.Tx, *consumer.Message) error { effects.Add(1); return nil },
	})
	if err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(cctx) }()
	testkit.Eventually(t, 30*time.Second, "both copies consumed", func() bool {
		s := c.Stats()
		return s.Processed+s.Duplicates >= 2
	})

	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if s := c.Stats(); s.Processed != 1 || s.Duplicates != 1 || effects.Load() != 1 {
		t.Fatalf("processed %d, duplicates %d, effects %d; want 1, 1, 1", s.Processed, s.Duplicates, effects.Load())
	}
}
