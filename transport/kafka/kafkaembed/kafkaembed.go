// Package kafkaembed runs an in-process Kafka broker (kfake) that speaks the
// real protocol: for tests, examples, the demo and `km0 kafka`.
//
// It lives apart from package kafka so that a program using kafka.NewSource
// or kafka.NewPublisher does not link kfake (23 k lines, dozens of init
// functions): only the programs that start a broker import this package.
package kafkaembed

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/km0/km0/transport/kafka"
)

// Config configures an in-process broker.
type Config struct {
	// Addr is host:port to listen on. Default "127.0.0.1:0" (a free port).
	Addr string
	// AdvertiseHost is the host the broker gives clients in its metadata
	// (with the port it listens on). Default Addr's host: set it when
	// listening on 0.0.0.0 for clients on other hosts or in containers.
	AdvertiseHost string
	// DataDir, if set, persists topics, offsets and groups there: the data
	// survives a restart of the broker (kfake.DataDir).
	DataDir string
	// Partitions is the default partition count of created topics. Default 6.
	Partitions int
	// Topics are created at start with Partitions partitions.
	Topics []string
	// MaxMessageBytes, if positive, sets the broker's message.max.bytes.
	MaxMessageBytes int
	// GroupMinSessionTimeout, if positive, is the least session timeout a
	// group member may ask for (group.min.session.timeout.ms). Default 6 s,
	// as on Kafka: a lower SessionTimeout fails to join. Tests lower it to
	// expire dead members quickly.
	GroupMinSessionTimeout time.Duration
	// Extra kfake options.
	Extra []kfake.Opt
}

// Broker is an in-process Kafka broker (kfake) speaking the real protocol.
// External clients (kcat, librdkafka, Python) can use it at Addr().
//
// What kfake lacks compared with a real cluster is listed in docs/operations.md
// ("Embedded Kafka and what kfake lacks"): no replication, so acks=all means one copy.
type Broker struct {
	c *kfake.Cluster
}

// Start starts a broker.
func Start(cfg Config) (*Broker, error) {
	if cfg.Addr == "" {
		cfg.Addr = "127.0.0.1:0"
	}
	if cfg.Partitions <= 0 {
		cfg.Partitions = kafka.PartitionsDefault
	}
	host, portStr, err := net.SplitHostPort(cfg.Addr)
	if err != nil {
		return nil, fmt.Errorf("kafkaembed: addr %q: %w", cfg.Addr, err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		return nil, fmt.Errorf("kafkaembed: port %q: %w", portStr, err)
	}
	opts := []kfake.Opt{
		kfake.NumBrokers(1),
		kfake.Ports(port),
		kfake.ListenFn(func(network, _ string) (net.Listener, error) {
			ln, err := net.Listen(network, net.JoinHostPort(host, strconv.Itoa(port)))
			if err != nil || cfg.AdvertiseHost == "" {
				return ln, err
			}
			return advertised{ln, cfg.AdvertiseHost}, nil
		}),
		kfake.DefaultNumPartitions(cfg.Partitions),
		kfake.AllowAutoTopicCreation(),
	}
	if len(cfg.Topics) > 0 {
		opts = append(opts, kfake.SeedTopics(int32(cfg.Partitions), cfg.Topics...))
	}
	if cfg.DataDir != "" {
		opts = append(opts, kfake.DataDir(cfg.DataDir))
	}
	if cfg.GroupMinSessionTimeout > 0 {
		opts = append(opts, kfake.GroupMinSessionTimeout(cfg.GroupMinSessionTimeout))
	}
	if cfg.MaxMessageBytes > 0 {
		opts = append(opts, kfake.BrokerConfigs(map[string]string{"message.max.bytes": strconv.Itoa(cfg.MaxMessageBytes)}))
	}
	opts = append(opts, cfg.Extra...)
	c, err := kfake.NewCluster(opts...)
	if err != nil {
		return nil, fmt.Errorf("kafkaembed: start: %w", err)
	}
	if len(cfg.Topics) > 0 && len(cfg.Extra) == 0 {
		// kfake seeds topics with its own 7-day retention: give them the
		// contract's, as EnsureTopicSpecs would, so that no process warns
		// about them. With Extra (SASL, ACLs) the seeded topics keep kfake's.
		if err := seedRetention(c.ListenAddrs(), cfg.Topics); err != nil {
			c.Close()
			return nil, fmt.Errorf("kafkaembed: retention of %v: %w", cfg.Topics, err)
		}
	}
	return &Broker{c: c}, nil
}

// seedRetention sets retention.ms = kafka.RetentionDefault on topics.
func seedRetention(addrs, topics []string) error {
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...))
	if err != nil {
		return err
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	v := strconv.FormatInt(kafka.RetentionDefault.Milliseconds(), 10)
	rs, err := kadm.NewClient(cl).AlterTopicConfigs(ctx, []kadm.AlterConfig{{Op: kadm.SetConfig, Name: "retention.ms", Value: &v}}, topics...)
	if err != nil {
		return err
	}
	for _, r := range rs {
		if r.Err != nil {
			return fmt.Errorf("%s: %w", r.Name, r.Err)
		}
	}
	return nil
}

// Addrs returns the broker addresses.
func (e *Broker) Addrs() []string { return e.c.ListenAddrs() }

// Cluster returns the kfake cluster (for fault injection in tests).
func (e *Broker) Cluster() *kfake.Cluster { return e.c }

// Unreachable makes the broker refuse every request (each connection is
// closed as it asks) until up is called: Kafka down, its data kept. The
// demo's --kafka-down and the outage tests use it.
func (e *Broker) Unreachable() (up func()) {
	var down atomic.Bool
	down.Store(true)
	c := e.c
	c.Control(func(kmsg.Request) (kmsg.Response, error, bool) {
		if !down.Load() {
			c.DropControl()
			return nil, nil, false
		}
		c.KeepControl()
		return nil, errors.New("kafka down"), true
	})
	return func() { down.Store(false) }
}

// Close stops the broker (flushing DataDir state).
func (e *Broker) Close() { e.c.Close() }

// advertised is a listener whose Addr names the host clients should dial:
// kfake puts its listener's address in the metadata it returns.
type advertised struct {
	net.Listener
	host string
}

func (l advertised) Addr() net.Addr {
	_, port, _ := net.SplitHostPort(l.Listener.Addr().String())
	return hostPort(net.JoinHostPort(l.host, port))
}

type hostPort string

func (h hostPort) Network() string { return "tcp" }
func (h hostPort) String() string  { return string(h) }
