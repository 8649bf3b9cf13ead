package system_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/internal/svctest"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/pagaments/passarella"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/kafkarr"
	"github.com/km0/km0/transport"
	"github.com/km0/km0/transport/kafka"
)

// The trust boundary of pagaments.autoritzacions, end to end (Kafka):
// with a signing key, a request published without the key is refused and
// decides nothing, one signed with another key too (and its requester drops
// the server's reply, signed with a key it does not share), so the real
// order is authorised; and a request that
// does carry the key (an insider) with another amount makes the real order a
// 409 that is not stored under its Idempotency-Key, never the other request's
// decision.
func TestForgedAuthorisationsDecideNoOrder(t *testing.T) {
	t.Parallel()
	key := string(testKey)
	sys, b := startWith(t, []string{comandes.Name, pagaments.Name}, func(c *system.Config) { c.Authorize = true })
	t.Cleanup(sys.Close)
	base := sys.Addrs()[comandes.Name]
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	forge := func(signingKey []byte, order string, cents string) error {
		cl, err := kafkarr.NewClient(ctx, kafkarr.ClientConfig{Brokers: b.Addrs(), SigningKey: signingKey})
		if err != nil {
			t.Fatal(err)
		}
		defer cl.Close()
		rctx, rcancel := context.WithTimeout(ctx, 5*time.Second)
		defer rcancel()
		_, err = cl.Request(rctx, pagaments.AuthQueue, "autoritzacio-"+order, []byte(`{"comanda_id":"`+order+`","import_centims":`+cents+`}`))
		return err
	}
	order := func(id string) string {
		return `{"id":"` + id + `","client":"anna","mercat":"girona","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":100}]}`
	}

	// Without the key: refused, nothing stored, the real order is approved.
	var re *requestreply.RemoteError
	if err := forge(nil, "P-2026-000951", "999999999"); !errors.As(err, &re) || re.Message != requestreply.ErrUnauthenticated.Error() {
		t.Fatalf("unsigned forged request: %v, want ErrUnauthenticated", err)
	}
	if err := forge([]byte(strings.Repeat("x", 32)), "P-2026-000951", "999999999"); !errors.Is(err, requestreply.ErrTimeout) {
		t.Fatalf("forged request signed with another key: %v, want a timeout", err)
	}
	if r := postOrder(t, base, "k-951", order("P-2026-000951")); r.status != http.StatusCreated {
		t.Fatalf("the real order after unsigned forgeries: %d %s, want 201", r.status, r.body)
	}

	// With the key and another amount first: a conflict, a 409 on every try,
	// nothing stored under the key.
	if err := forge([]byte(key), "P-2026-000952", "1"); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		r := postOrder(t, base, "k-952", order("P-2026-000952"))
		if r.status != http.StatusConflict || !strings.Contains(r.body, "another authorisation") {
			t.Fatalf("the real order after a pre-approval of 1 cent: %d %s, want 409", r.status, r.body)
		}
	}
	if n := svctest.Count(t, sys.Pool(comandes.Name), "SELECT count(*) FROM peticions_idempotents WHERE clau = 'k-952'"); n != 0 {
		t.Fatalf("the conflict was stored under the order's Idempotency-Key")
	}
	if n := svctest.Count(t, sys.Pool(comandes.Name), "SELECT count(*) FROM comandes"); n != 1 {
		t.Fatalf("%d orders, want 1 (P-2026-000951)", n)
	}
}

// testKey is the signing key of the systems the tests start.
var testKey = []byte("clau-de-prova-compartida-32-bytes")

