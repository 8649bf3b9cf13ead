package lag_test

import (
	"context"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/lag"
	"github.com/km0/km0/transport/amqp/amqplag"
)

// The unacknowledged messages of a queue come from the management API: two
// messages held by a consumer that never acks are counted as unacked, the
// three others as ready.
func TestMeasureQueueUnackedThroughTheManagementAPI(t *testing.T) {
	t.Parallel()
	mgmt := amqptest.ManagementURL(t)
	q := amqptest.UnackedQueue(t, "km0.lagtest.unacked", 3, 2)
	m, err := lag.NewMeasurer(lag.Config{RabbitMQ: amqplag.New(amqptest.Dial(t)), Queues: []string{q}, ManagementURL: mgmt, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	var last lag.QueueLag
	// The broker samples its queue statistics every 5 s by default.
	testkit.Eventually(t, 30*time.Second, "2 unacked and 3 ready through the management API", func() bool {
		s, err := m.Measure(context.Background())
		if err != nil || len(s.Errors) > 0 || len(s.Queues) != 1 {
			t.Fatalf("measure: %v %v %+v", err, s.Errors, s.Queues)
		}
		last = s.Queues[0]
		return last.Unacked == 2 && last.Ready == 3 && last.Consumers == 1
	})

	if last.Err != "" {
		t.Fatalf("queue: %+v", last)
	}
}

// A queue on a virtual host other than "/", named with a "/" as RabbitMQ
// allows: the vhost comes from the AMQP URL (amqplag.ManagementURLFor, as
// km0 lag and km0 console derive it), is escaped in the management API's
// path (km0%2Fprod…), and the unacked count is the vhost's queue's.
func TestMeasureQueueUnackedOnAVHost(t *testing.T) {
	t.Parallel()
	mgmt := amqptest.ManagementURL(t)
	vhostURL := amqptest.OnVHost(amqptest.URL(), amqptest.NewVHostNamed(t, "km0/lagtest"))
	q := amqptest.UnackedQueueAt(t, vhostURL, "km0.lagtest.vhost", 1, 2)
	_, vhost, err := amqplag.ManagementURLFor(vhostURL)
	if err != nil || !strings.HasPrefix(vhost, "km0/lagtest.") {
		t.Fatalf("ManagementURLFor: vhost %q, %v", vhost, err)
	}
	m, err := lag.NewMeasurer(lag.Config{RabbitMQ: amqplag.New(amqptest.DialURL(t, vhostURL)), Queues: []string{q}, ManagementURL: mgmt,
		VHost: vhost, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	testkit.Eventuallyf(t, 30*time.Second, "2 unacked and 1 ready on the vhost", func() (bool, string) {
		s, err := m.Measure(context.Background())
		if err != nil || len(s.Errors) > 0 || len(s.Queues) != 1 {
			t.Fatalf("measure: %v %v %+v", err, s.Errors, s.Queues)
		}
		l := s.Queues[0]
		return l.Unacked == 2 && l.Ready == 1 && l.Consumers == 1 && l.Err == "", fmt.Sprintf("%+v", l)
	})
}

// A management API that does not answer: named in the snapshot's errors
// (without host or password) when it was configured, a note and unacked
// unknown when it was a guess; ready counts stay exact either way.
func TestManagementAPIThatDoesNotAnswer(t *testing.T) {
	t.Parallel()
	q := amqptest.UnackedQueue(t, "km0.lagtest.unacked", 3, 2)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := "http://guest:s3cr3t@" + ln.Addr().String()
	ln.Close() // nothing listens there now
	for _, bestEffort := range []bool{false, true} {
		m, err := lag.NewMeasurer(lag.Config{RabbitMQ: amqplag.New(amqptest.Dial(t)), Queues: []string{q}, ManagementURL: closed,
			ManagementBestEffort: bestEffort, Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		s, err := m.Measure(context.Background())
		if err != nil || len(s.Queues) != 1 {
			t.Fatalf("measure: %v %+v", err, s.Queues)
		}
		if got := s.Queues[0]; got.Ready != 3 || got.Unacked != -1 || got.Err != "" {
			t.Fatalf("best effort %v: queue %+v, want 3 ready, unacked unknown", bestEffort, got)
		}
		all := strings.Join(append(s.Errors, s.Notes...), " ")
		if strings.Contains(all, "s3cr3t") || strings.Contains(all, ln.Addr().String()) {
			t.Fatalf("the snapshot quotes the management URL: %q", all)
		}
		if bestEffort {
			if len(s.Errors) != 0 || len(s.Notes) != 1 || s.Notes[0] != lag.NoteNoManagement {
				t.Fatalf("best effort: errors %v notes %v, want only the note", s.Errors, s.Notes)
			}
		} else if len(s.Errors) != 1 || !strings.Contains(s.Errors[0], "management API") || len(s.Notes) != 0 {
			t.Fatalf("configured: errors %v notes %v, want one error naming the management API", s.Errors, s.Notes)
		}
	}
}
