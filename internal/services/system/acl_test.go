package system_test

import (
	"context"
	"crypto/rand"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/km0/km0/internal/kafkaacl"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/kafkarr"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// aclCluster is a kfake with SASL SCRAM-SHA-512 and ACLs enforced: a
// superuser "admin" that applied system.RequiredACLs, and one user per
// service, "km0-<service>", with only those ACLs.
type aclCluster struct {
	b     *kafkaembed.Broker
	pass  map[string]string // by user
	admin *kgo.Client
}

func newACLCluster(t *testing.T) *aclCluster {
	t.Helper()
	c := &aclCluster{pass: map[string]string{"admin": rand.Text()}}
	extra := []kfake.Opt{kfake.EnableSASL(), kfake.EnableACLs(), kfake.Superuser(kafka.SASLScramSHA512, "admin", c.pass["admin"])}
	for _, s := range append(append([]string{}, system.Services...), system.DLQPrincipalName) {
		u := kafkaacl.PrincipalPrefixDefault + s
		c.pass[u] = rand.Text()
		extra = append(extra, kfake.User(kafka.SASLScramSHA512, u, c.pass[u]))
	}
	c.b = kafkatest.NewWith(t, kafkaembed.Config{Extra: extra})
	c.admin = kafkatest.ClientFor(t, c.b.Addrs(), c.opts(t, "admin")...)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := kafkaacl.Apply(ctx, kadm.NewClient(c.admin), system.RequiredACLs(system.ACLOptions{})); err != nil {
		t.Fatal(err)
	}
	return c
}

// opts are the client options of user.
func (c *aclCluster) opts(t *testing.T, user string) []kgo.Opt {
	t.Helper()
	opts, err := kafka.Security{SASLMechanism: kafka.SASLScramSHA512, SASLUsername: user, SASLPassword: c.pass[user]}.Opts()
	if err != nil {
		t.Fatal(err)
	}
	return opts
}

// With only the ACLs km0 acl generates, pagaments answers comandes'
// authorisation requests over Kafka, and pagaments' consumer group reads
// comandes' events and writes its .retry and .dlq topics. inventari's
// principal can neither read the payment requests nor join pagaments'
// groups, nor write comandes' topic.
func TestRequiredACLsAreEnoughAndNoMore(t *testing.T) {
	t.Parallel()
	c := newACLCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	brokers := c.b.Addrs()

	// Request/reply: pagaments serves, comandes asks.
	srv, err := kafkarr.NewServer(ctx, kafkarr.ServerConfig{Brokers: brokers, Topic: "pagaments.autoritzacions", KgoOpts: c.opts(t, "km0-pagaments"),
		Handler: func(_ context.Context, req *requestreply.Request) ([]byte, error) {
			return append([]byte("ok:"), req.Body...), nil
		}})
	if err != nil {
		t.Fatalf("pagaments' server with its ACLs: %v", err)
	}
	srvCtx, stopSrv := context.WithCancel(ctx)
	srvDone := make(chan error, 1)
	go func() { srvDone <- srv.Run(srvCtx) }()
	defer func() { stopSrv(); <-srvDone }()
	cli, err := kafkarr.NewClient(ctx, kafkarr.ClientConfig{Brokers: brokers, KgoOpts: c.opts(t, "km0-comandes"), Timeout: 20 * time.Second})
	if err != nil {
		t.Fatalf("comandes' client with its ACLs: %v", err)
	}
	out, err := cli.Request(ctx, "pagaments.autoritzacions", "autoritzacio-C-1", []byte(`{"comanda_id":"C-1","import_centims":1200}`))
	if err != nil || string(out) != `ok:{"comanda_id":"C-1","import_centims":1200}` {
		t.Fatalf("authorisation over Kafka with the services' ACLs: %q, %v", out, err)
	}
	if err := cli.Close(); err != nil {
		t.Fatalf("comandes deletes its reply topic: %v", err)
	}

	// A consumer: comandes' relay writes its topic; pagaments' group reads it,
	// creates and writes its .retry and .dlq topics.
	comandes := kafkatest.ClientFor(t, brokers, c.opts(t, "km0-comandes")...)
	if err := kafka.EnsureTopics(ctx, comandes, 6, "comandes.esdeveniments"); err != nil {
		t.Fatal(err)
	}
	if err := comandes.ProduceSync(ctx, &kgo.Record{Topic: "comandes.esdeveniments", Key: []byte("C-1"), Value: []byte("{}")}).FirstErr(); err != nil {
		t.Fatalf("comandes writes its events: %v", err)
	}
	pag := kafkatest.ClientFor(t, brokers, append(c.opts(t, "km0-pagaments"), kgo.ConsumerGroup("pagaments.cobrament"),
		kgo.ConsumeTopics("comandes.esdeveniments", "comandes.esdeveniments.retry"), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.DisableAutoCommit())...)
	if err := kafka.EnsureTopics(ctx, pag, 6, "comandes.esdeveniments.retry", "comandes.esdeveniments.dlq"); err != nil {
		t.Fatalf("pagaments creates its .retry and .dlq: %v", err)
	}
	var got int
	for got < 1 && ctx.Err() == nil {
		fs := pag.PollFetches(ctx)
		if err := fs.Err0(); err != nil {
			t.Fatalf("pagaments reads comandes' events: %v", err)
		}
		got += fs.NumRecords()
	}
	if err := pag.CommitUncommittedOffsets(ctx); err != nil {
		t.Fatalf("pagaments commits in its group: %v", err)
	}
	if err := pag.ProduceSync(ctx, &kgo.Record{Topic: "comandes.esdeveniments.dlq", Value: []byte("{}")}).FirstErr(); err != nil {
		t.Fatalf("pagaments dead-letters: %v", err)
	}
	if got != 1 {
		t.Fatalf("pagaments read %d records, want 1", got)
	}

	// inventari's principal: no payment request, no pagaments group, no
	// write to pagaments' topic.
	inv := c.opts(t, "km0-inventari")
	spy := kafkatest.ClientFor(t, brokers, append(inv, kgo.ConsumeTopics("pagaments.autoritzacions"), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))...)
	wantDenied(ctx, t, "inventari reads pagaments.autoritzacions", func(ctx context.Context) error {
		for ctx.Err() == nil {
			if err := spy.PollFetches(ctx).Err0(); err != nil {
				return err
			}
		}
		return ctx.Err()
	}, kerr.TopicAuthorizationFailed)
	joiner := kafkatest.ClientFor(t, brokers, inv...)
	for _, group := range []string{"pagaments.autoritzacions.servidor", "pagaments.cobrament"} {
		wantDenied(ctx, t, "inventari joins "+group, func(ctx context.Context) error {
			req := kmsg.NewPtrJoinGroupRequest()
			req.Group, req.SessionTimeoutMillis, req.RebalanceTimeoutMillis, req.ProtocolType = group, 10_000, 10_000, "consumer"
			p := kmsg.NewJoinGroupRequestProtocol()
			p.Name = "cooperative-sticky"
			req.Protocols = append(req.Protocols, p)
			resp, err := req.RequestWith(ctx, joiner)
			if err != nil {
				return err
			}
			return kerr.ErrorForCode(resp.ErrorCode)
		}, kerr.GroupAuthorizationFailed)
	}
	wantDenied(ctx, t, "inventari writes pagaments.esdeveniments", func(ctx context.Context) error {
		return joiner.ProduceSync(ctx, &kgo.Record{Topic: "pagaments.esdeveniments", Value: []byte("{}")}).FirstErr()
	}, kerr.TopicAuthorizationFailed)
}

