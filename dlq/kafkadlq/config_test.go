package kafkadlq_test

import (
	"strings"
	"testing"

	"github.com/km0/km0/dlq"
	"github.com/km0/km0/dlq/kafkadlq"
)

// A backend and an indexer refuse, at construction, what they could never
// run with: no brokers, a topic pattern that is not a regular expression,
// an indexer without a Store.
func TestConfigRefusals(t *testing.T) {
	store := dlq.NewStore(nil, "public")
	for _, c := range []struct {
		name string
		err  error
		want string
	}{
		{"backend without brokers", backendErr(kafkadlq.Config{}), "dlq: no Kafka brokers"},
		{"backend with a bad pattern", backendErr(kafkadlq.Config{Brokers: []string{"127.0.0.1:1"}, TopicPattern: "("}), "dlq: topic pattern: "},
		{"indexer without a store", indexerErr(kafkadlq.IndexerConfig{Kafka: kafkadlq.Config{Brokers: []string{"127.0.0.1:1"}}}), "kafkadlq: IndexerConfig needs a Store"},
		{"indexer without brokers", indexerErr(kafkadlq.IndexerConfig{Store: store}), "dlq: no Kafka brokers"},
	} {
		if c.err == nil || !strings.HasPrefix(c.err.Error(), c.want) {
			t.Errorf("%s: %v, want %q", c.name, c.err, c.want)
		}
	}
}

func backendErr(cfg kafkadlq.Config) error {
	b, err := kafkadlq.New(cfg)
	if err == nil {
		b.Close()
	}
	return err
}

func indexerErr(cfg kafkadlq.IndexerConfig) error {
	_, err := kafkadlq.NewIndexer(cfg)
	return err
}
