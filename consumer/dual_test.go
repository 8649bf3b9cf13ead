package consumer_test

import (
	"fmt"
	"testing"

	"github.com/google/uuid"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/outcome"
)

// dualRecord is one copy of a dual-published pair: its own id_esdeveniment,
// the pair's shared "correlacio".
func dualRecord(id, correlacio string, versio int) *kgo.Record {
	v := fmt.Sprintf(`{"id_esdeveniment":%q,"tipus":"comanda.creada","versio":%d,"data_ms":1789000000000,"origen":"comandes",`+
		`"dades":{"id":"P-1","linies":[{"producte":"carbasso","quantitat":3}]},"correlacio":%q}`, id, versio, correlacio)
	return &kgo.Record{Topic: topic, Key: []byte("P-1"), Value: []byte(v), Headers: []kgo.RecordHeader{
		{Key: "tipus", Value: []byte("comanda.creada")}, {Key: "id_esdeveniment", Value: []byte(id)},
		{Key: "correlacio", Value: []byte(correlacio)}}}
}

// A Decode hook that says "not for me" (outcome.ErrIgnore, e.g. the newer copy
// of a pair an old consumer cannot read) skips the record: counted as ignored,
// neither retried nor dead-lettered.
func TestDecodeHookCanIgnoreARecord(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.publish(dualRecord(uuid.NewString(), uuid.NewString(), 9), dualRecord(uuid.NewString(), uuid.NewString(), 1))
	cfg := b.config(inventari)
	cfg.Decode = func(v []byte) (*envelope.Envelope, error) {
		env, err := envelope.Decode(v)
		if err == nil && env.Version > 1 {
			return nil, fmt.Errorf("versio %d is the newer copy: %w", env.Version, outcome.ErrIgnore)
		}
		return env, err
	}
	st := b.runUntil(cfg, "one processed, one ignored", func(s consumer.Stats) bool {
		return s.Processed == 1 && s.Ignored == 1
	})
	if st.DeadLettered != 0 || st.Retried != 0 {
		t.Fatalf("an ignored record was dead-lettered (%d) or retried (%d)", st.DeadLettered, st.Retried)
	}
}
