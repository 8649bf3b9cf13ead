package system_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/requestreply/kafkarr"
	"github.com/km0/km0/services/inventari"
	"github.com/km0/km0/services/svc"
	"github.com/km0/km0/services/system"
	"github.com/km0/km0/transport/kafka"
)

func TestStartRefusesAnUnknownServiceAndMissingConfig(t *testing.T) {
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
	sys, b := startOne(t, "inventari")
	t.Cleanup(sys.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cl, err := kafkarr.NewClient(ctx, kafkarr.ClientConfig{Brokers: b.Addrs(), Timeout: 20 * time.Second})
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

// startOne starts one service on its own embedded broker and a fresh
// database, dropped at cleanup (after any cleanup the caller registers).
func startOne(t *testing.T, service string) (*system.System, *kafka.Embedded) {
	t.Helper()
	b := kafkatest.New(t, system.DomainTopics()...)
	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	cfg := system.Config{DatabaseURL: pgtest.URL(), DatabaseSuffix: "t" + hex.EncodeToString(suffix), Brokers: b.Addrs(), Services: []string{service}}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second) // the services' lifetime: Start ties them to ctx
	sys, err := system.Start(ctx, cfg)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		_ = svc.DropDatabase(context.Background(), pgtest.URL(), svc.DatabaseName(service, cfg.DatabaseSuffix))
	})
	return sys, b
}
