// Package amqptest connects tests to the machine's real RabbitMQ, gives them
// unique queue names and deletes those queues at cleanup. A broker that does
// not answer is a test failure naming RabbitMQ, never a skip.
//
// The broker is shared, and one test (the broker-restart proof) stops it.
// Every connection taken here holds a shared flock on RestartLock for the
// test's lifetime; the restart test takes it exclusively (Exclusive), so it
// waits for the others and they wait for it.
package amqptest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/transport/amqp"
)

// RestartLock is the file the broker-restart test locks exclusively.
const RestartLock = "/tmp/km0-rabbitmq-restart.lock"

// URL is the broker tests use: KM0_TEST_AMQP_URL, else guest@127.0.0.1:5672.
func URL() string {
	if u := os.Getenv("KM0_TEST_AMQP_URL"); u != "" {
		return u
	}
	return amqp.URLDefault
}

// Shared holds the restart lock in shared mode until the test ends.
func Shared(t testing.TB) { lock(t, syscall.LOCK_SH) }

// Exclusive holds the restart lock exclusively until the test ends: no other
// test that uses amqptest runs meanwhile (in any package).
func Exclusive(t testing.TB) { lock(t, syscall.LOCK_EX) }

func lock(t testing.TB, how int) {
	t.Helper()
	f, err := os.OpenFile(RestartLock, os.O_CREATE|os.O_RDWR, 0o666)
	if err != nil {
		t.Fatalf("amqptest: open %s: %v", RestartLock, err)
	}
	if err := syscall.Flock(int(f.Fd()), how); err != nil {
		f.Close()
		t.Fatalf("amqptest: flock %s: %v", RestartLock, err)
	}
	t.Cleanup(func() { f.Close() }) // closing releases the lock
}

// Dial takes the shared lock and connects; the connection closes at cleanup.
func Dial(t testing.TB) *amqp.Conn {
	t.Helper()
	Shared(t)
	return dial(t)
}

// DialUnlocked connects without taking the lock (for a test that already
// holds it exclusively).
func DialUnlocked(t testing.TB) *amqp.Conn {
	t.Helper()
	return dial(t)
}