// A rogue reader of pagaments.autoritzacions (Kafka: it reads the topic in a
// group of its own, so it sees respondre_a and correlacio) answers every
// authorisation request approved at once, unsigned and signed with another
// key. comandes drops both replies (counted in
// requestreply.MetricRepliesDropped) and takes pagaments' own refusal, which
// comes after them: an order of 9,000 EUR (the limit is 2,000) is answered
// 402, and nothing is created or charged.
func TestRogueApprovalCreatesAndChargesNothing(t *testing.T) {
	t.Parallel()
	sys, b := startWith(t, []string{comandes.Name, pagaments.Name}, func(c *system.Config) { c.Authorize = true })
	t.Cleanup(sys.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	droppedBefore := metricSum(t, requestreply.MetricRepliesDropped)
	var answered atomic.Int64
	for _, key := range [][]byte{nil, []byte(strings.Repeat("x", 32))} {
		assigned := make(chan struct{})
		var once sync.Once
		rogue := kafkatest.Client(t, b, kgo.ConsumeTopics(pagaments.AuthQueue), kgo.ConsumerGroup(requestreply.NewIDs().Prefix()),
			kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(50*time.Millisecond),
			kgo.OnPartitionsAssigned(func(context.Context, *kgo.Client, map[string][]int32) { once.Do(func() { close(assigned) }) }))
		go func() {
			for ctx.Err() == nil {
				rogue.PollFetches(ctx).EachRecord(func(r *kgo.Record) {
					h := map[string]string{}
					for _, kv := range r.Headers {
						h[kv.Key] = string(kv.Value)
					}
					body := []byte(`{"comanda_id":"P-2026-000990","aprovada":true}`)
					rep := &kgo.Record{Topic: h[kafkarr.HeaderReplyTo], Value: body, Headers: []kgo.RecordHeader{
						{Key: contract.HeaderCorrelator, Value: []byte(h[contract.HeaderCorrelator])}, {Key: requestreply.HeaderResult, Value: []byte(requestreply.ResultOK)}}}
					if key != nil {
						rep.Headers = append(rep.Headers, kgo.RecordHeader{Key: requestreply.HeaderSignature, Value: []byte(requestreply.SignReply(key,
							h[kafkarr.HeaderRequestID], h[contract.HeaderCorrelator], h[kafkarr.HeaderReplyTo], requestreply.ResultOK, body))})
					}
					if rogue.ProduceSync(ctx, rep).FirstErr() == nil {
						answered.Add(1)
					}
				})
			}
		}()
		select { // the rogue reads the topic before the order is posted
		case <-assigned:
		case <-ctx.Done():
			t.Fatal("the rogue was never assigned the request topic's partitions")
		}
	}
	// pagaments answers only after both rogues: its insert of the order's
	// decision waits for this transaction, which holds the same comanda_id.
	hold, err := sys.Pool(pagaments.Name).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer hold.Rollback(context.Background()) //nolint:errcheck // a no-op once rolled back below; before Close, which waits for it
	if _, err := hold.Exec(ctx, `INSERT INTO autoritzacions (comanda_id, import_centims, aprovada) VALUES ('P-2026-000990', 900000, false)`); err != nil {
		t.Fatal(err)
	}
	body := `{"id":"P-2026-000990","client":"anna","mercat":"girona","linies":[{"producte":"formatge-curat","quantitat":1,"preu_centims":900000}]}`
	posted := make(chan reply, 1)
	go func() { posted <- postOrder(t, sys.Addrs()[comandes.Name], "k-990", body) }()
	testkit.Eventuallyf(t, 20*time.Second, requestreply.MetricRepliesDropped+" to grow by 2 (one reply of each rogue)", func() (bool, string) {
		select {
		case r := <-posted:
			t.Fatalf("the order was answered %d %s while pagaments could not answer yet: a rogue's reply was taken", r.status, r.body)
		default:
		}
		grown := metricSum(t, requestreply.MetricRepliesDropped) - droppedBefore
		return grown >= 2, fmt.Sprintf("grew by %v", grown)
	})
	if err := hold.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if r := <-posted; r.status != http.StatusPaymentRequired {
		t.Fatalf("an order of 9,000 EUR while rogues answer approved: %d %s, want 402", r.status, r.body)
	}
	if got := answered.Load(); got != 2 {
		t.Fatalf("the rogues wrote %d replies, want 2", got)
	}
	charges, err := sys.Gateway.Charges(ctx)
	if err != nil {
		t.Fatal(err)
	}
	orders := svctest.Count(t, sys.Pool(comandes.Name), "SELECT count(*) FROM comandes")
	payments := svctest.Count(t, sys.Pool(pagaments.Name), "SELECT count(*) FROM pagaments")
	if orders != 0 || len(charges) != 0 || payments != 0 {
		t.Fatalf("%d orders, %d gateway charges, %d payments: want 0, 0, 0", orders, len(charges), payments)
	}
}

// metricSum is the sum of the samples of the counter name in Prometheus'
// default registry (0 if absent).
func metricSum(t *testing.T, name string) float64 {
	t.Helper()
	fams, err := prometheus.DefaultGatherer.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, f := range fams {
		if f.GetName() == name {
			for _, m := range f.GetMetric() {
				sum += m.GetCounter().GetValue()
			}
		}
	}
	return sum
}

// Request/reply settings are checked before anything starts, every problem
// at once under ErrConfig: a 16-byte key is refused (its length named, never
// its bytes); a process that serves authorisations (pagaments) or asks for
// them (comandes with Authorize) does not start without a key unless it
// accepts unsigned requests explicitly.
func TestStartRefusesAShortKeyAndNoKeyForAuthorisations(t *testing.T) {
	t.Setenv(requestreply.SigningKeyEnv, "")
	t.Setenv(passarella.APIKeyEnv, "")
	short := strings.Repeat("k", 16)
	for _, c := range []struct {
		cfg  system.Config
		want []string
	}{
		{system.Config{SigningKey: []byte(short), Services: []string{comandes.Name}}, []string{"16 bytes"}},
		{system.Config{Services: []string{pagaments.Name}}, []string{requestreply.SigningKeyEnv, "--accept-unsigned-requests"}},
		{system.Config{Services: []string{comandes.Name}, Authorize: true}, []string{requestreply.SigningKeyEnv}},
		{system.Config{SigningKey: []byte(strings.Repeat("k", 32)), Services: []string{pagaments.Name}, GatewayURL: "https://gateway.example"}, []string{passarella.APIKeyEnv}},
	} {
		c.cfg.Brokers, c.cfg.DatabaseURL = []string{"127.0.0.1:1"}, "postgres://127.0.0.1:1/x"
		_, err := system.Start(context.Background(), c.cfg)
		if !errors.Is(err, system.ErrConfig) || strings.Contains(fmt.Sprint(err), short) {
			t.Fatalf("Start(%v, key of %d bytes, authorize %v): %v, want ErrConfig without the key", c.cfg.Services, len(c.cfg.SigningKey), c.cfg.Authorize, err)
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("Start(%v): %v, want it to name %q", c.cfg.Services, err, w)
			}
		}
	}
	t.Setenv(requestreply.SigningKeyEnv, short)
	if _, err := system.Start(context.Background(), system.Config{Brokers: []string{"127.0.0.1:1"}, DatabaseURL: "postgres://127.0.0.1:1/x",
		Services: []string{pagaments.Name}}); !errors.Is(err, requestreply.ErrKeyTooShort) || !errors.Is(err, system.ErrConfig) {
		t.Fatalf("Start with a 16-byte %s: %v, want ErrConfig and ErrKeyTooShort", requestreply.SigningKeyEnv, err)
	}
}

