package dlq_test

import (
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"time"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/transport"
)

// A Kafka dead letter as the index keeps it: its ID names the record
// (ParseKafkaID reads it back; anything else is ErrBadID), History is the
// attempt history the consumer wrote, and View is its JSON form, one
// HeaderView per header.
func ExampleNewLetter() {
	at := time.Date(2026, 3, 1, 9, 0, 0, 0, time.UTC)
	m := &transport.Message{Topic: "comandes.esdeveniments.dlq", Key: []byte("P-2026-000123"), Value: []byte(`{}`),
		Headers: []transport.Header{
			{Key: contract.HeaderType, Value: "comanda.creada"},
			{Key: contract.HeaderReason, Value: "esquema"},
			{Key: contract.HeaderHistory, Value: contract.FormatHistory([]contract.FailedAttempt{
				{N: 1, At: at, Error: "esquema: comanda.creada v2: /linies: required field missing"}})},
		}}
	l := dlq.NewLetter(m.Topic, 5, 120, at, m)
	topic, partition, offset, err := dlq.ParseKafkaID(l.ID)
	fmt.Println(l.ID, topic, partition, offset, err)
	_, _, _, err = dlq.ParseKafkaID("P-2026-000123")
	fmt.Println(errors.Is(err, dlq.ErrBadID))
	for _, a := range l.History() {
		fmt.Println(a.N, a.At.Format(time.RFC3339), a.Error)
	}
	var headers []dlq.HeaderView = dlq.View(l, true).Headers
	fmt.Println(len(headers), headers[0].Key, headers[0].Value)
	// Output:
	// comandes.esdeveniments.dlq/5/120 comandes.esdeveniments.dlq 5 120 <nil>
	// true
	// 1 2026-03-01T09:00:00Z esquema: comanda.creada v2: /linies: required field missing
	// 3 tipus comanda.creada
}

// The defaults of an Alerter (AlerterConfig) and of a Gate (GateConfig).
// Past MaxClasses reason classes on one topic, the motiu label is
// contract.OtherClass.
func Example_defaults() {
	fmt.Println("webhook timeout", dlq.WebhookTimeoutDefault, "attempts", dlq.WebhookAttemptsDefault,
		"backoff", dlq.WebhookBackoffDefault, "queue", dlq.WebhookQueueDefault)
	fmt.Println("MaxClasses", dlq.MaxClassesDefault, "then", contract.OtherClass)
	fmt.Println("gate: per source", dlq.GatePerSourceDefault, "global", dlq.GateGlobalDefault, "known for", dlq.GateKnownForDefault)
	fmt.Println("GET /letters returns at most", dlq.MaxListLimit)
	// Output:
	// webhook timeout 5s attempts 3 backoff 1s queue 1024
	// MaxClasses 32 then altres
	// gate: per source 10 global 100 known for 24h0m0s
	// GET /letters returns at most 1000
}

// The verdicts of Gate.Check: a wrong token is Denied (and counted); with
// no token configured every request is Disabled.
func ExampleVerdict() {
	var v dlq.Verdict
	v, _ = dlq.NewGate("s3cret", dlq.GateConfig{}).Check(httptestRequest("198.51.100.4:3000"), "wrong")
	fmt.Println(v, v == dlq.Denied)
	v, _ = dlq.NewGate("", dlq.GateConfig{}).Check(httptestRequest("198.51.100.4:3000"), "s3cret")
	fmt.Println(v, v == dlq.Disabled)
	// Output:
	// denied true
	// disabled true
}

func httptestRequest(addr string) *http.Request {
	r := httptest.NewRequest(http.MethodGet, "/letters", nil)
	r.RemoteAddr = addr
	return r
}
