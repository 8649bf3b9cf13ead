package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/transport/amqp"
)

func init() {
	register(&command{name: "doctor", summary: "check a deployment's connections, PostgreSQL, topics and RabbitMQ; exit 1 on a failure", run: runDoctor})
}

// Results of a doctor check.
const (
	resultOK   = "ok"
	resultWarn = "WARN"
	resultFail = "FAIL"
)

// finding is one row of the doctor's report: what was checked, against
// what, the result with what was seen, and, when it is not ok, what to
// change. No field ever holds a credential.
type finding struct {
	Check  string `json:"check"`
	Target string `json:"target"`
	Result string `json:"result"` // ok, WARN or FAIL
	Seen   string `json:"seen"`
	Fix    string `json:"fix,omitempty"`
}

// report collects the findings in the order they were made.
type report struct{ rows []finding }

func (r *report) ok(check, target, seen string) {
	r.rows = append(r.rows, finding{Check: check, Target: target, Result: resultOK, Seen: seen})
}

func (r *report) warn(check, target, seen, fix string) {
	r.rows = append(r.rows, finding{Check: check, Target: target, Result: resultWarn, Seen: seen, Fix: fix})
}

func (r *report) fail(check, target, seen, fix string) {
	r.rows = append(r.rows, finding{Check: check, Target: target, Result: resultFail, Seen: seen, Fix: fix})
}

// failed counts the FAIL rows.
func (r *report) failed() int {
	n := 0
	for _, f := range r.rows {
		if f.Result == resultFail {
			n++
		}
	}
	return n
}

