package kafka_test

import (
	"strings"
	"testing"

	"github.com/km0/km0/transport/kafka"
)

// NewSource checks its configuration when it is called, as amqp.NewSource
// does, and names every problem; a valid one gets its defaults.
func TestNewSourceRefusesABadConfigAtConstruction(t *testing.T) {
	src, err := kafka.NewSource(kafka.SourceConfig{Topics: []string{"t.retry", ""}, MaxHeld: -1})
	if err == nil || src != nil {
		t.Fatalf("NewSource of a bad config: %v, %v; want an error", src, err)
	}
	for _, want := range []string{"no Brokers", "no Group", "derived", "empty topic name", "MaxHeld"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %q", err, want)
		}
	}
	src, err = kafka.NewSource(kafka.SourceConfig{Brokers: []string{"127.0.0.1:1"}, Group: "g", Topics: []string{"t"}})
	if err != nil || src.Config().SessionTimeout != kafka.SessionTimeoutDefault || src.Validate() != nil {
		t.Fatalf("NewSource of a good config: %v", err)
	}
}
