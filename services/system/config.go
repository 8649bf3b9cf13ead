// Package system wires the six km0 services into running processes: each
// service's database (km0_<service>, created and migrated if absent), its
// outbox relay, its consumers with their retry and DLQ topics, its
// request/reply servers and its HTTP API. Start runs all of them in one
// process (`km0 up`) or a chosen subset (`km0 serve NAME`). Relays and
// consumers run under a supervisor that restarts them when they die, which is
// how the demo's injected crashes (relay.ErrCrashed, consumer.ErrCrashed)
// heal.
package system

import (
	"log/slog"
	"time"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/services/analitica"
	"github.com/km0/km0/services/cataleg"
	"github.com/km0/km0/services/comandes"
	"github.com/km0/km0/services/inventari"
	"github.com/km0/km0/services/pagaments"
	"github.com/km0/km0/services/pagaments/passarella"
	"github.com/km0/km0/services/repartiment"
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
func DomainTopics() []string {
	var out []string
	for _, s := range Services {
		if t, ok := Topics[s]; ok {
			out = append(out, t, t+consumer.RetrySuffix, t+consumer.DLQSuffix)
		}
	}
	return out
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
)

// Config configures Start.
type Config struct {
	// DatabaseURL is an admin URL of the PostgreSQL server; each service's
	// database is created on it. Required.
	DatabaseURL string
	// DatabaseSuffix, if set, names the databases km0_<service>_<suffix>
	// (the demo uses a fresh one per run). Default none: km0_<service>.
	DatabaseSuffix string
	// Brokers are the Kafka bootstrap brokers. Required.
	Brokers []string
	// Services to run; default all (Services).
	Services []string
	// AMQPURL, if set, carries request/reply over RabbitMQ; otherwise it runs
	// over Kafka (Brokers).
	AMQPURL string
	// Authorize makes comandes ask pagaments to authorise each order before
	// accepting it. Default false.
	Authorize bool
	// HTTPAddrs are the listen addresses of the services' HTTP APIs and of
	// the simulated gateway ("passarella") and maps service ("mapes"), by
	// name. Default 127.0.0.1:0 (a free port) for each.
	HTTPAddrs map[string]string
	// GatewayURL, if set, is used instead of starting the simulated gateway.
	GatewayURL string
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
	// MaxConns caps each service's pool. Default MaxConnsDefault.
	MaxConns int32
	// RelayHooks are fault-injection hooks of each service's relay, by service name.
	RelayHooks map[string]relay.Hooks
	// ConsumerHooks are fault-injection hooks of each consumer, by consumidor name.
	ConsumerHooks map[string]consumer.Hooks
	// PaymentHooks are the charging handler's fault-injection hooks.
	PaymentHooks pagaments.Hooks
	// RestartDelay is how long the supervisor waits before restarting a dead
	// relay or consumer. Default 200 ms.
	RestartDelay time.Duration
	// Logger; default slog.Default().
	Logger *slog.Logger
}
