// Package system wires the six km0 services into running processes: each
// service's database (its own, or km0_<service> created if absent; migrated), its
// outbox relay, its consumers with their retry and DLQ topics, its
// request/reply servers and its HTTP API. Start runs all of them in one
// process (`km0 up`) or a chosen subset (`km0 serve NAME`). Relays and
// consumers run under a supervisor that restarts them when they die, which is
// how the demo's injected crashes (internal/faults) heal.
package system

import (
	"cmp"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"regexp"
	"slices"
	"strings"
	"time"
	"unicode"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/services/analitica"
	"github.com/km0/km0/internal/services/cataleg"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/pagaments/passarella"
	"github.com/km0/km0/internal/services/repartiment"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/transport/kafka"
)

// Services are the six services, in start order.
var Services = []string{comandes.Name, inventari.Name, pagaments.Name, repartiment.Name, analitica.Name, cataleg.Name}

// Publishing services and their topics (CONTRACT.md).
var Topics = map[string]string{
	comandes.Name:    comandes.Topic,
	inventari.Name:   inventari.Topic,
	pagaments.Name:   pagaments.Topic,
	repartiment.Name: repartiment.Topic,
}

// DomainTopics returns the four domain topics with their .retry and .dlq topics.
func DomainTopics() []string { return domainTopics(nil) }

// domainTopics is DomainTopics with the renames of Config.Topics.
func domainTopics(renames map[string]string) []string {
	var out []string
	for _, s := range Services {
		if t, ok := Topics[s]; ok {
			t = cmp.Or(renames[t], t)
			out = append(out, t, contract.RetryTopic(t), contract.DLQName(t))
		}
	}
	return out
}

// ConsumerNames are the consumidors of the six services, each the default
// name of its consumer group: the first six in the order of Services (one
// per service), then the services' further consumers.
var ConsumerNames = []string{comandes.ConsumerPaymentConfirmed, inventari.ConsumerDecrement, pagaments.ConsumerCharge,
	repartiment.ConsumerAssign, analitica.ConsumerCount, cataleg.ConsumerLowStock, comandes.ConsumerStockRefused, comandes.ConsumerDelivery}

// topicRE: a Kafka topic name (249 characters at most, less the .retry suffix).
var topicRE = regexp.MustCompile(`^[a-zA-Z0-9._-]{1,243}$`)

// validateNames checks the keys and values of Config.DatabaseURLs, Topics and Groups.
func (cfg *Config) validateNames() error {
	for k := range cfg.DatabaseURLs {
		if !slices.Contains(Services, k) {
			return fmt.Errorf("database URL of unknown service %q (known: %s)", k, strings.Join(Services, ", "))
		}
	}
	contract := slices.Sorted(maps.Values(Topics))
	for k, v := range cfg.Topics {
		if !slices.Contains(contract, k) {
			return fmt.Errorf("rename of unknown topic %q (known: %s)", k, strings.Join(contract, ", "))
		}
		if !topicRE.MatchString(v) {
			return fmt.Errorf("topic %s renamed to %q: a topic name is 1 to 243 of a-z A-Z 0-9 . _ -", k, v)
		}
	}
	for k, v := range cfg.Groups {
		if !slices.Contains(ConsumerNames, k) {
			return fmt.Errorf("rename of unknown consumer group %q (known: %s)", k, strings.Join(ConsumerNames, ", "))
		}
		if strings.TrimSpace(v) == "" || len(v) > 255 || strings.ContainsFunc(v, unicode.IsControl) {
			return fmt.Errorf("consumer group %s renamed to %q: want 1 to 255 printable characters", k, v)
		}
	}
	return nil
}

// Defaults of Config.
const (
	MaxConnsDefault       = 5
	AssignIntervalDefault = time.Second
	ShutdownGraceDefault  = 10 * time.Second
	// PurgeIntervalDefault is the period of the housekeeping that deletes
	// expired idempotency keys.
	PurgeIntervalDefault = time.Hour
	// RequestKeyRetentionDefault is how long comandes answers a repeated
	// Idempotency-Key from its stored response.
	RequestKeyRetentionDefault = 24 * time.Hour
	// MaxAttemptsDefault is the services' consumers' attempts in all
	// before a transient failure is dead-lettered: km0's choice, not the
	// contract's 3. With the default Backoff (1 s, doubling) the waits are
	// 1, 2, 4 … 256 s, 511 s in all, so an outage of the database, a lock
	// or the gateway shorter than about 8 minutes heals by itself with no
	// dead letter (CONTRACT.md's 3 attempts: Config.MaxAttempts = 3).
	MaxAttemptsDefault = 10
)

