package system_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/redact"
	"github.com/km0/km0/internal/services/cataleg"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/internal/testkit"
)

// Each service deployed on its own: inventari and cataleg on databases of
// their own whose names are not km0_<service>, with no admin URL at all (so
// nothing can be created), inventari's topic renamed and cataleg's group
// renamed. A restock flows from inventari's outbox through the renamed topic
// to cataleg under the renamed group; the contract's topic stays empty and
// its group never exists.
func TestServicesRunOnTheirOwnDatabasesWithRenamedTopicAndGroup(t *testing.T) {
	t.Parallel()
	const topic, group = "prod.inventari.v1", "cataleg-prod"
	b := kafkatest.New(t)
	// With a password (the local server trusts and ignores it): it is never logged.
	withPassword := func(u string) string {
		p, err := url.Parse(u)
		if err != nil {
			t.Fatal(err)
		}
		p.User = url.UserPassword(p.User.Username(), "s3cret")
		return p.String()
	}
	own := map[string]string{inventari.Name: withPassword(pgtest.NewDatabase(t)), cataleg.Name: withPassword(pgtest.NewDatabase(t))}
	var logs syncBuffer
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	sys, err := system.Start(ctx, system.Config{DatabaseURLs: own, Brokers: b.Addrs(), Services: []string{inventari.Name, cataleg.Name},
		Topics: map[string]string{inventari.Topic: topic}, Groups: map[string]string{cataleg.ConsumerLowStock: group},
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		sys.Close()
		if l := logs.String(); strings.Contains(l, "s3cret") || !strings.Contains(l, "system: database") {
			t.Errorf("the log shows a password or no database:\n%s", l)
		}
	})
	for service, name := range sys.DatabaseNames() {
		if !strings.HasPrefix(name, "km0t_") || !strings.Contains(own[service], "/"+name) {
			t.Fatalf("%s runs on database %q, want its own (%s)", service, name, redact.URL(own[service]))
		}
	}
	if err := sys.Inventari.Restock(ctx, "carbasso", 1); err != nil {
		t.Fatal(err)
	}
	testkit.Eventuallyf(t, 30*time.Second, "cataleg to flag carbasso after the restock", func() (bool, string) {
		flags, err := sys.Cataleg.Flags(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return len(flags) == 1 && flags[0].Product == "carbasso", fmt.Sprintf("flags %v", flags)
	})
	adm := kadm.NewClient(kafkatest.Client(t, b))
	ends, err := adm.ListEndOffsets(ctx, topic, inventari.Topic)
	if err != nil {
		t.Fatal(err)
	}
	count := func(topic string) (n int64) {
		ends.Each(func(o kadm.ListedOffset) {
			if o.Topic == topic {
				n += o.Offset
			}
		})
		return n
	}
	if count(topic) != 1 || count(inventari.Topic) != 0 {
		t.Fatalf("records: %d on %s, %d on %s; want 1 and 0", count(topic), topic, count(inventari.Topic), inventari.Topic)
	}
	groups, err := adm.ListGroups(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if names := groups.Groups(); !contains(names, group) || contains(names, cataleg.ConsumerLowStock) {
		t.Fatalf("consumer groups %v: want %s and not %s", names, group, cataleg.ConsumerLowStock)
	}
	// Renames of names that are not the contract's, or into names Kafka refuses, are refused.
	for _, cfg := range []system.Config{
		{Topics: map[string]string{"inventari.events": "x"}},
		{Topics: map[string]string{inventari.Topic: "no/slashes"}},
		{Groups: map[string]string{"cataleg.flags": "x"}},
		{DatabaseURLs: map[string]string{"facturacio": own[cataleg.Name]}},
		{Services: []string{cataleg.Name}}, // no database at all
	} {
		cfg.Brokers = b.Addrs()
		if cfg.Services == nil {
			cfg.Services = []string{cataleg.Name}
			cfg.DatabaseURLs = merge(cfg.DatabaseURLs, map[string]string{cataleg.Name: own[cataleg.Name]})
		}
		if s, err := system.Start(ctx, cfg); err == nil {
			s.Close()
			t.Errorf("Start accepted %+v", cfg)
		}
	}
}

// syncBuffer is a bytes.Buffer safe for concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (w *syncBuffer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (w *syncBuffer) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

func merge(a, b map[string]string) map[string]string {
	out := map[string]string{}
	for k, v := range a {
		out[k] = v
	}
	for k, v := range b {
		out[k] = v
	}
	return out
}