// Started with AcceptUnsignedRequests and no key, pagaments answers
// unsigned requests, and its /salut says it does.
func TestAcceptUnsignedRequestsShowsInHealth(t *testing.T) {
	t.Setenv(requestreply.SigningKeyEnv, "")
	sys, b := startOneWith(t, pagaments.Name, func(c *system.Config) { c.SigningKey, c.AcceptUnsignedRequests = nil, true })
	t.Cleanup(sys.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cl, err := kafkarr.NewClient(ctx, kafkarr.ClientConfig{Brokers: b.Addrs()})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if _, err := cl.Request(ctx, pagaments.AuthQueue, "autoritzacio-P-1", []byte(`{"comanda_id":"P-1","import_centims":100}`)); err != nil {
		t.Fatalf("an unsigned request: %v", err)
	}
	resp, err := http.Get(sys.Addrs()[system.GatewayName] + system.HealthPath) // the HTTP server of a pagaments process
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var h system.Health
	if err := json.NewDecoder(resp.Body).Decode(&h); err != nil || !h.UnsignedRequests {
		t.Fatalf("/salut: %+v, %v: want peticions_sense_signar true", h, err)
	}
}

// With Authorize, a comanda.creada that did not come through comandes' ask
// (published straight to the topic by anyone who can write it, for an order
// pagaments never approved) is dead-lettered by the charging consumer with
// motiu "permanent: sense_autoritzacio: ...", and the gateway is never called.
func TestChargingConsumerDeadLettersAnOrderWithoutApproval(t *testing.T) {
	sys, b := startWith(t, []string{pagaments.Name}, func(c *system.Config) { c.Authorize = true })
	t.Cleanup(sys.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	m := svctest.Message(t, comandes.Topic, comandes.TypeCreated, 2, map[string]any{"id": "P-2026-000991", "client": "anna", "mercat": "girona",
		"linies": []map[string]any{{"producte": "formatge-curat", "quantitat": 1, "preu_centims": 900000}}})
	m.Message.Key = []byte("P-2026-000991")
	if err := kafka.NewPublisher(kafkatest.Client(t, b)).Publish(ctx, []*transport.Message{m.Message}); err != nil {
		t.Fatal(err)
	}
	dead := kafkatest.ReadAll(t, b, contract.DLQName(comandes.Topic), 1, 30*time.Second)
	if len(dead) != 1 {
		t.Fatalf("%d dead letters on %s, want 1", len(dead), contract.DLQName(comandes.Topic))
	}
	var motiu string
	for _, h := range dead[0].Headers {
		if h.Key == "motiu" {
			motiu = string(h.Value)
		}
	}
	if !strings.HasPrefix(motiu, "permanent: sense_autoritzacio: P-2026-000991") {
		t.Fatalf("motiu %q, want permanent: sense_autoritzacio: P-2026-000991 ...", motiu)
	}
	charges, err := sys.Gateway.Charges(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if payments := svctest.Count(t, sys.Pool(pagaments.Name), "SELECT count(*) FROM pagaments"); len(charges) != 0 || payments != 0 {
		t.Fatalf("%d gateway charges and %d payments, want 0 and 0", len(charges), payments)
	}
}
