package system_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/services/cataleg"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/migrate"
)

// An operator pauses cataleg's consumer group (a row in its database's
// consumidors_pausats, as the console writes it): /salut says so, the
// km0_consumer_paused gauge is 1, and an estoc.actualitzat published meanwhile
// is not applied; once resumed it is, exactly once.
func TestPausedGroupTakesNoBatchUntilResumed(t *testing.T) {
	t.Parallel()
	sys, b := startOne(t, cataleg.Name)
	t.Cleanup(sys.Close)
	ctx := context.Background()
	pool := sys.Pool(cataleg.Name)
	group := cataleg.ConsumerLowStock
	cl := kafkatest.Client(t, b)
	publish := func(product string) {
		t.Helper()
		e := &envelope.Envelope{ID: uuid.NewString(), Type: cataleg.TypeStockUpdated, Version: 1, TimeMS: time.Now().UnixMilli(), Origin: "inventari",
			Data: json.RawMessage(`{"producte":"` + product + `","abans":5,"despres":3,"motiu":"reposicio"}`)}
		val, err := e.Encode()
		if err != nil {
			t.Fatal(err)
		}
		if err := cl.ProduceSync(ctx, &kgo.Record{Topic: "inventari.esdeveniments", Key: []byte(product), Value: val,
			Headers: []kgo.RecordHeader{{Key: "tipus", Value: []byte(e.Type)}, {Key: "id_esdeveniment", Value: []byte(e.ID)}}}).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	rows := func(product string) int {
		var n int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM indicadors WHERE producte = $1", product).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	health := func() system.Health {
		resp, err := http.Get(sys.Addrs()[cataleg.Name] + system.HealthPath)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var h system.Health
		if err := json.NewDecoder(resp.Body).Decode(&h); err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("health: %d %v", resp.StatusCode, err)
		}
		return h
	}
	// The consumer runs: a first event is applied.
	publish("carbasso")
	testkit.Eventuallyf(t, time.Minute, "the first event applied", func() (bool, string) { n := rows("carbasso"); return n == 1, fmt.Sprintf("%d row(s)", n) })

	if err := consumer.PauseGroup(ctx, pool, migrate.SchemaDefault, group, "test session"); err != nil {
		t.Fatal(err)
	}
	testkit.Eventuallyf(t, time.Minute, "the pause to reach the service", func() (bool, string) {
		h := health()
		return slices.Equal(h.Paused, []string{group}), fmt.Sprintf("%+v", h)
	})

	if v := gauge(t, group); v != 1 {
		t.Fatalf("%s{grup=%q} = %v, want 1", system.MetricPaused, group, v)
	}
	publish("formatge-curat")
	// A bounded observation window (the claim is that nothing happens):
	// the running consumer applied the first event well within it.
	for end := time.Now().Add(3 * time.Second); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		if n := rows("formatge-curat"); n != 0 {
			t.Fatalf("paused consumer applied the event: %d row(s)", n)
		}
	}
	if err := consumer.ResumeGroup(ctx, pool, migrate.SchemaDefault, group); err != nil {
		t.Fatal(err)
	}
	testkit.Eventuallyf(t, time.Minute, "the event applied after the resume", func() (bool, string) {
		n := rows("formatge-curat")
		return n == 1, fmt.Sprintf("%d row(s)", n)
	})

	if h := health(); len(h.Paused) != 0 {
		t.Fatalf("health after the resume: %+v", h)
	}
	if v := gauge(t, group); v != 0 {
		t.Fatalf("%s{grup=%q} after the resume = %v, want 0", system.MetricPaused, group, v)
	}
}

// gauge is the value of km0_consumer_paused for group in the default
// registry (-1 when absent).
func gauge(t *testing.T, group string) float64 {
	t.Helper()
	mfs, err := prometheus.DefaultGatherer.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != system.MetricPaused {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "grup" && l.GetValue() == group {
					return m.GetGauge().GetValue()
				}
			}
		}
	}
	return -1
}
