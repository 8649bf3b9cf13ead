package amqp_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/internal/testlog"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/amqp"
)

func TestDialWithoutBrokerNamesRabbitMQAndHidesThePassword(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := amqp.Dial(ctx, amqp.Config{URL: "amqp://guest:secret-password@127.0.0.1:1/"})
	if !errors.Is(err, amqp.ErrBrokerUnavailable) {
		t.Fatalf("want ErrBrokerUnavailable, got %v", err)
	}
	if strings.Contains(err.Error(), "secret-password") || !strings.Contains(err.Error(), "127.0.0.1:1") {
		t.Fatalf("error must name the broker without its password: %v", err)
	}
}

// A channel-level error (publishing to an exchange that does not exist:
// 404, the broker closes the channel) fails that publish with
// ErrChannelLost; the next publish opens a new channel and is confirmed.
func TestPublisherReopensItsChannelAfterAChannelError(t *testing.T) {
	conn, q, bad := pubSetup(t, amqp.PublisherConfig{})
	ctx := context.Background()
	err := bad.PublishRaw(ctx, "km0.no-such-exchange."+q, "x", amqp091.Publishing{Body: []byte(`{}`)})
	if !errors.Is(err, amqp.ErrChannelLost) || !strings.Contains(err.Error(), "NOT_FOUND") {
		t.Fatalf("want ErrChannelLost with the broker's 404, got %v", err)
	}
	if err := bad.Publish(ctx, []*transport.Message{event(t, q, "k", 1)}); err != nil {
		t.Fatalf("the publisher did not recover: %v", err)
	}
	if n := queueLen(t, conn, q); n != 1 {
		t.Fatalf("queue holds %d, want 1", n)
	}
	if conn.Reconnects() != 0 {
		t.Fatal("a channel error must not cost the connection")
	}
}

// A topology that cannot be declared again after a reconnection (here the
// queue was recreated meanwhile with other arguments: PRECONDITION_FAILED)
// keeps the Conn down: that is logged as an error naming the queue and the
// broker's reason, and the Conn keeps trying, so it heals once the conflict
// is gone.
func TestReconnectLogsATopologyItCannotRedeclareAndKeepsTrying(t *testing.T) {
	amqptest.Shared(t)
	var logs testlog.Buffer
	name := amqptest.Name("km0-test-redeclare")
	conn, err := amqp.Dial(context.Background(), amqp.Config{URL: amqptest.URL(), Name: name, ReconnectMax: time.Second,
		Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo}))})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	q := amqptest.Name("t.conn")
	amqptest.DeleteQueuesAtCleanup(t, func() []string { return []string{q} })
	if err := conn.Declare(context.Background(), amqp.Topology{Queues: []amqp.Queue{{Name: q, Durable: true,
		Args: amqp091.Table{amqp.ArgMessageTTL: int32(60000)}}}}); err != nil {
		t.Fatal(err)
	}
	other, err := amqp091.Dial(amqptest.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	ch, err := other.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDelete(q, false, false, false); err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(q, true, false, false, false, amqp091.Table{amqp.ArgMessageTTL: int32(1000)}); err != nil {
		t.Fatal(err)
	}
	amqptest.CloseConnection(t, name)
	testkit.Eventually(t, 30*time.Second, "an error log naming the queue and PRECONDITION_FAILED", func() bool {
		for _, line := range strings.Split(logs.String(), "\n") {
			if strings.Contains(line, "level=ERROR") && strings.Contains(line, q) && strings.Contains(line, "PRECONDITION_FAILED") {
				return true
			}
		}
		return false
	})

	if conn.Reconnects() != 0 {
		t.Fatal("reconnected although the topology could not be declared")
	}
	// The operator removes the conflicting queue: the Conn heals and
	// declares it with its own arguments.
	if _, err := ch.QueueDelete(q, false, false, false); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 30*time.Second, "the reconnection", func() bool { return conn.Reconnects() == 1 })
	if err := conn.Do(context.Background(), func(ch *amqp091.Channel) error {
		_, err := ch.QueueDeclare(q, true, false, false, false, amqp091.Table{amqp.ArgMessageTTL: int32(60000)})
		return err
	}); err != nil {
		t.Fatalf("the queue is not back with the registered arguments: %v", err)
	}
}

// A broker that refuses the login (403) is named as such, with the user and
// without the password, not as unavailable.
func TestDialWithAWrongPasswordSaysLoginRefused(t *testing.T) {
	u := amqptest.URL()
	pu, err := amqp091.ParseURI(u)
	if err != nil {
		t.Fatal(err)
	}
	pu.Password = "secret-password"
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = amqp.Dial(ctx, amqp.Config{URL: pu.String()})
	want := fmt.Sprintf(`amqp: login refused: RabbitMQ at %s refused user %q (403 ACCESS_REFUSED: check the user and its password)`,
		strings.Replace(pu.String(), ":secret-password@", ":xxxxx@", 1), pu.Username)
	if !errors.Is(err, amqp.ErrLoginRefused) || errors.Is(err, amqp.ErrBrokerUnavailable) || err.Error() != want {
		t.Fatalf("got %v, want ErrLoginRefused %q", err, want)
	}
}
