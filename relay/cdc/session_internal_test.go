package cdc

import (
	"context"

	"testing"

	"github.com/km0/km0/relay"
	"github.com/km0/km0/transport"
)

// The sessions that mark rows plan every statement for its own arrays:
// under the generic plan PostgreSQL switches a prepared statement to after
// five runs, the catch-up's mark (ctid = ANY($1) AND id = ANY($2)) compares
// every row with each of the batch's ids in turn (about 2.5 µs of server
// CPU an event more on a 200,000-row catch-up, `km0 bench relay --mode
// cdc`). The replication session runs no planned statement and is left
// alone.
func TestMarkSessionsUseCustomPlans(t *testing.T) {
	r, err := New(Config{Config: relay.Config{DatabaseURL: "postgres://x@127.0.0.1/x", Publisher: nopPublisher{}, Topic: "t", Origin: "o"}})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if got := r.connCfg.RuntimeParams["plan_cache_mode"]; got != "force_custom_plan" {
		t.Errorf("ordinary sessions: plan_cache_mode = %q, want force_custom_plan", got)
	}
	if got, ok := r.replCfg.RuntimeParams["plan_cache_mode"]; ok {
		t.Errorf("replication session: plan_cache_mode = %q, want unset", got)
	}
}

type nopPublisher struct{}

func (nopPublisher) Publish(context.Context, []*transport.Message) error { return nil }
