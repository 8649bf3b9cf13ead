package relay

import (
	"context"
	"testing"

	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/transport"
)

type nopPublisher struct{}

func (nopPublisher) Publish(context.Context, []*transport.Message) error { return nil }

// The relay's own sessions run without JIT (a shard-filtered claim of 2,000
// rows is costed past jit_above_cost and spent ~100 ms compiling) and with
// synchronous_commit off (a lost mark only republishes).
func TestRelaySessionsRunWithoutJITAndWithoutWaitingForTheFlush(t *testing.T) {
	t.Parallel()
	s := pgtest.NewMigratedSchema(t)
	r, err := New(Config{Pool: s.Pool, Names: s.Names(), Publisher: nopPublisher{}, Topic: "t", Origin: "o"})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	w := r.workers[0]
	if err := w.connect(context.Background()); err != nil {
		t.Fatal(err)
	}
	for setting, want := range map[string]string{"jit": "off", "synchronous_commit": "off", "application_name": ApplicationNameDefault} {
		var got string
		if err := w.conn.QueryRow(context.Background(), "SELECT current_setting($1)", setting).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Errorf("%s = %q in the relay's session, want %q", setting, got, want)
		}
	}
}