func dial(t testing.TB) *amqp.Conn {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	c, err := amqp.Dial(ctx, amqp.Config{URL: URL(), Name: "km0-test " + t.Name(), ReconnectMax: time.Second})
	if err != nil {
		t.Fatalf("RabbitMQ is required and did not answer: %v (start it with: rabbitmq-server -detached)", err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// Name returns a queue name unique to this run: prefix + "." + random hex.
func Name(prefix string) string {
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	return prefix + "." + hex.EncodeToString(b)
}

// QueueLen returns the number of ready messages in queue.
func QueueLen(t testing.TB, conn *amqp.Conn, queue string) int {
	t.Helper()
	return inspect(t, conn, queue).Messages
}

// QueueConsumers returns the number of consumers of queue.
func QueueConsumers(t testing.TB, conn *amqp.Conn, queue string) int {
	t.Helper()
	return inspect(t, conn, queue).Consumers
}

func inspect(t testing.TB, conn *amqp.Conn, queue string) amqp091.Queue {
	t.Helper()
	var q amqp091.Queue
	err := conn.Do(context.Background(), func(ch *amqp091.Channel) error {
		var err error
		q, err = ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return q
}

// DeleteQueuesAtCleanup deletes the queues names returns, when the test ends,
// on a fresh connection (the test's may be closed by then).
func DeleteQueuesAtCleanup(t testing.TB, names func() []string) {
	t.Helper()
	deleteQueuesAtCleanup(t, URL(), names)
}

func deleteQueuesAtCleanup(t testing.TB, amqpURL string, names func() []string) {
	t.Cleanup(func() {
		conn, err := amqp091.Dial(amqpURL)
		if err != nil {
			t.Errorf("amqptest: cleanup: %v", err)
			return
		}
		defer conn.Close()
		for _, n := range names() {
			ch, err := conn.Channel()
			if err != nil {
				t.Errorf("amqptest: cleanup: %v", err)
				return
			}
			if _, err := ch.QueueDelete(n, false, false, false); err != nil && !strings.Contains(err.Error(), "NOT_FOUND") {
				t.Errorf("amqptest: delete queue %s: %v", n, err)
			}
			_ = ch.Close()
		}
	})
}

// DeleteExchangesAtCleanup deletes the exchanges names, when the test ends,
// on a fresh connection. Register it before DeleteQueuesAtCleanup of the
// queues bound to them if they must outlive the queues (cleanups run last
// registered first); the order does not matter otherwise.
func DeleteExchangesAtCleanup(t testing.TB, names ...string) {
	t.Helper()
	t.Cleanup(func() {
		conn, err := amqp091.Dial(URL())
		if err != nil {
			t.Errorf("amqptest: cleanup: %v", err)
			return
		}
		defer conn.Close()
		for _, n := range names {
			ch, err := conn.Channel()
			if err != nil {
				t.Errorf("amqptest: cleanup: %v", err)
				return
			}
			if err := ch.ExchangeDelete(n, false, false); err != nil && !strings.Contains(err.Error(), "NOT_FOUND") {
				t.Errorf("amqptest: delete exchange %s: %v", n, err)
			}
			_ = ch.Close()
		}
	})
}

// ExchangeExists reports whether exchange exists on the broker.
func ExchangeExists(t testing.TB, name string) bool {
	t.Helper()
	conn, err := amqp091.Dial(URL())
	if err != nil {
		t.Fatalf("amqptest: %v", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatalf("amqptest: %v", err)
	}
	defer ch.Close() //nolint:errcheck // a failed passive declare closed it
	err = ch.ExchangeDeclarePassive(name, amqp091.ExchangeHeaders, true, true, false, false, nil)
	if err == nil {
		return true
	}
	var aerr *amqp091.Error
	if errors.As(err, &aerr) && aerr.Code == amqp091.NotFound {
		return false
	}
	t.Fatalf("amqptest: exchange %s: %v", name, err)
	return false
}

// Rabbitmqctl runs rabbitmqctl with args and fails the test on error.
func Rabbitmqctl(t testing.TB, args ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "rabbitmqctl", args...).CombinedOutput()
	if err != nil {
		t.Fatalf("rabbitmqctl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// CloseConnection makes the broker close the connection whose
// connection_name is name (rabbitmqctl close_connection), as a network
// failure or an operator would. It fails the test if there is none.
func CloseConnection(t testing.TB, name string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "rabbitmqctl", "list_connections", "-q", "pid", "client_properties").CombinedOutput()
	if err != nil {
		t.Fatalf("rabbitmqctl list_connections: %v\n%s", err, out)
	}
	for _, line := range strings.Split(string(out), "\n") {
		if pid, props, ok := strings.Cut(line, "\t"); ok && strings.Contains(props, `{"connection_name","`+name+`"}`) {
			Rabbitmqctl(t, "close_connection", pid, "km0 test: "+t.Name())
			return
		}
	}
	t.Fatalf("no connection named %q:\n%s", name, out)
}

// StopAppWithRestore runs rabbitmqctl stop_app and registers a cleanup that
// runs start_app, whatever happens to the test, and waits for the port.
func StopAppWithRestore(t testing.TB) {
	t.Helper()
	t.Cleanup(func() { StartApp(t) })
	Rabbitmqctl(t, "stop_app")
}

// StartApp runs rabbitmqctl start_app (harmless if running) and waits until
// the broker accepts AMQP connections again.
func StartApp(t testing.TB) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if out, err := exec.CommandContext(ctx, "rabbitmqctl", "start_app").CombinedOutput(); err != nil {
		t.Errorf("rabbitmqctl start_app: %v\n%s", err, out)
		return
	}
	for ctx.Err() == nil {
		if c, err := amqp091.Dial(URL()); err == nil {
			_ = c.Close()
			return
		}
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
	t.Errorf("RabbitMQ did not accept connections after start_app")
}

// DLQLen returns the number of messages in the DLQ of the work queue queue.
func DLQLen(t testing.TB, conn *amqp.Conn, queue string) int {
	t.Helper()
	return QueueLen(t, conn, contract.DLQName(queue))
}

// DeadLetters returns the messages of the DLQ of the work queue queue as
// the DLQ index reads them (amqp.DeadLetterOf), oldest first, and leaves
// them all in the DLQ: it gets them unacked and closes its channel, so
// RabbitMQ requeues them in their order. Tests read a DLQ with it; operators
// use package dlq (`km0 dlq`).
func DeadLetters(t testing.TB, conn *amqp.Conn, queue string) []*amqp.DeadLetter {
	t.Helper()
	var out []*amqp.DeadLetter
	err := conn.Do(context.Background(), func(ch *amqp091.Channel) error {
		for {
			d, ok, err := ch.Get(contract.DLQName(queue), false)
			if err != nil || !ok {
				return err
			}
			out = append(out, amqp.DeadLetterOf(queue, &d))
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// DeadLetter returns the dead letter of queue's DLQ whose id_esdeveniment
// or message_id is id, or nil.
func DeadLetter(t testing.TB, conn *amqp.Conn, queue, id string) *amqp.DeadLetter {
	t.Helper()
	for _, dl := range DeadLetters(t, conn, queue) {
		if dl.EventID == id || dl.MessageID == id {
			return dl
		}
	}
	return nil
}

// ManagementURL is the RabbitMQ management API tests use:
// KM0_TEST_AMQP_MANAGEMENT_URL, else http://guest:guest@127.0.0.1:15672 (the
// plugin's default listener; rabbitmq-plugins enable rabbitmq_management).
// An API that does not answer fails the test naming it under CI=true, and
// skips it otherwise (the plugin is optional on a developer's broker).
func ManagementURL(t testing.TB) string {
	t.Helper()
	u := managementURLEnv()
	err := probeManagement(u)
	if err == nil {
		return u
	}
	msg := "the RabbitMQ management API does not answer: " + err.Error() +
		" (enable it with: rabbitmq-plugins enable rabbitmq_management; or set KM0_TEST_AMQP_MANAGEMENT_URL)"
	if os.Getenv("CI") == "true" {
		t.Fatal(msg)
	}
	t.Skip(msg)
	return ""
}

// probeManagement asks GET /api/overview of the management API at u.
// Its error never quotes u (it holds the password).
func probeManagement(u string) error {
	pu, err := url.Parse(u)
	if err != nil || pu.Host == "" {
		return errors.New("KM0_TEST_AMQP_MANAGEMENT_URL is not an absolute URL")
	}
	user := pu.User
	pu.User = nil
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(pu.String(), "/")+"/api/overview", nil)
	if err != nil {
		return err
	}
	if user != nil {
		pw, _ := user.Password()
		req.SetBasicAuth(user.Username(), pw)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("%s: %v", pu.Host, errors.Unwrap(err))
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s answered %s", pu.Host, resp.Status)
	}
	return nil
}

// UnackedQueue declares a queue named after prefix with ready+unacked
// messages and takes unacked of them on a consumer that never acknowledges
// them: its connection stays open until the test ends. The queue is deleted
// at cleanup.
func UnackedQueue(t testing.TB, prefix string, ready, unacked int) string {
	t.Helper()
	return UnackedQueueAt(t, URL(), prefix, ready, unacked)
}

// UnackedQueueAt is UnackedQueue on the broker of amqpURL (a VHost URL).
func UnackedQueueAt(t testing.TB, amqpURL, prefix string, ready, unacked int) string {
	t.Helper()
	conn := DialURL(t, amqpURL)
	q := Name(prefix)
	deleteQueuesAtCleanup(t, amqpURL, func() []string { return []string{q} })
	raw, err := amqp091.Dial(amqpURL)
	if err != nil {
		t.Fatalf("RabbitMQ is required and did not answer: %v (start it with: rabbitmq-server -detached)", err)
	}
	t.Cleanup(func() { _ = raw.Close() })
	ch, err := raw.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < ready+unacked; i++ {
		if err := ch.PublishWithContext(context.Background(), "", q, false, false, amqp091.Publishing{Body: []byte("x")}); err != nil {
			t.Fatal(err)
		}
	}
	testkit.Eventually(t, 10*time.Second, "the messages in the queue", func() bool { return QueueLen(t, conn, q) == ready+unacked })
	if unacked == 0 {
		return q
	}
	if err := ch.Qos(unacked, 0, false); err != nil {
		t.Fatal(err)
	}
	ds, err := ch.Consume(q, "", false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < unacked; i++ {
		select {
		case <-ds:
		case <-time.After(10 * time.Second):
			t.Fatalf("delivery %d of %s did not arrive", i+1, q)
		}
	}
	return q
}
