package main

import (
	"encoding/json"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/dlqcli"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgcluster"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/lag"
)

// km0 serve --outbox wal --console measures each service's WAL-mode outbox
// by its slot: /lag.json has comandes with its slot (the default of its
// database), not rows. On a cluster of its own (wal_level = logical).
func TestUpConsoleShowsWALOutboxes(t *testing.T) {
	t.Parallel()
	c, err := pgcluster.Start(pgcluster.Options{})
	if err != nil {
		t.Fatalf("a private PostgreSQL cluster is required: %v", err)
	}
	t.Cleanup(c.Stop)
	b := kafkatest.New(t, system.DomainTopics()...)
	const tok = "tok-wal-0123456789abcdef"
	addr := freeAddr(t)
	p := startKm0(t, []string{dlqcli.AdminTokenEnv + "=" + tok},
		"serve", "comandes", "--outbox", "wal", "--brokers", strings.Join(b.Addrs(), ","), "--database-url", c.URL,
		"--console", addr, "--http", "comandes=127.0.0.1:0")
	p.waitRunning(t, 60*time.Second)
	jar, _ := cookiejar.New(nil)
	hc := &http.Client{Jar: jar, Timeout: 10 * time.Second}
	base := "http://" + addr
	testkit.Eventually(t, time.Minute, "the console", func() bool { r, err := hc.Get(base + "/"); return err == nil && r.Body.Close() == nil })
	if r, err := hc.PostForm(base+"/login", url.Values{"token": {tok}, "next": {"/"}}); err != nil || r.StatusCode != http.StatusOK {
		t.Fatalf("login: %v %v", r, err)
	}
	var o lag.OutboxLag
	testkit.Eventually(t, time.Minute, "comandes's WAL outbox in /lag.json", func() bool {
		r, err := hc.Get(base + "/lag.json")
		if err != nil {
			return false
		}
		defer r.Body.Close()
		var v struct {
			Latest lag.Snapshot `json:"ultima"`
		}
		if json.NewDecoder(r.Body).Decode(&v) != nil {
			return false
		}
		for _, x := range v.Latest.Outboxes {
			if x.Name == "comandes" {
				o = x
				return true
			}
		}
		return false
	})

	if o.Err != "" || o.WAL == nil || !strings.HasPrefix(o.WAL.Slot, "km0_wal_") || o.WAL.WALStatus == "" {
		t.Fatalf("comandes: %+v %+v, want its WAL slot", o, o.WAL)
	}
}
