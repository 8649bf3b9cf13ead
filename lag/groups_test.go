package lag_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/km0/km0/dlq"
	"github.com/km0/km0/lag"
)

// Without the system's groups, a Measurer of Kafka refuses to start rather
// than report every group the cluster lists.
func TestMeasurerNeedsTheSystemsGroups(t *testing.T) {
	t.Parallel()
	probe := kafkaProbe(t, []string{"127.0.0.1:1"})
	defer probe.Close()
	_, err := lag.NewMeasurer(lag.Config{Kafka: probe})
	if !errors.Is(err, lag.ErrNoGroups) {
		t.Fatalf("NewMeasurer without Groups: %v, want ErrNoGroups", err)
	}
}

// A group of another Kafka client ("intrus", 7 records behind: 4 of
// partition 0 after its commit, the 3 of partition 1 it never committed)
// is neither measured nor shown by default; with AllGroups it is measured,
// marked Foreign, and still left out of the metrics, the alerts and the
// default views unless they ask for it too.
func TestForeignGroupsOnlyOnRequest(t *testing.T) {
	t.Parallel()
	brokers, adm, _ := kafkaLag(t)
	var o kadm.Offsets
	o.Add(kadm.Offset{Topic: topic, Partition: 0, At: 1, LeaderEpoch: -1})
	if resp, err := adm.CommitOffsets(context.Background(), "intrus", o); err != nil || resp.Error() != nil {
		t.Fatalf("commit intrus: %v %v", err, resp.Error())
	}
	measure := func(cfg lag.Config) *lag.Snapshot {
		t.Helper()
		cfg.Kafka, cfg.Logger = kafkaProbe(t, brokers), quiet
		m, err := lag.NewMeasurer(cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		s, err := m.Measure(context.Background())
		if err != nil || len(s.Errors) != 0 {
			t.Fatalf("measure: %v %v", err, s.Errors)
		}
		return s
	}
	names := func(s *lag.Snapshot) []string {
		var out []string
		for _, g := range s.Groups {
			out = append(out, g.Group)
		}
		return out
	}
	// The system's groups the cluster lists; "absent" it does not.
	s := measure(lag.Config{Groups: []string{"inventari", "absent"}, OmitUnlisted: true})
	if got := names(s); !slices.Equal(got, []string{"inventari"}) {
		t.Fatalf("default groups %v, want [inventari]", got)
	}
	all := measure(lag.Config{Groups: []string{"inventari"}, AllGroups: true})
	if got := names(all); !slices.Equal(got, []string{"intrus", "inventari"}) {
		t.Fatalf("AllGroups: groups %v, want [intrus inventari]", got)
	}
	if in := group(t, all, "intrus"); !in.Foreign || in.Total != 7 || group(t, all, "inventari").Foreign {
		t.Fatalf("AllGroups: intrus %+v, inventari foreign %v", in, group(t, all, "inventari").Foreign)
	}
	if got := names(all.WithoutForeign()); !slices.Equal(got, []string{"inventari"}) || len(all.Groups) != 2 {
		t.Fatalf("WithoutForeign: %v (the original now %d groups)", got, len(all.Groups))
	}

	// Metrics: the foreign group only with Collector.AllGroups.
	sampler := lag.NewSampler(lag.SamplerConfig{})
	sampler.Add(all)
	for _, withAll := range []bool{false, true} {
		reg := prometheus.NewRegistry()
		reg.MustRegister(lag.Collector{S: sampler, AllGroups: withAll})
		v, ok := gauge(t, reg, lag.MetricGroupLag, map[string]string{"grup": "intrus", "particio": "0"})
		if ok != withAll || (ok && v != 4) {
			t.Errorf("Collector{AllGroups: %v}: intrus lag %v present %v", withAll, v, ok)
		}
		if v, ok := gauge(t, reg, lag.MetricGroupLag, map[string]string{"grup": "inventari", "particio": "0"}); !ok || v != 3 {
			t.Errorf("Collector{AllGroups: %v}: inventari lag %v present %v, want 3", withAll, v, ok)
		}
	}
	// History: the foreign group apart, and dropped by WithoutForeign.
	h := sampler.History()
	if len(h) != 1 || h[0].Others["intrus"] != 7 || h[0].Groups["inventari"] != 3 || len(h[0].Groups) != 1 {
		t.Fatalf("history: %+v", h)
	}
	if d := lag.WithoutForeign(h); d[0].Others != nil || h[0].Others == nil {
		t.Fatalf("WithoutForeign(history): %+v (the original %+v)", d, h)
	}

	// Alerts: over MaxLag 1 at once, the foreign group only with Rule.AllGroups.
	for _, withAll := range []bool{false, true} {
		al, err := dlq.NewAlerter(dlq.AlerterConfig{Registerer: prometheus.NewRegistry(), Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		w := lag.NewWatch(lag.Rule{MaxLag: 1, AllGroups: withAll}, al)
		w.Evaluate(context.Background(), all)
		firing := w.Firing()
		slices.Sort(firing)
		want := []string{"grup inventari"}
		if withAll {
			want = []string{"grup intrus", "grup inventari"}
		}
		if !slices.Equal(firing, want) {
			t.Errorf("Rule{AllGroups: %v}: firing %v, want %v", withAll, firing, want)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = al.Close(ctx)
		cancel()
	}
}
