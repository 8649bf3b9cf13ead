package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"log"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/outcome"
)

// The defaults a zero Config gets (New applies WithDefaults).
func ExampleConfig_WithDefaults() {
	c := consumer.Config{}.WithDefaults()
	fmt.Println("Mode", c.Mode == consumer.AtLeastOnce)
	fmt.Println("MaxAttempts", c.MaxAttempts == consumer.MaxAttemptsDefault, c.MaxAttempts)
	fmt.Println("Backoff", c.Backoff == consumer.BackoffDefault, c.Backoff, c.BackoffMax == consumer.BackoffMaxDefault, c.BackoffMax)
	fmt.Println("ShutdownTimeout", c.ShutdownTimeout == consumer.ShutdownTimeoutDefault, c.ShutdownTimeout)
	// Output:
	// Mode true
	// MaxAttempts true 3
	// Backoff true 1s true 1h0m0s
	// ShutdownTimeout true 30s
}

// A handler that panics fails that attempt like a transient error: the
// consumer recovers, and the Classifier sees a *consumer.PanicError (with
// the stack) that it may classify otherwise, here as permanent.
func ExampleConfig_classifier() {
	cfg := consumer.Config{Classifier: func(err error) outcome.Kind {
		var p *consumer.PanicError
		if errors.As(err, &p) {
			return outcome.KindPermanent // a bug: retrying panics again
		}
		return outcome.DefaultClassifier(err)
	}}
	fmt.Println(cfg.Classifier(&consumer.PanicError{Value: "index out of range"}) == outcome.KindPermanent)
	// Output:
	// true
}

// HandleBatchOutcomes applies the effects of a batch in one transaction and
// says per message how it went (nil: done, or an outcome error): one
// message's failure does not undo the others.
func ExampleBatchOutcomeHandler() {
	var handle consumer.BatchOutcomeHandler = func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) ([]error, error) {
		outcomes := make([]error, len(msgs))
		for _, m := range msgs {
			if _, err := tx.Exec(ctx, `INSERT INTO vendes (id) VALUES ($1) ON CONFLICT DO NOTHING`, m.Envelope.ID); err != nil {
				return nil, err // the whole batch is retried
			}
		}
		return outcomes, nil
	}
	c, err := consumer.New(consumer.Config{HandleBatchOutcomes: handle /* Pool, Source, Group, ... */})
	if err != nil {
		log.Fatal(err)
	}
	ctx := context.Background()
	if err := c.Run(ctx); err != nil {
		log.Fatal(err)
	}
	fmt.Println(errors.Is(c.Run(ctx), consumer.ErrAlreadyRun)) // a Consumer runs once
}

// An operator pauses a group from anywhere that reaches its database (a
// consumer.PauseDB: a pool, a connection or a transaction); the group's
// consumers stop taking messages until ResumeGroup.
func ExamplePauseGroup() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://127.0.0.1/inventari")
	if err != nil {
		log.Fatal(err)
	}
	var db consumer.PauseDB = pool
	if err := consumer.PauseGroup(ctx, db, "public", "inventari.descompte_estoc", "oncall"); err != nil {
		log.Fatal(err)
	}
	defer consumer.ResumeGroup(ctx, db, "public", "inventari.descompte_estoc")
}
