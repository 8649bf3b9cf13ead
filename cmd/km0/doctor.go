package main

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"time"

	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/doctor"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/outbox"
)

func init() {
	register(&command{name: "doctor", summary: "check a deployment's connections, PostgreSQL, topics and RabbitMQ; exit 1 on a failure", run: runDoctor})
}

// runDoctor is `km0 doctor`: the deployment's flags and environment, the
// same as km0 up's, checked (package internal/doctor) and reported; exit 1
// when a check failed.
func runDoctor(ctx context.Context, args []string) error {
	fs := cli.NewFlags("doctor", "check the connections (TLS, SASL), PostgreSQL (version, wal_level, REPLICATION, slots, LISTEN through a pooler), the contract's Kafka topics and RabbitMQ of a deployment; every failure says what to change; exit 1 on a failure")
	dbURL := cli.DatabaseURLFlag(fs)
	relayMode := fs.String("relay", system.RelayPolling, "the services' relay mode, as km0 up's --relay: polling (LISTEN/NOTIFY is checked) or cdc (wal_level = logical, REPLICATION and the slots are checked)")
	outboxMode := fs.String("outbox", string(outbox.ModeTable), "as km0 up's --outbox: table or wal (implies --relay cdc)")
	listenWait := fs.Duration("listen-wait", 3*time.Second, "how long the LISTEN self-test waits for its notification")
	brokers := cli.BrokersFlag(fs)
	ksec := cli.KafkaSecurityFlags(fs)
	topics := fs.String("topics", os.Getenv("KM0_TOPICS"), "as km0 up's --topics: renamed domain topics CONTRACT=NAME,... (default $KM0_TOPICS)")
	groups := fs.String("groups", os.Getenv("KM0_GROUPS"), "as km0 up's --groups: renamed consumer groups, which name the RabbitMQ queues (default $KM0_GROUPS)")
	events := cli.EventsFlag(fs)
	eventsExchange := fs.String("events-exchange", cmp.Or(os.Getenv("KM0_EVENTS_EXCHANGE"), system.EventsExchangeDefault), "as km0 up's --events-exchange (default $KM0_EVENTS_EXCHANGE, else "+system.EventsExchangeDefault+")")
	eventsPrefix := fs.String("events-queue-prefix", os.Getenv("KM0_EVENTS_QUEUE_PREFIX"), "as km0 up's --events-queue-prefix (default $KM0_EVENTS_QUEUE_PREFIX)")
	amqpURL := cli.SecretString(fs, "amqp-url", os.Getenv("KM0_AMQP_URL"), "RabbitMQ URL (default $KM0_AMQP_URL; empty: RabbitMQ is not checked unless --events puts events there, then the local guest broker)")
	amqpTLS := cli.AddAMQPTLSFlags(fs)
	mgmt := cli.SecretString(fs, "amqp-management-url", os.Getenv("KM0_AMQP_MANAGEMENT_URL"), "RabbitMQ management API, as km0 lag's (default $KM0_AMQP_MANAGEMENT_URL, else port 15672 of the AMQP URL's host, 15671 for amqps, with its credentials; \"off\": the management API, the broker's clock and the topology are not checked)")
	principals := fs.String("kafka-principals", os.Getenv("KM0_KAFKA_PRINCIPALS"), "the Kafka principal of each service whose ACLs are checked (with SASL), SERVICE=User:NAME,... (default $KM0_KAFKA_PRINCIPALS, else User:km0-<service>, User:km0-dlq for km0 dlq)")
	authorize := fs.Bool("authorize", false, "as km0 up's --authorize: pagaments' authorisation queue is checked when request/reply goes over RabbitMQ")
	maxSkew := fs.Duration("max-clock-skew", 2*time.Second, "the largest difference with the servers' clocks that is ok")
	timeout := fs.Duration("timeout", 15*time.Second, "bound of each connection check")
	asJSON := fs.Bool("json", false, "print the findings as JSON")
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	if *outboxMode == string(outbox.ModeWAL) && !flagSet(fs, "relay") {
		*relayMode = system.RelayCDC
	}
	if *relayMode != system.RelayPolling && *relayMode != system.RelayCDC {
		return fmt.Errorf("--relay %q: want polling or cdc", *relayMode)
	}
	if *outboxMode != string(outbox.ModeTable) && *outboxMode != string(outbox.ModeWAL) {
		return fmt.Errorf("--outbox %q: want table or wal", *outboxMode)
	}
	renames, err := parseRenames("--topics", *topics)
	if err != nil {
		return err
	}
	groupRenames, err := parseRenames("--groups", *groups)
	if err != nil {
		return err
	}
	principalMap, err := parseRenames("--kafka-principals", *principals)
	if err != nil {
		return err
	}
	evBroker, evTopics, err := system.ParseEvents(*events)
	if err != nil {
		return fmt.Errorf("--events: %w", err)
	}
	log := cli.Logger()
	bs, _ := cli.RequireBrokers(*brokers)
	r, err := doctor.Check(ctx, doctor.Config{DatabaseURL: *dbURL, RelayMode: *relayMode, OutboxMode: *outboxMode, ListenWait: *listenWait,
		Brokers: bs, KafkaSecurity: ksec.Security(log), AMQPURL: *amqpURL, AMQPTLS: amqpTLS.Config, ManagementURL: *mgmt,
		ManagementClient: cli.ManagementClient, Authorize: *authorize, Principals: principalMap, MaxSkew: *maxSkew, Timeout: *timeout, Logger: log,
		System: system.Config{Events: evBroker, EventsByTopic: evTopics, EventsExchange: *eventsExchange, EventsQueuePrefix: *eventsPrefix,
			Topics: renames, Groups: groupRenames}})
	if err != nil {
		return err
	}
	if err := r.Print(os.Stdout, *asJSON); err != nil {
		return err
	}
	if n := r.Failed(); n > 0 {
		return fmt.Errorf("%d of %d checks failed: see WHAT TO CHANGE", n, len(r.Findings()))
	}
	return nil
}
