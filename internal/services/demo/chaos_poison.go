package demo

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/services/analitica"
	"github.com/km0/km0/internal/services/cataleg"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/repartiment"
)

// topicGroups are the consumer groups of each domain topic, and handledBy
// the tipus each group handles ("" = every tipus).
var (
	topicGroups = map[string][]string{
		comandes.Topic:    {inventari.ConsumerDecrement, pagaments.ConsumerCharge, repartiment.ConsumerAssign, analitica.ConsumerCount},
		pagaments.Topic:   {comandes.ConsumerPaymentConfirmed, analitica.ConsumerCount},
		inventari.Topic:   {cataleg.ConsumerLowStock, comandes.ConsumerStockRefused, analitica.ConsumerCount},
		repartiment.Topic: {comandes.ConsumerDelivery, analitica.ConsumerCount},
	}
	handledBy = map[string]string{
		inventari.ConsumerDecrement: comandes.TypeCreated, pagaments.ConsumerCharge: comandes.TypeCreated,
		repartiment.ConsumerAssign: repartiment.TypeOrderPaid, comandes.ConsumerPaymentConfirmed: comandes.TypePaymentConfirmed,
		cataleg.ConsumerLowStock: cataleg.TypeStockUpdated, analitica.ConsumerCount: "",
		// comandes.refus_estoc ignores what it does not handle and must move past it:
		// any healthy record after a poison one, by its committed offset.
		comandes.ConsumerStockRefused: "",
		comandes.ConsumerDelivery:     "",
	}
	// inboxGroups record every processed key in missatges_processats
	// (comandes.refus_estoc too, but it ignores most records of its topic,
	// which leave no key: it is checked by its committed offset).
	inboxGroups = map[string]string{
		inventari.ConsumerDecrement: inventari.Name, pagaments.ConsumerCharge: pagaments.Name,
		repartiment.ConsumerAssign: repartiment.Name, comandes.ConsumerPaymentConfirmed: comandes.Name,
	}
)

// Motius the poison records must be dead-lettered with (prefixes).
const (
	motiuMalformed = "permanent: envelope: malformed JSON"
	motiuNoID      = "permanent: envelope: id_esdeveniment: missing"
	motiuVersion   = "permanent: esquema: versio 99 not supported"
	motiuNoAddress = "permanent: esquema: adreca_lliurament missing in comanda.pagada versio 1"
)

// poisonPerBatch is len(poisonBatch(b)).
const poisonPerBatch = 10

// Poison is one poison record produced straight to a topic, and what each
// group of that topic must do with it.
type Poison struct {
	Name      string `json:"name"`
	ID        string `json:"event_id,omitempty"` // "" when the record has none
	Topic     string `json:"topic"`
	Partition int32  `json:"partition"`
	Offset    int64  `json:"offset"`
	Bytes     int    `json:"bytes"`
	// Expect maps every group of the topic to the motiu prefix it must
	// dead-letter the record with at its first attempt; "" means the group
	// must not dead-letter it (a tipus it does not handle is ignored and
	// counted, CONTRACT.md).
	Expect map[string]string `json:"expect"`

	value   []byte
	headers []kgo.RecordHeader
	key     string
}

func envelopeJSON(id, tipus string, versio int, dades any) []byte {
	m := map[string]any{"tipus": tipus, "versio": versio, "data_ms": time.Now().UnixMilli(), "origen": "verinós", "dades": dades}
	if id != "" {
		m["id_esdeveniment"] = id
	}
	b, _ := json.Marshal(m)
	return b
}

