package schema_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/envelope"
	"github.com/km0/km0/inbox"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/schema"
)

// benchDades is a realistic comanda.creada v2: four lines and an address.
const benchDades = `{"id":"P-2026-000123","client":"anna","mercat":"girona","linies":[` +
	`{"producte":"formatge-curat","quantitat":2,"preu_centims":1450},` +
	`{"producte":"tomaquet-rosa","quantitat":3,"preu_centims":320},` +
	`{"producte":"carbasso","quantitat":1,"preu_centims":210},` +
	`{"producte":"vi-crianca","quantitat":6,"preu_centims":1190}],` +
	`"adreca_lliurament":{"ciutat":"Girona","codi_postal":"17001"}}`

func benchDecoder(b *testing.B, skip bool) *schema.Decoder {
	d, err := schema.NewDecoder(schema.DecoderConfig{Handles: map[string]int{"comanda.creada": 2}, SkipValidation: skip,
		Upcasters: map[schema.Key]schema.Upcaster{{Type: "comanda.creada", Version: 1}: schema.Bump}})
	if err != nil {
		b.Fatal(err)
	}
	return d
}

// BenchmarkDecode is the consumer's per-message decode cost:
//
//	envelope       envelope.Decode alone (no schema package)
//	novalidate     Decoder with SkipValidation (versions and upcasting only)
//	validate       Decoder validating against comanda.creada v2
//	validate-v1    a v1 event: validated, upcast, validated again
//	handler        each of the above followed by the handler's DataAs
func BenchmarkDecode(b *testing.B) {
	v2 := event(b, "comanda.creada", 2, benchDades)
	v1 := event(b, "comanda.creada", 1, benchDades)
	plain := func(in []byte) (*envelope.Envelope, error) { return envelope.Decode(in) }
	for _, bc := range []struct {
		name   string
		decode func([]byte) (*envelope.Envelope, error)
		in     []byte
	}{
		{"envelope", plain, v2},
		{"novalidate", benchDecoder(b, true).Decode, v2},
		{"validate", benchDecoder(b, false).Decode, v2},
		{"validate-v1", benchDecoder(b, false).Decode, v1},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(bc.in)))
			for b.Loop() {
				if _, err := bc.decode(bc.in); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(bc.name+"+handler", func(b *testing.B) {
			b.ReportAllocs()
			var c comandaCreada
			for b.Loop() {
				env, err := bc.decode(bc.in)
				if err != nil {
					b.Fatal(err)
				}
				if err := env.DataAs(&c); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// decodeAndRead is what a consumer does before its transaction: decode, then
// read dades into the handler's shape.
func decodeAndRead(b *testing.B, d *schema.Decoder, in []byte) *comandaCreada {
	env, err := d.Decode(in)
	if err != nil {
		b.Fatal(err)
	}
	var c comandaCreada
	if err := env.DataAs(&c); err != nil {
		b.Fatal(err)
	}
	return &c
}

// BenchmarkDecodeOverhead is decode + DataAs of comanda.creada v2 without and
// with validation, paired (see paired) so that machine load affects both.
func BenchmarkDecodeOverhead(b *testing.B) {
	in := event(b, "comanda.creada", 2, benchDades)
	run := func(d *schema.Decoder) func(int) { return func(int) { decodeAndRead(b, d, in) } }
	paired(b, run(benchDecoder(b, true)), run(benchDecoder(b, false)))
}

// BenchmarkValidate is the producer's per-event cost in Outbox.Enqueue.
func BenchmarkValidate(b *testing.B) {
	reg := registry(b)
	in := []byte(benchDades)
	b.ReportAllocs()
	for b.Loop() {
		if err := reg.Validate("comanda.creada", 2, in); err != nil {
			b.Fatal(err)
		}
	}
}

// paired runs off and on alternately, one message each per iteration (the
// order flipping every time), so that load from elsewhere on the machine hits
// both alike, and reports each one's mean time per message and the overhead
// of validation in percent.
func paired(b *testing.B, off, on func(i int)) {
	var tOff, tOn time.Duration
	i := 0
	for b.Loop() {
		i++
		first, second, t1, t2 := off, on, &tOff, &tOn
		if i%2 == 0 {
			first, second, t1, t2 = on, off, &tOn, &tOff
		}
		start := time.Now()
		first(i)
		mid := time.Now()
		second(i)
		*t1 += mid.Sub(start)
		*t2 += time.Since(mid)
	}
	b.ReportMetric(float64(tOff.Nanoseconds())/float64(i), "ns/msg-novalidate")
	b.ReportMetric(float64(tOn.Nanoseconds())/float64(i), "ns/msg-validate")
	b.ReportMetric(100*(float64(tOn)-float64(tOff))/float64(tOff), "%overhead")
}

// BenchmarkConsume is one message through a consumer's critical path on the
// real PostgreSQL: decode, handler DataAs, and the inbox transaction with a
// one-row effect, with validation off and on (see paired).
func BenchmarkConsume(b *testing.B) {
	s := pgtest.NewMigratedSchema(b)
	ctx := context.Background()
	if _, err := s.Pool.Exec(ctx, "CREATE TABLE efectes (comanda TEXT, n INT)"); err != nil {
		b.Fatal(err)
	}
	ib := inbox.New(inbox.Config{Names: s.Names()})
	in := event(b, "comanda.creada", 2, benchDades)
	consume := func(d *schema.Decoder, key string) {
		c := decodeAndRead(b, d, in)
		if _, err := ib.Process(ctx, s.Pool, "bench", key, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "INSERT INTO efectes VALUES ($1, $2)", c.ID, len(c.Linies))
			return err
		}); err != nil {
			b.Fatal(err)
		}
	}
	off, on := benchDecoder(b, true), benchDecoder(b, false)
	paired(b, func(i int) { consume(off, fmt.Sprint("off-", i)) }, func(i int) { consume(on, fmt.Sprint("on-", i)) })
}

// BenchmarkEnqueue is the producer's write path, where validation happens
// for the relay: one Outbox.Enqueue in its own transaction, validation off
// and on (see paired).
func BenchmarkEnqueue(b *testing.B) {
	s := pgtest.NewMigratedSchema(b)
	ctx := context.Background()
	enqueue := func(ob *outbox.Outbox) {
		e := &outbox.Event{Aggregate: "comanda", AggregateID: "P-2026-000123", Type: "comanda.creada", Version: 2,
			Payload: json.RawMessage(benchDades)}
		if err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error { return ob.Enqueue(ctx, tx, e) }); err != nil {
			b.Fatal(err)
		}
	}
	off := outbox.New(outbox.Config{Names: s.Names()})
	on := outbox.New(outbox.Config{Names: s.Names(), Validate: registry(b).Validate})
	paired(b, func(int) { enqueue(off) }, func(int) { enqueue(on) })
}
