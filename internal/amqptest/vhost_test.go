package amqptest

import (
	"context"
	"errors"
	"net/http"
	"net/url"
	"testing"

	amqp091 "github.com/rabbitmq/amqp091-go"
)

func TestOnVHostEscapesTheName(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ in, vhost, want string }{
		{"amqp://guest:guest@127.0.0.1:5672/", "km0.test.x", "amqp://guest:guest@127.0.0.1:5672/km0.test.x"},
		{"amqp://guest:guest@127.0.0.1:5672", "a/b c", "amqp://guest:guest@127.0.0.1:5672/a%2Fb%20c"},
		{"amqps://u:p@h:5671/old?cacertfile=%2Ftmp%2Fca.pem", "v", "amqps://u:p@h:5671/v?cacertfile=%2Ftmp%2Fca.pem"},
	} {
		got := OnVHost(tc.in, tc.vhost)
		if got != tc.want {
			t.Errorf("OnVHost(%q, %q) = %q, want %q", tc.in, tc.vhost, got, tc.want)
		}
		if u, err := amqp091.ParseURI(got); err != nil || u.Vhost != tc.vhost {
			t.Errorf("%q parses to vhost %q (%v), want %q", got, u.Vhost, err, tc.vhost)
		}
	}
}

// Two vhosts hold a queue of the same fixed name each, apart: a message
// published in one is not in the other. Both are gone once their test ends.
func TestVHostKeepsFixedNamesApartAndGoesAtCleanup(t *testing.T) {
	t.Parallel()
	const q = "pagaments.autoritzacions"
	var names []string
	t.Run("two vhosts", func(t *testing.T) {
		a, b := NewVHost(t), NewVHost(t)
		names = []string{a, b}
		if a == b {
			t.Fatalf("the same vhost twice: %s", a)
		}
		var conns []*amqp091.Connection
		for _, v := range names {
			c, err := amqp091.Dial(OnVHost(URL(), v))
			if err != nil {
				t.Fatalf("dial vhost %s: %v", v, err)
			}
			t.Cleanup(func() { _ = c.Close() })
			ch, err := c.Channel()
			if err != nil {
				t.Fatal(err)
			}
			if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
				t.Fatal(err)
			}
			conns = append(conns, c)
		}
		ch, err := conns[0].Channel()
		if err != nil {
			t.Fatal(err)
		}
		if err := ch.Confirm(false); err != nil {
			t.Fatal(err)
		}
		dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), "", q, true, false, amqp091.Publishing{Body: []byte("x")})
		if err != nil || !dc.Wait() {
			t.Fatalf("publish in %s: %v", a, err)
		}
		for i, want := range []int{1, 0} {
			ch, err := conns[i].Channel()
			if err != nil {
				t.Fatal(err)
			}
			got, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
			if err != nil || got.Messages != want {
				t.Errorf("%s in vhost %s: %d messages (%v), want %d", q, names[i], got.Messages, err, want)
			}
		}
		// DialURL reaches the vhost too.
		if n := QueueLen(t, DialURL(t, OnVHost(URL(), a)), q); n != 1 {
			t.Errorf("DialURL: %s in vhost %s holds %d, want 1", q, a, n)
		}
	})
	for _, v := range names {
		if err := managementDo(managementURLEnv(), http.MethodGet, "/api/vhosts/"+url.PathEscape(v), nil); !errors.Is(err, errNotFound) {
			t.Errorf("vhost %s after its test: %v, want it deleted (404)", v, err)
		}
	}
}
