package tracing_test

import (
	"fmt"

	"github.com/km0/km0/tracing"
)

// km0's spans come from the tracer named ScopeName, so a collector can
// select or drop them by instrumentation scope; Delivery.System is the
// messaging.system attribute of a consumer span, one of these.
func Example_scope() {
	fmt.Println(tracing.ScopeName)
	fmt.Println(tracing.SystemKafka, tracing.SystemRabbitMQ)
	// Output:
	// github.com/km0/km0
	// kafka rabbitmq
}