// poisonBatch builds batch b: every kind of poison record of the chaos run.
func poisonBatch(b int) []*Poison {
	id := func(name string) string { return fmt.Sprintf("verí-%d-%s", b, name) }
	creada := func(name string) map[string]string { // groups that decode comanda.creada
		return map[string]string{inventari.ConsumerDecrement: name, pagaments.ConsumerCharge: name}
	}
	with := func(m map[string]string, g, motiu string) map[string]string { m[g] = motiu; return m }
	order := map[string]any{"id": fmt.Sprintf("VERI-%d", b), "client": "client-verinós", "mercat": "girona",
		"linies": []map[string]any{{"producte": "carbasso", "quantitat": 1, "preu_centims": 300}}}
	big := map[string]any{"id": fmt.Sprintf("VERI-%d-gran", b), "client": "client-verinós", "mercat": "girona",
		"nota": strings.Repeat("km0 ", 900*1024/4)} // ~900 KB, and no linies
	out := []*Poison{
		{Name: "malformed_json", ID: id("json"), Topic: comandes.Topic,
			value:  []byte(`{"id_esdeveniment":"` + id("json") + `","tipus":"comanda.creada","versio":2,"dades":{"id":"VERI`),
			Expect: with(creada(motiuMalformed), analitica.ConsumerCount, motiuMalformed)},
		{Name: "no_id_esdeveniment", Topic: comandes.Topic, value: envelopeJSON("", comandes.TypeCreated, 2, order),
			Expect: with(creada(motiuNoID), analitica.ConsumerCount, motiuNoID)},
		{Name: "unknown_tipus", ID: id("tipus"), Topic: comandes.Topic, value: envelopeJSON(id("tipus"), "comanda.esborrada", 1, order),
			Expect: map[string]string{}},
		{Name: "versio_99", ID: id("v99"), Topic: comandes.Topic, value: envelopeJSON(id("v99"), comandes.TypeCreated, 99, order),
			Expect: creada(motiuVersion)},
		{Name: "wrong_types", ID: id("tipus-erronis"), Topic: comandes.Topic,
			value:  envelopeJSON(id("tipus-erronis"), comandes.TypeCreated, 2, map[string]any{"id": 42, "client": true, "mercat": "girona", "linies": "moltes"}),
			Expect: creada("permanent: esquema: comanda.creada v2")},
		{Name: "900_KB", ID: id("gran"), Topic: comandes.Topic, value: envelopeJSON(id("gran"), comandes.TypeCreated, 2, big),
			Expect: creada("permanent: esquema: comanda.creada v2")},
		{Name: "comanda.pagada_v1_no_address", ID: id("sense-adreca"), Topic: comandes.Topic,
			value:  envelopeJSON(id("sense-adreca"), repartiment.TypeOrderPaid, 1, map[string]any{"comanda_id": fmt.Sprintf("VERI-%d", b), "import_centims": 300, "mercat": "girona"}),
			Expect: map[string]string{repartiment.ConsumerAssign: motiuNoAddress}},
		{Name: "pagament_malformed_json", ID: id("pagament-json"), Topic: pagaments.Topic,
			value:  []byte(`{"id_esdeveniment":"` + id("pagament-json") + `","tipus":"pagament.confirmat","versio":1,"dades":`),
			Expect: map[string]string{comandes.ConsumerPaymentConfirmed: motiuMalformed, analitica.ConsumerCount: motiuMalformed}},
		{Name: "pagament_wrong_types", ID: id("pagament-tipus"), Topic: pagaments.Topic,
			value:  envelopeJSON(id("pagament-tipus"), comandes.TypePaymentConfirmed, 1, map[string]any{"comanda_id": 7, "import_centims": "molt"}),
			Expect: map[string]string{comandes.ConsumerPaymentConfirmed: "permanent: esquema: pagament.confirmat v1"}},
		{Name: "estoc_wrong_types", ID: id("estoc-tipus"), Topic: inventari.Topic,
			value:  envelopeJSON(id("estoc-tipus"), cataleg.TypeStockUpdated, 1, map[string]any{"producte": "carbasso", "abans": "molts", "despres": -1, "motiu": ""}),
			Expect: map[string]string{cataleg.ConsumerLowStock: "permanent: esquema: estoc.actualitzat v1"}},
	}
	tipus := map[string]string{"malformed_json": comandes.TypeCreated, "no_id_esdeveniment": comandes.TypeCreated, "unknown_tipus": "comanda.esborrada",
		"versio_99": comandes.TypeCreated, "wrong_types": comandes.TypeCreated, "900_KB": comandes.TypeCreated,
		"comanda.pagada_v1_no_address": repartiment.TypeOrderPaid, "pagament_malformed_json": comandes.TypePaymentConfirmed,
		"pagament_wrong_types": comandes.TypePaymentConfirmed, "estoc_wrong_types": cataleg.TypeStockUpdated}
	for i, p := range out {
		for _, g := range topicGroups[p.Topic] {
			if _, ok := p.Expect[g]; !ok {
				p.Expect[g] = ""
			}
		}
		// Headers as a producer writes them (CONTRACT.md): tipus, and the id when there is one.
		p.headers = []kgo.RecordHeader{{Key: contract.HeaderType, Value: []byte(tipus[p.Name])}}
		if p.ID != "" {
			p.headers = append(p.headers, kgo.RecordHeader{Key: contract.HeaderEventID, Value: []byte(p.ID)})
		}
		p.key = fmt.Sprintf("VERI-%d-%d", b, i)
		if p.Topic == inventari.Topic {
			// inventari's events are keyed by product: only those partitions
			// carry healthy events after the poison record.
			p.key = plentys[(b+i)%len(plentys)]
		}
		p.Bytes = len(p.value)
		p.Partition, p.Offset = -1, -1
	}
	return out
}

// producePoison produces the batch and records where each record landed. It
// retries while the broker is down, up to ctx.
func producePoison(ctx context.Context, cl *kgo.Client, batch []*Poison) error {
	for _, p := range batch {
		rec := &kgo.Record{Topic: p.Topic, Key: []byte(p.key), Value: p.value, Headers: p.headers}
		for {
			res := cl.ProduceSync(ctx, rec)
			if err := res.FirstErr(); err == nil {
				p.Partition, p.Offset = rec.Partition, rec.Offset
				break
			} else if ctx.Err() != nil {
				return fmt.Errorf("poison %s: %w", p.Name, err)
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(500 * time.Millisecond):
			}
		}
	}
	return nil
}