func wantDenied(ctx context.Context, t *testing.T, what string, f func(context.Context) error, want *kerr.Error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	if err := f(ctx); !errors.Is(err, want) {
		t.Errorf("%s: %v, want %s", what, err, want.Message)
	}
}

// The generated kafka-acls commands: one per principal and resource, the
// payment requests readable by pagaments only, reply topics by prefix.
func TestKafkaACLCommands(t *testing.T) {
	t.Parallel()
	acls := system.RequiredACLs(system.ACLOptions{})
	cmds := kafkaacl.Commands(acls, "b:9092", "admin.properties")
	all := strings.Join(cmds, "\n")
	for _, want := range []string{
		"kafka-acls --bootstrap-server b:9092 --command-config admin.properties --add --allow-principal User:km0-pagaments --allow-host '*' --operation Create --operation DescribeConfigs --operation Read --topic pagaments.autoritzacions --resource-pattern-type literal",
		"--allow-principal User:km0-pagaments --allow-host '*' --operation Read --group pagaments.autoritzacions.servidor --resource-pattern-type literal",
		"--allow-principal User:km0-comandes --allow-host '*' --operation Create --operation Delete --operation DescribeConfigs --operation Read --topic respostes. --resource-pattern-type prefixed",
		"--allow-principal User:km0-dlq --allow-host '*' --operation Read --group km0.dlq.index --resource-pattern-type literal",
	} {
		if !strings.Contains(all, want) {
			t.Errorf("no command with %q in:\n%s", want, all)
		}
	}
	for _, a := range acls {
		if a.ResourceName == "pagaments.autoritzacions" && a.Operation == kafkaacl.OpRead && a.Principal != "User:km0-pagaments" {
			t.Errorf("%s may read the payment requests", a.Principal)
		}
	}
}
