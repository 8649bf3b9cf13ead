package amqprr_test

import (
	"fmt"
	"log/slog"

	"github.com/km0/km0/requestreply/amqprr"
)

// The server's defaults, and the queue name RabbitMQ's direct reply-to uses
// (ClientConfig.DirectReplyTo).
func Example_defaults() {
	fmt.Println("ServerConfig.Queue", amqprr.QueueDefault)
	fmt.Println("ServerConfig.Prefetch", amqprr.PrefetchDefault)
	fmt.Println("ServerConfig.Workers", amqprr.WorkersDefault)
	fmt.Println("direct reply-to", amqprr.DirectReplyTo)
	// Output:
	// ServerConfig.Queue pagaments.autoritzacions
	// ServerConfig.Prefetch 64
	// ServerConfig.Workers 16
	// direct reply-to amq.rabbitmq.reply-to
}

// What a health page reports of request/reply over RabbitMQ: the server's
// counters and, on the client, the replies it dropped (late, or not signed
// with the shared key).
func ExampleServer_Stats() {
	var (
		server *amqprr.Server // from amqprr.NewServer
		client *amqprr.Client // from amqprr.NewClient
	)
	var st amqprr.ServerStats = server.Stats()
	slog.Info("amqprr", "replied", st.Replied, "error_replies", st.ErrorReplies, "expired", st.Expired,
		"unauthenticated", st.Unauthenticated, "late_replies", client.LateReplies(), "dropped_replies", client.DroppedReplies())
}
