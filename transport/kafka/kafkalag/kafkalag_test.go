package kafkalag_test

import (
	"testing"

	"github.com/km0/km0/lag"
	"github.com/km0/km0/transport/kafka/kafkalag"
)

// The probe needs brokers; with them it is a lag.GroupProbe whose Close the
// Measurer calls. (Its measures are proved through lag's tests:
// TestMeasureKafkaGroup, TestForeignGroupsOnlyOnRequest.)
func TestNewNeedsBrokers(t *testing.T) {
	if _, err := kafkalag.New(kafkalag.Config{}); err == nil || err.Error() != "kafkalag: no Kafka brokers" {
		t.Fatalf("New without brokers: %v", err)
	}
	p, err := kafkalag.New(kafkalag.Config{Brokers: []string{"127.0.0.1:1"}})
	if err != nil {
		t.Fatal(err)
	}
	var _ lag.GroupProbe = p
	p.Close()
}
