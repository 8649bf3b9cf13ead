package dlq_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"

	"github.com/km0/km0/dlq"
)

// One Gate for every handler that checks the admin token: each source
// address may try GatePerSourceDefault tokens a minute, then it is throttled
// (even with the right token) while other addresses are not.
func ExampleNewGate() {
	gate := dlq.NewGate("s3cret", dlq.GateConfig{})
	from := func(addr string) *http.Request {
		r := httptest.NewRequest(http.MethodGet, "/letters", nil)
		r.RemoteAddr = addr
		return r
	}
	for range dlq.GatePerSourceDefault {
		gate.Check(from("203.0.113.1:1000"), "guess")
	}
	v, _ := gate.Check(from("203.0.113.1:1001"), "s3cret")
	fmt.Println("the guessing address:", v)
	v, _ = gate.Check(from("192.0.2.7:2000"), "s3cret")
	fmt.Println("the operator:", v)
	// The DLQ API and a console on one listener share it:
	_ = dlq.HandlerConfig{Gate: gate}
	// Output:
	// the guessing address: throttled
	// the operator: granted
}
