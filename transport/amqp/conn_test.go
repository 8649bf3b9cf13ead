package amqp_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

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
