package contract

import (
	"context"
	"encoding/json"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Names derived from a domain topic or a work queue.
const (
	// RetrySuffix makes <topic>.retry, the Kafka topic of retry copies.
	RetrySuffix = ".retry"
	// DLQSuffix makes <topic>.dlq on Kafka and <queue>.dlq on RabbitMQ.
	DLQSuffix = ".dlq"
	// waitInfix makes the RabbitMQ wait queues <queue>.espera.<milliseconds>.
	waitInfix = ".espera."
	// partitionsSuffix makes <queue>.particions, the RabbitMQ headers
	// exchange of an ordered consumer: bound to the events' exchange with
	// the topic names, it routes each message to the shard queue <queue>.<i>
	// whose binding matches its HeaderPartition.
	partitionsSuffix = ".particions"
)

// RetryTopic returns <topic>.retry.
func RetryTopic(topic string) string { return topic + RetrySuffix }

// DLQName returns <name>.dlq: the dead-letter topic of a Kafka topic, or the
// dead-letter queue of a RabbitMQ work queue.
func DLQName(name string) string { return name + DLQSuffix }

// PartitionsExchangeName returns <queue>.particions.
func PartitionsExchangeName(queue string) string { return queue + partitionsSuffix }

// WaitQueueName returns <queue>.espera.<ms>, the RabbitMQ queue that holds a
// message for delay and then dead-letters it back to queue.
func WaitQueueName(queue string, delay time.Duration) string {
	return queue + waitInfix + strconv.FormatInt(delay.Milliseconds(), 10)
}

// Prefixes of a dead letter's motiu: a permanent failure, or a transient one
// whose attempts are spent.
const (
	ReasonPermanent = "permanent: "
	ReasonExhausted = "transitori esgotat: "
	// ReasonBlockedBy starts the motiu of a message dead-lettered because
	// its key's head is dead (consumer.PerKey, DeadLetterBlocked), followed
	// by the head's id_esdeveniment (keyorder.BlockedReason).
	ReasonBlockedBy = ReasonPermanent + "bloquejat_per_clau: behind "
)

// OtherClass is ReasonClass's class of a motiu with neither prefix.
const OtherClass = "altres"

// ReasonClass maps a motiu to a label value of bounded cardinality, the one
// grouping of dead letters km0 uses (consumer metrics, package dlq, the
// demo): the prefix ("permanent" or "transitori esgotat"), followed by ": "
// and the first segment of the reason (up to the next ':') when it is a short
// word-like class such as "esquema", "envelope" or "estoc_insuficient"
// (letters, spaces, '_', '-', '.', at most 32 bytes), lowercased. Anything
// else (ids, numbers, addresses, long text) is dropped. A motiu without a
// known prefix maps to OtherClass.
//
//	ReasonClass("permanent: esquema: adreca_lliurament missing") == "permanent: esquema"
//	ReasonClass("transitori esgotat: timeout after 5s")          == "transitori esgotat"
func ReasonClass(motiu string) string {
	var prefix, rest string
	switch {
	case strings.HasPrefix(motiu, strings.TrimSpace(ReasonPermanent)):
		prefix, rest = "permanent", motiu[len("permanent:"):]
	case strings.HasPrefix(motiu, strings.TrimSpace(ReasonExhausted)):
		prefix, rest = "transitori esgotat", motiu[len("transitori esgotat:"):]
	default:
		return OtherClass
	}
	seg, _, _ := strings.Cut(rest, ":")
	seg = strings.TrimSpace(seg)
	if seg == "" || len(seg) > 32 {
		return prefix
	}
	for _, r := range seg {
		if !unicode.IsLetter(r) && r != ' ' && r != '_' && r != '-' && r != '.' {
			return prefix
		}
	}
	return prefix + ": " + strings.ToLower(seg)
}

// MaxKeyBytes bounds an idempotency key (an id_esdeveniment or a correlacio).
const MaxKeyBytes = 256

// IdempotencyKey is what an idempotent consumer records for an event whose
// id_esdeveniment is id and whose envelope member "correlacio" is
// correlacio (nil when absent): the correlacio when it is a non-empty JSON
// string of at most MaxKeyBytes without a NUL byte (the shared id of a
// dual-published pair, so a consumer accepting both copies handles the pair
// once), else id.
func IdempotencyKey(id string, correlacio json.RawMessage) string {
	if len(correlacio) > 0 {
		var s string
		if json.Unmarshal(correlacio, &s) == nil && s != "" && len(s) <= MaxKeyBytes && strings.IndexByte(s, 0) < 0 {
			return s
		}
	}
	return id
}

// DBTX is what a write that may join the caller's transaction needs: a
// pgx.Tx, a *pgxpool.Pool or a *pgx.Conn.
type DBTX interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Beginner starts transactions: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx
// (which then nests through a savepoint).
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}
