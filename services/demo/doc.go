// Package demo is the engine of `km0 demo`: it finds or starts PostgreSQL,
// starts the embedded Kafka broker and the six services of the km0 system
// (package system), drives a scenario of orders with failures injected through
// the comandes HTTP API, waits until the system has settled, and reconciles
// the result into a Report whose invariants all hold or are named as failed.
package demo
