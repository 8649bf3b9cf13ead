package amqp

import amqp "github.com/rabbitmq/amqp091-go"

// DeadLetterOf reads a delivery got from the DLQ of queue (the work queue,
// not <queue>.dlq) with the rules of DLQ.List: origin from cua_origen or
// x-death, motiu from the header or, for a native nack, "permanent: rejected
// by <queue>", attempts and time of death. It is for callers that read the
// DLQ themselves, such as the PostgreSQL index of package dlq. It never fails:
// what is missing stays at its zero value (Origin defaults to queue).
func DeadLetterOf(queue string, d *amqp.Delivery) *DeadLetter {
	return (&DLQ{queue: queue}).deadLetter(d)
}