// print writes the findings as one aligned table (CHECK, TARGET, RESULT,
// WHAT TO CHANGE) and a summary line, or as a JSON array.
func (r *report) print(w io.Writer, asJSON bool) error {
	if asJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(r.rows)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "CHECK\tTARGET\tRESULT\tWHAT TO CHANGE")
	for _, f := range r.rows {
		res := f.Result
		if f.Seen != "" {
			res += ": " + oneLine(f.Seen)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", f.Check, f.Target, res, cmp.Or(oneLine(f.Fix), "-"))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	warns := 0
	for _, f := range r.rows {
		if f.Result == resultWarn {
			warns++
		}
	}
	_, err := fmt.Fprintf(w, "\n%d checks: %d failed, %d warnings\n", len(r.rows), r.failed(), warns)
	return err
}

// oneLine keeps a table cell on one line.
func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

// doctorConfig is what the checks need from the flags.
type doctorConfig struct {
	databaseURL   string
	relayMode     string // polling or cdc
	outboxMode    string // table or wal
	listenWait    time.Duration
	brokers       []string
	kafkaSec      *kafkaSecurity
	kafkaTopics   []string // the domain topics on Kafka, renamed, with .retry and .dlq
	amqpURL       string
	amqpTLS       *amqpTLSFlags
	managementURL string
	rabbitTopics  []string      // the domain topics whose events go to RabbitMQ, renamed
	system        system.Config // what places the events (the RabbitMQ topology)
	authorize     bool
	principals    map[string]string // Kafka principals by service (ACLs)
	maxSkew       time.Duration
	timeout       time.Duration
}

// runDoctor is `km0 doctor`: the deployment's flags and environment, the
// same as km0 up's, checked and reported; exit 1 when a check failed.
func runDoctor(ctx context.Context, args []string) error {
	fs := newFlags("doctor", "check the connections (TLS, SASL), PostgreSQL (version, wal_level, REPLICATION, slots, LISTEN through a pooler), the contract's Kafka topics and RabbitMQ of a deployment; every failure says what to change; exit 1 on a failure")
	dbURL := databaseURLFlag(fs)
	relayMode := fs.String("relay", system.RelayPolling, "the services' relay mode, as km0 up's --relay: polling (LISTEN/NOTIFY is checked) or cdc (wal_level = logical, REPLICATION and the slots are checked)")
	outboxMode := fs.String("outbox", string(outbox.ModeTable), "as km0 up's --outbox: table or wal (implies --relay cdc)")
	listenWait := fs.Duration("listen-wait", 3*time.Second, "how long the LISTEN self-test waits for its notification")
	brokers := brokersFlag(fs)
	ksec := kafkaSecurityFlags(fs)
	topics := fs.String("topics", os.Getenv("KM0_TOPICS"), "as km0 up's --topics: renamed domain topics CONTRACT=NAME,... (default $KM0_TOPICS)")
	groups := fs.String("groups", os.Getenv("KM0_GROUPS"), "as km0 up's --groups: renamed consumer groups, which name the RabbitMQ queues (default $KM0_GROUPS)")
	events := eventsFlag(fs)
	eventsExchange := fs.String("events-exchange", cmp.Or(os.Getenv("KM0_EVENTS_EXCHANGE"), system.EventsExchangeDefault), "as km0 up's --events-exchange (default $KM0_EVENTS_EXCHANGE, else "+system.EventsExchangeDefault+")")
	eventsPrefix := fs.String("events-queue-prefix", os.Getenv("KM0_EVENTS_QUEUE_PREFIX"), "as km0 up's --events-queue-prefix (default $KM0_EVENTS_QUEUE_PREFIX)")
	amqpURL := secretString(fs, "amqp-url", os.Getenv("KM0_AMQP_URL"), "RabbitMQ URL (default $KM0_AMQP_URL; empty: RabbitMQ is not checked unless --events puts events there, then the local guest broker)")
	amqpTLS := addAMQPTLSFlags(fs)
	mgmt := secretString(fs, "amqp-management-url", os.Getenv("KM0_AMQP_MANAGEMENT_URL"), "RabbitMQ management API, as km0 lag's (default $KM0_AMQP_MANAGEMENT_URL, else port 15672 of the AMQP URL's host, 15671 for amqps, with its credentials; \"off\": the management API, the broker's clock and the topology are not checked)")
	principals := fs.String("kafka-principals", os.Getenv("KM0_KAFKA_PRINCIPALS"), "the Kafka principal of each service whose ACLs are checked (with SASL), SERVICE=User:NAME,... (default $KM0_KAFKA_PRINCIPALS, else User:km0-<service>, User:km0-dlq for km0 dlq)")
	authorize := fs.Bool("authorize", false, "as km0 up's --authorize: pagaments' authorisation queue is checked when request/reply goes over RabbitMQ")
	maxSkew := fs.Duration("max-clock-skew", 2*time.Second, "the largest difference with the servers' clocks that is ok")
	timeout := fs.Duration("timeout", 15*time.Second, "bound of each connection check")
	asJSON := fs.Bool("json", false, "print the findings as JSON")
	if err := parse(fs, args); err != nil {
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
	cfg := doctorConfig{databaseURL: *dbURL, relayMode: *relayMode, outboxMode: *outboxMode, listenWait: *listenWait,
		kafkaSec: ksec, amqpURL: *amqpURL, amqpTLS: amqpTLS, managementURL: *mgmt, authorize: *authorize, principals: principalMap, maxSkew: *maxSkew, timeout: *timeout,
		system: system.Config{Events: evBroker, EventsByTopic: evTopics, EventsExchange: *eventsExchange, EventsQueuePrefix: *eventsPrefix,
			Topics: renames, Groups: groupRenames}}
	for _, s := range system.Services {
		t, ok := system.Topics[s]
		if !ok {
			continue
		}
		name := cmp.Or(renames[t], t)
		if cmp.Or(evTopics[t], evBroker, system.EventsKafka) == system.EventsRabbitMQ {
			cfg.rabbitTopics = append(cfg.rabbitTopics, name)
			continue
		}
		cfg.kafkaTopics = append(cfg.kafkaTopics, name, contract.RetryTopic(name), contract.DLQName(name))
	}
	if len(cfg.rabbitTopics) > 0 && cfg.amqpURL == "" {
		cfg.amqpURL = amqp.URLDefault
	}
	if cfg.amqpURL == "" { // request/reply over Kafka
		cfg.kafkaTopics = append(cfg.kafkaTopics, pagaments.AuthQueue, inventari.ReserveQueue)
	}
	cfg.brokers, _ = requireBrokers(*brokers)
	needsKafka := len(cfg.kafkaTopics) > 0 || cfg.amqpURL == ""
	if needsKafka && len(cfg.brokers) == 0 {
		return errors.New("no Kafka brokers: pass --brokers or set KM0_KAFKA_BROKERS (the deployment's events or request/reply are on Kafka)")
	}
	if cfg.databaseURL == "" {
		return errors.New("no database: pass --database-url or set KM0_DATABASE_URL")
	}

	var r report
	checkPostgres(ctx, &r, cfg)
	if len(cfg.brokers) > 0 {
		checkKafka(ctx, &r, cfg)
	}
	if cfg.amqpURL != "" {
		checkRabbitMQ(ctx, &r, cfg)
	}
	if err := r.print(os.Stdout, *asJSON); err != nil {
		return err
	}
	if n := r.failed(); n > 0 {
		return fmt.Errorf("%d of %d checks failed: see WHAT TO CHANGE", n, len(r.rows))
	}
	return nil
}

// withTimeout runs fn under cfg.timeout.
func (cfg doctorConfig) withTimeout(ctx context.Context, fn func(ctx context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, cfg.timeout)
	defer cancel()
	return fn(ctx)
}

// clockSkew adds the finding of a server's clock, seen at server,
// against this host's, read at local (the middle of the round trip);
// resolution is the precision of the server's time.
func clockSkew(r *report, check, target string, server, local time.Time, resolution, maxSkew time.Duration) {
	d := server.Sub(local)
	if d < 0 {
		d = -d
	}
	seen := fmt.Sprintf("%v off this host", d.Round(time.Millisecond))
	if d > maxSkew+resolution {
		r.fail(check, target, seen, "synchronise the clocks (NTP/chrony) of this host and the server: the retry delays, the request deadlines and the lag are measured across machines")
		return
	}
	r.ok(check, target, seen)
}
