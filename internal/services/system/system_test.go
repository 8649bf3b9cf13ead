package system_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/requestreply/kafkarr"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

func TestStartRefusesAnUnknownServiceAndMissingConfig(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	if _, err := system.Start(ctx, system.Config{}); err == nil {
		t.Fatal("no database and no brokers accepted")
	}
	_, err := system.Start(ctx, system.Config{DatabaseURL: pgtest.URL(), Brokers: []string{"127.0.0.1:1"}, Services: []string{"facturacio"}})
	if err == nil || !strings.Contains(err.Error(), `unknown service "facturacio"`) {
		t.Fatalf("unknown service: %v", err)
	}
}

// km0 serve cataleg: one service, its own database created and migrated,
// its consumer and its HTTP API; Close drops nothing and returns.
func TestServeOneServiceCreatesItsDatabaseAndServesHTTP(t *testing.T) {
	t.Parallel()
	sys, _ := startOne(t, "cataleg")
	addrs := sys.Addrs()
	if len(addrs) != 1 || addrs["cataleg"] == "" || sys.Pool("comandes") != nil {
		t.Fatalf("addresses %v: want only cataleg", addrs)
	}
	resp, err := http.Get(addrs["cataleg"] + "/cataleg")
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /cataleg: %v %v", resp, err)
	}
	resp.Body.Close()
	// DNS rebinding: another site's name for this address is not answered.
	req, _ := http.NewRequest(http.MethodGet, addrs["cataleg"]+"/cataleg", nil)
	req.Host = "rebind.evil.example"
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != http.StatusMisdirectedRequest {
		t.Fatalf("GET /cataleg with a foreign Host: %v %v, want 421", resp, err)
	} else {
		resp.Body.Close()
	}
	closed := make(chan struct{})
	go func() { sys.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(2*system.ShutdownGraceDefault + 5*time.Second):
		t.Fatal("Close did not return")
	}
}

// ReservarEstoc over request/reply (Kafka here): a repeated id_reserva gets
// the stored answer and takes stock once.
func TestReservarEstocOverRequestReplyIsIdempotent(t *testing.T) {
	t.Parallel()
	sys, b := startOne(t, "inventari")
	t.Cleanup(sys.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cl, err := kafkarr.NewClient(ctx, kafkarr.ClientConfig{Brokers: b.Addrs(), Timeout: 20 * time.Second, SigningKey: testKey})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	body := []byte(`{"id_reserva":"R-77","linies":[{"producte":"vi-crianca","quantitat":7}]}`)
	var answers [][]byte
	for range 2 { // the requester timed out and asks again with the same id
		out, err := cl.Request(ctx, inventari.ReserveQueue, "R-77", body)
		if err != nil {
			t.Fatal(err)
		}
		answers = append(answers, out)
	}
	if string(answers[0]) != string(answers[1]) || !strings.Contains(string(answers[0]), `"acceptada": true`) {
		t.Fatalf("answers %s / %s", answers[0], answers[1])
	}
	stock, err := sys.Inventari.Stock(ctx)
	if err != nil || stock["vi-crianca"] != 193 {
		t.Fatalf("vi-crianca %d (%v), want 200 - 7", stock["vi-crianca"], err)
	}
}

// The running system deletes what it keeps only for a while: consumer keys
// past KeyRetention (CONTRACT.md: 14 days) and stored Idempotency-Key answers
// past RequestKeyRetention, and nothing younger.
func TestHousekeepingPurgesExpiredKeysOnly(t *testing.T) {
	t.Parallel()
	sys, _ := startOneWith(t, "comandes", func(c *system.Config) { c.PurgeInterval = 50 * time.Millisecond })
	t.Cleanup(sys.Close)
	ctx := context.Background()
	pool := sys.Pool("comandes")
	for _, q := range []string{
		`INSERT INTO missatges_processats (id_missatge, consumidor, processat_en) VALUES
			('vell', 'comandes.pagament_confirmat', now() - interval '15 days'),
			('nou', 'comandes.pagament_confirmat', now() - interval '13 days')`,
		`INSERT INTO peticions_idempotents (clau, hash_peticio, estat_http, resposta, creat_en) VALUES
			('vella', 'h', 201, '{}', now() - interval '25 hours'), ('nova', 'h', 201, '{}', now() - interval '23 hours')`,
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	count := func(q string) int {
		var n int
		if err := pool.QueryRow(ctx, q).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	testkit.Eventually(t, 30*time.Second, "the expired rows deleted", func() bool {
		return count(`SELECT count(*) FROM missatges_processats WHERE id_missatge = 'vell'`)+count(`SELECT count(*) FROM peticions_idempotents WHERE clau = 'vella'`) == 0
	})
	if k, r := count(`SELECT count(*) FROM missatges_processats WHERE id_missatge = 'nou'`), count(`SELECT count(*) FROM peticions_idempotents WHERE clau = 'nova'`); k != 1 || r != 1 {
		t.Fatalf("young rows deleted: %d key(s), %d request(s) left, want 1 and 1", k, r)
	}
}

// startOne starts one service on its own embedded broker and a fresh
// database, dropped at cleanup (after any cleanup the caller registers).
func startOne(t *testing.T, service string) (*system.System, *kafkaembed.Broker) {
	t.Helper()
	return startOneWith(t, service, nil)
}

// startOneWith is startOne with cfg changed by tweak first.
func startOneWith(t *testing.T, service string, tweak func(*system.Config)) (*system.System, *kafkaembed.Broker) {
	t.Helper()
	return startWith(t, []string{service}, tweak)
}

// startWith starts services on their own embedded broker and fresh
// databases, dropped at cleanup, with cfg changed by tweak first.
func startWith(t *testing.T, services []string, tweak func(*system.Config)) (*system.System, *kafkaembed.Broker) {
	t.Helper()
	b := kafkatest.New(t, system.DomainTopics()...)
	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	cfg := system.Config{DatabaseURL: pgtest.URL(), DatabaseSuffix: "t" + hex.EncodeToString(suffix), Brokers: b.Addrs(), Services: services,
		SigningKey: testKey}
	if tweak != nil {
		tweak(&cfg)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second) // the services' lifetime: Start ties them to ctx
	sys, err := system.Start(ctx, cfg)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		for _, service := range services {
			_ = svc.DropDatabase(context.Background(), pgtest.URL(), svc.DatabaseName(service, cfg.DatabaseSuffix))
		}
	})
	return sys, b
}

// pagaments serves no HTTP API of its own, but it has a health entry: its
// server answers GET /salut with 200 and nothing else.
func TestPagamentsHasHealth(t *testing.T) {
	t.Parallel()
	sys, _ := startOne(t, "pagaments")
	t.Cleanup(sys.Close)
	base := sys.Addrs()["pagaments"]
	if base == "" {
		t.Fatalf("addresses %v: no pagaments", sys.Addrs())
	}
	resp, err := http.Get(base + system.HealthPath)
	if err != nil {
		t.Fatal(err)
	}
	var h system.Health
	err = json.NewDecoder(resp.Body).Decode(&h)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusOK || h.Service != "pagaments" || h.State != "ok" {
		t.Fatalf("GET pagaments /salut: %d %+v %v", resp.StatusCode, h, err)
	}
	if resp, err := http.Get(base + "/pagaments"); err != nil || resp.StatusCode != http.StatusNotFound {
		t.Fatalf("GET pagaments /pagaments: %v %v, want 404", resp, err)
	} else {
		resp.Body.Close()
	}
}
