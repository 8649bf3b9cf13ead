package main

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/dlq"
)

// km0 dlq show prints a letter's attempt history (historial_intents) as a
// table, oldest first, with its errors escaped; --json carries it too.
func TestDLQShowPrintsTheAttemptHistory(t *testing.T) {
	t.Parallel()
	h := newDLQHarness(t)
	at := time.Date(2026, 3, 1, 10, 0, 0, 0, time.UTC)
	history := contract.FormatHistory([]contract.FailedAttempt{
		{N: 1, At: at, Error: "transient: timeout calling pagaments"},
		{N: 2, At: at.Add(90 * time.Second), Error: "permanent: esquema: preu \x1b[31mnegatiu"},
	})
	good := `{"id_esdeveniment":"e-7","tipus":"comanda.creada","versio":1,"data_ms":1772359200000,"origen":"comandes","dades":{"id":"P-7"}}`
	r := &kgo.Record{Topic: "comandes.esdeveniments.dlq", Key: []byte("P-7"), Value: []byte(good), Timestamp: at.Add(90 * time.Second)}
	for _, kv := range [][2]string{{contract.HeaderAttempts, "2"}, {contract.HeaderReason, "permanent: esquema: preu negatiu"},
		{contract.HeaderOriginalTopic, "comandes.esdeveniments"}, {"tipus", "comanda.creada"}, {"id_esdeveniment", "e-7"},
		{contract.HeaderFirstFailure, contract.FormatTime(at)}, {contract.HeaderGroup, "inventari.descompte_estoc"}, {contract.HeaderHistory, history}} {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: kv[0], Value: []byte(kv[1])})
	}
	if err := h.cl.ProduceSync(context.Background(), r).FirstErr(); err != nil {
		t.Fatal(err)
	}
	id := dlq.KafkaID(r.Topic, r.Partition, r.Offset)
	out, err := h.run("", false, "show", id)
	if err != nil {
		t.Fatal(err)
	}
	want := "id:               " + id + "\n" +
		"state:            pending (replays 0)\n" +
		"original topic:   comandes.esdeveniments (partition -, offset -)\n" +
		"motiu (reason):   permanent: esquema: preu negatiu\n" +
		"attempts:         2\n" +
		"tipus:            comanda.creada\n" +
		"id_esdeveniment:  e-7\n" +
		"key:              \"P-7\"\n" +
		"first failure:    2026-03-01 10:00:00Z\n" +
		"event time:       2026-03-01 10:00:00Z\n" +
		"dead at:          2026-03-01 10:01:30Z\n" +
		"consumer group:   inventari.descompte_estoc\n" +
		"\nattempt history (last 2, oldest first):\n" +
		"ATTEMPT  FAILED_AT             ERROR\n" +
		"1        2026-03-01 10:00:00Z  transient: timeout calling pagaments\n" +
		"2        2026-03-01 10:01:30Z  permanent: esquema: preu \\x1b[31mnegatiu\n" +
		"\nheaders:\n"
	if len(out) < len(want) || out[:len(want)] != want {
		t.Fatalf("km0 dlq show:\n%s\nwant it to start with:\n%s", out, want)
	}
	out, err = h.run("", false, "show", id, "--json")
	var v dlq.LetterView
	if err != nil || json.Unmarshal([]byte(out), &v) != nil {
		t.Fatalf("show --json: %v\n%s", err, out)
	}
	if len(v.History) != 2 || v.History[0].N != 1 || v.History[0].Error != "transient: timeout calling pagaments" ||
		v.History[1].At == nil || !v.History[1].At.Equal(at.Add(90*time.Second)) || v.History[1].Error != dlq.Safe("permanent: esquema: preu \x1b[31mnegatiu") {
		t.Fatalf("show --json historial_intents: %+v\n%s", v.History, out)
	}
}
