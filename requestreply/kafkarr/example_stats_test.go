package kafkarr_test

import (
	"fmt"
	"log/slog"
	"strings"

	"github.com/km0/km0/requestreply/kafkarr"
)

// The server's defaults. A client's reply topic starts with
// ReplyTopicPrefix, and a server answers only topics with that prefix.
func Example_defaults() {
	fmt.Println("ServerConfig.Topic", kafkarr.TopicDefault)
	fmt.Println("ServerConfig.Workers", kafkarr.WorkersDefault)
	fmt.Println("ServerConfig.ReplyTimeout", kafkarr.ReplyTimeoutDefault)
	fmt.Println("reply topics", kafkarr.ReplyTopicPrefix+"*")
	// Output:
	// ServerConfig.Topic pagaments.autoritzacions
	// ServerConfig.Workers 16
	// ServerConfig.ReplyTimeout 2s
	// reply topics respostes.*
}

// What a health page reports of request/reply over Kafka: the server's
// counters and, on the client, its reply topic and the replies it dropped
// (late, or not signed with the shared key).
func ExampleServer_Stats() {
	var (
		server *kafkarr.Server // from kafkarr.NewServer
		client *kafkarr.Client // from kafkarr.NewClient
	)
	var st kafkarr.ServerStats = server.Stats()
	slog.Info("kafkarr", "replied", st.Replied, "error_replies", st.ErrorReplies, "unanswerable", st.Unanswerable,
		"expired", st.Expired, "unauthenticated", st.Unauthenticated, "reply_topic", client.ReplyTopic(),
		"own_prefix", strings.HasPrefix(client.ReplyTopic(), kafkarr.ReplyTopicPrefix),
		"late_replies", client.LateReplies(), "dropped_replies", client.DroppedReplies())
}