// Config configures Start.
type Config struct {
	// DatabaseURL is an admin URL of the PostgreSQL server; the database
	// km0_<service> of each service without its own DatabaseURLs entry is
	// created on it if absent. Required unless every service run has one.
	DatabaseURL string
	// DatabaseURLs are services' own databases, by service name: such a
	// service uses its URL as is (migrated, never created, on any server;
	// DatabaseSuffix does not apply). Default none.
	DatabaseURLs map[string]string
	// DatabaseSuffix, if set, names the databases km0_<service>_<suffix>
	// (the demo uses a fresh one per run). Default none: km0_<service>.
	DatabaseSuffix string
	// Topics renames domain topics, by their CONTRACT.md name (the four
	// <service>.esdeveniments): relays publish to, and consumers read, the
	// new name, and its .retry and .dlq topics follow it. Every process of a
	// deployment must be given the same renames. Default none: the
	// contract's names. Request/reply queues keep theirs.
	Topics map[string]string
	// Groups renames consumer groups, by consumidor (ConsumerNames). The
	// consumidor recorded with each processed message stays the contract's
	// name. Default none: each group is named after its consumidor.
	Groups map[string]string
	// Brokers are the Kafka bootstrap brokers. Required unless every domain
	// topic travels over RabbitMQ (Events, EventsByTopic) and request/reply
	// too (AMQPURL).
	Brokers []string
	// KafkaOpts are added to the options of every Kafka client the system
	// makes (the relays' producer, the consumers, request/reply): a
	// secured cluster's, from kafka.Security's Opts. Default none.
	KafkaOpts []kgo.Opt
	// TopicSettings are the replication factor, min.insync.replicas and
	// retention of every Kafka topic the system creates (domain, .retry,
	// .dlq, request and reply topics). Existing topics are left as they
	// are, with a warning naming each difference. Default the zero
	// kafka.TopicSettings (the broker's replication factor, 14 days); km0
	// serve and km0 up set it from --kafka-replication-factor.
	TopicSettings kafka.TopicSettings
	// Events is the broker that carries the domain events: EventsKafka
	// (default) or EventsRabbitMQ. Over RabbitMQ each relay publishes to the
	// topic exchange EventsExchange with routing key <topic> and the shard
	// of its agregat_id among EventShards in header particio
	// (amqp.ShardedPublisher), and each consumer reads its own queues, named
	// after its group: EventShards single-active-consumer queues <group>.<i>
	// (per-key order), reached through the headers exchange
	// <group>.particions bound with <topic>, or for analitica, which needs
	// no order, one queue <group> bound with <topic>. Any other program may
	// bind a queue with <topic> and receive every event of the topic. The
	// queues of every consumer are declared at Start by every
	// process, so no event published before a consumer's process first
	// started is lost. RabbitMQ needs AMQPURL, which then carries
	// request/reply too. Every process of a deployment must be given the same
	// choice.
	Events string
	// EventsByTopic overrides Events for some domain topics, by their
	// CONTRACT.md name: e.g. {"comandes.esdeveniments": EventsRabbitMQ} with
	// Events EventsKafka carries the orders over RabbitMQ and the other
	// services' events over Kafka. A consumer whose topics are on both
	// brokers (analitica) runs one consumer on each. Default none.
	EventsByTopic map[string]string
	// EventsExchange is the topic exchange of the events over RabbitMQ.
	// Default EventsExchangeDefault.
	EventsExchange string
	// EventsQueuePrefix is put before the name of every queue of the events
	// over RabbitMQ (work, shard, wait and dead-letter queues), so that
	// several deployments can share one virtual host. Default none.
	EventsQueuePrefix string
	// Services to run; default all (Services).
	Services []string
	// AMQPURL, if set, carries request/reply over RabbitMQ, and the events
	// Events puts there; otherwise request/reply runs over Kafka (Brokers).
	AMQPURL string
	// AMQPTLS configures the connections of an amqps:// AMQPURL (see
	// amqp.Config.TLS). Default nil: the URL's TLS parameters, else the
	// system's roots.
	AMQPTLS *tls.Config
	// Authorize makes comandes ask pagaments to authorise each order before
	// accepting it, and pagaments' charging consumer refuse an order with no
	// approved authorisation stored for its total
	// (pagaments.Config.RequireApproval). Give every process of a deployment
	// the same choice. Default false.
	Authorize bool
	// SigningKey is the key shared by the request/reply requesters and
	// servers of the deployment (comandes and pagaments): requests and
	// replies are signed with it, and unsigned or badly signed ones refused
	// (requestreply.Sign, requestreply.SignReply). At least
	// requestreply.MinKeyBytes (32), or Start fails with ErrConfig. Default
	// $KM0_RR_HMAC_KEY (requestreply.SigningKeyEnv). Never logged.
	SigningKey []byte
	// AcceptUnsignedRequests lets a process that serves authorisations
	// (pagaments) or asks for them (comandes with Authorize) start without a
	// SigningKey: its servers then answer anyone who can publish to their
	// queues, it logs a warning at start and its HealthPath says so. Default
	// false: without a key such a process does not start (ErrConfig).
	AcceptUnsignedRequests bool
	// HTTPAddrs are the listen addresses of the services' HTTP APIs and of
	// the simulated gateway ("passarella") and maps service ("mapes"), by
	// name. Default 127.0.0.1:0 (a free port) for each.
	HTTPAddrs map[string]string
	// AllowedHosts are Host names the HTTP servers answer besides their own
	// listen address (see svc.HostGuard): "name" (any port), "name:port", or
	// "*" for any. A listen address given as a name (HTTPAddrs) is allowed
	// too. Default none: loopback servers answer localhost, 127.0.0.1 and
	// [::1] with their port; others their IP address. km0 up/serve read
	// --http-allowed-hosts, default $KM0_HTTP_ALLOWED_HOSTS.
	AllowedHosts []string
	// GatewayURL, if set, is used instead of starting the simulated gateway;
	// it needs GatewayAPIKey.
	GatewayURL string
	// GatewayAPIKey is the payment gateway's API key, sent with every
	// charge and refund. Default $KM0_PASSARELLA_API_KEY
	// (passarella.APIKeyEnv); unset with the simulated gateway, the gateway
	// makes one for the process; unset with GatewayURL, Start fails with
	// ErrConfig. Never logged.
	GatewayAPIKey string
	// GatewayFaults make the simulated gateway fail or hang.
	GatewayFaults passarella.Faults
	// GatewayTimeout bounds one charge call. Default passarella.TimeoutDefault.
	GatewayTimeout time.Duration
	// MapsFail makes the simulated maps service answer 503.
	MapsFail func(orderID string, attempt int) bool
	// DeliveryTime is how long a courier stays busy. Default repartiment.DeliveryTimeDefault.
	DeliveryTime time.Duration
	// AssignInterval is the period of repartiment's pending-assignment loop.
	// Default AssignIntervalDefault.
	AssignInterval time.Duration
	// PurgeInterval is the period of the housekeeping that deletes the
	// consumers' idempotency keys older than KeyRetention and comandes'
	// stored Idempotency-Key answers older than RequestKeyRetention.
	// Default PurgeIntervalDefault.
	PurgeInterval time.Duration
	// KeyRetention is how long a consumer's key (missatges_processats) is
	// kept: at least the topics' retention, past which no redelivery can
	// arrive. Default inbox.RetentionDefault (14 days, CONTRACT.md).
	KeyRetention time.Duration
	// RequestKeyRetention: see PurgeInterval. Default RequestKeyRetentionDefault.
	RequestKeyRetention time.Duration
	// Backoff is the consumers' first retry delay. Default consumer.BackoffDefault (1 s).
	Backoff time.Duration
	// MaxAttempts is the consumers' attempts in all before a transient
	// failure is dead-lettered. Default MaxAttemptsDefault (10).
	MaxAttempts int
	// MaxConns caps each service's pool. Default MaxConnsDefault.
	MaxConns int32
	// RelayPruneOlderThan, if positive, makes each service's relay delete its
	// published outbox rows marked more than this long ago (relay.Config's
	// PruneOlderThan: a pass every minute, in small batches). Keep it at least
	// as long as the window you may want to replay from the outbox. Default 0:
	// off, the outboxes keep every row; a negative value fails Start.
	RelayPruneOlderThan time.Duration
	// RelayDeletePublished makes each service's relay delete each outbox row
	// as soon as the broker confirmed it (relay.Config's DeletePublished),
	// instead of setting publicat_en. Default false.
	RelayDeletePublished bool
	// RelayMode is how each service's relay finds its rows: RelayPolling (the
	// default, "") claims them from the outbox table, RelayCDC streams the
	// table's inserts from the WAL (package relay/cdc; the server needs
	// wal_level = logical and the REPLICATION privilege, or Start fails
	// naming them). Each service's slot is named after its database
	// (km0_comandes_outbox). Another value fails Start.
	RelayMode string
	// OutboxMode is where the services write their events: outbox.ModeTable
	// (the default, "") or outbox.ModeWAL (logical decoding messages, no
	// outbox rows; docs/cdc.md), which implies RelayCDC: each service's
	// publication and slot (migrate.WALSlot of its database) are created
	// when its database is migrated, before anything may be written, and
	// its relay streams them. With ModeWAL, RelayMode polling,
	// RelayPruneOlderThan and RelayDeletePublished fail Start.
	OutboxMode outbox.Mode
	// RelayFaults are crash points of each service's relay, by service name
	// (internal/faults: the demo's chaos run and tests).
	RelayFaults map[string]faults.Relay
	// ConsumerFaults are crash points of each consumer, by consumidor name
	// (internal/faults: the demo's chaos run and tests).
	ConsumerFaults map[string]faults.Consumer[*consumer.Message]
	// PaymentFaults are crash points of the pagaments handlers, after the
	// gateway call and before the commit (internal/faults: the demo's chaos
	// run and tests). They travel in the Run context of every consumer.
	PaymentFaults faults.Payments
	// RestartDelay is how long the supervisor waits before restarting a dead
	// relay or consumer. Default 200 ms.
	RestartDelay time.Duration
	// Logger; default slog.Default().
	Logger *slog.Logger
}

