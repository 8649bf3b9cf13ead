// Package demo is the engine of `km0 demo`: it finds or starts PostgreSQL,
// starts the embedded Kafka broker and the six services of the km0 system
// (package system), drives a scenario of orders with failures injected through
// the comandes HTTP API, waits until the system has settled, and reconciles
// the result into a Report whose invariants all hold or are named as failed.
//
// RunChaos is `km0 demo --chaos`: the same scenario against the broker and
// the six services running as separate km0 processes, which it SIGKILLs and
// restarts at moments drawn from a seed (the broker too, and PostgreSQL with
// its own cluster), with poison records produced straight to the topics; it
// then waits for the system to settle by itself and reconciles it from the
// databases and the topics into a ChaosReport.
package demo
