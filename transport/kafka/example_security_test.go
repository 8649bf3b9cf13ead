package kafka_test

import (
	"fmt"
	"os"

	"github.com/km0/km0/transport/kafka"
)

// A client of a managed cluster: SASL SCRAM-SHA-512 over TLS, the password
// from the environment. The same options go to every client: NewClient,
// SourceConfig.KgoOpts, kafkarr's KgoOpts, system.Config.KafkaOpts.
func ExampleSecurity() {
	sec := kafka.Security{
		TLS:           true, // the system's roots; TLSCAFile for a private CA
		SASLMechanism: kafka.SASLScramSHA512,
		SASLUsername:  "km0-relay",
		SASLPassword:  os.Getenv("KM0_KAFKA_SASL_PASSWORD"),
	}
	if sec.SASLPassword == "" {
		sec.SASLPassword = "example" // so that the example runs
	}
	opts, err := sec.Opts()
	if err != nil {
		fmt.Println(err)
		return
	}
	cl, err := kafka.NewClient([]string{"broker-1.example:9092"}, opts...)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cl.Close()
	fmt.Println(sec) // never the password
	// Output: SASL_SSL SCRAM-SHA-512 user km0-relay
}