// ErrConfig is wrapped by every error Start returns for request/reply
// settings that cannot work or are unsafe (see validateRR).
var ErrConfig = errors.New("invalid configuration")

// usesRR reports whether the process serves authorisations or asks for them.
func (cfg *Config) usesRR() bool {
	return slices.Contains(cfg.Services, pagaments.Name) || (cfg.Authorize && slices.Contains(cfg.Services, comandes.Name))
}

// validateRR checks the signing key (cfg.SigningKey already defaulted) and
// reports every problem at once, each wrapping ErrConfig: a key shorter than
// requestreply.MinKeyBytes; no key in a process that uses request/reply,
// unless AcceptUnsignedRequests.
func (cfg *Config) validateRR() error {
	var errs []error
	if err := requestreply.CheckKey(cfg.SigningKey); err != nil {
		errs = append(errs, fmt.Errorf("%w: %w", ErrConfig, err))
	}
	if len(cfg.SigningKey) == 0 && cfg.usesRR() && !cfg.AcceptUnsignedRequests {
		errs = append(errs, fmt.Errorf("%w: pagaments' authorisations need a signing key: set %s (at least %d bytes, the same for comandes and pagaments: openssl rand -hex 32), or accept unsigned requests explicitly (--accept-unsigned-requests)",
			ErrConfig, requestreply.SigningKeyEnv, requestreply.MinKeyBytes))
	}
	if cfg.GatewayURL != "" && cfg.GatewayAPIKey == "" && slices.Contains(cfg.Services, pagaments.Name) {
		errs = append(errs, fmt.Errorf("%w: an external payment gateway (--gateway-url) needs its API key in $%s", ErrConfig, passarella.APIKeyEnv))
	}
	return errors.Join(errs...)
}

// Relay modes of Config.RelayMode.
const (
	RelayPolling = "polling"
	RelayCDC     = "cdc"
)
