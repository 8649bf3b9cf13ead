package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/internal/dlqcli"
	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/keyorder"
	"github.com/km0/km0/migrate"
)

// km0 serve --console (as km0 up --console) gives the console every
// service's own database: a key blocked in cataleg's database shows on
// /claus, and pausing cataleg's group from /consumidors reaches the service
// (its /salut lists the group under pausats) until it is resumed.
func TestUpConsoleShowsEveryServicesBlockedKeysAndPauses(t *testing.T) {
	t.Parallel()
	b := kafkatest.New(t, system.DomainTopics()...)
	sfx := make([]byte, 4)
	_, _ = rand.Read(sfx)
	suffix := "svcdb_" + hex.EncodeToString(sfx)
	t.Cleanup(func() { _ = svc.DropDatabase(context.Background(), pgtest.URL(), svc.DatabaseName("dlq", suffix)) })
	catDB := pgtest.NewDatabase(t)
	const tok = "tok-services-0123456789"
	addr := freeAddr(t)
	p := startKm0(t, []string{dlqcli.AdminTokenEnv + "=" + tok, serviceDatabaseEnv("cataleg") + "=" + catDB},
		"serve", "cataleg", "--brokers", strings.Join(b.Addrs(), ","), "--database-url", pgtest.URL(), "--database-suffix", suffix,
		"--console", addr, "--http", "cataleg=127.0.0.1:0")
	p.waitRunning(t, 60*time.Second)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, catDB)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if _, err := migrate.Up(ctx, pool, migrate.Names{}, migrate.Inbox, keyorder.Migrations); err != nil {
		t.Fatal(err)
	}
	ko, _ := keyorder.New(keyorder.Config{})
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := ko.MarkHeadBlocked(ctx, tx, "cataleg.estoc_baix", "formatge-curat", keyorder.Head{MessageID: "cap-1", Reason: keyorder.ReasonDeadLettered}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	jar, _ := cookiejar.New(nil)
	hc := &http.Client{Jar: jar, Timeout: 10 * time.Second}
	base := "http://" + addr
	testkit.Eventually(t, time.Minute, "the console", func() bool { r, err := hc.Get(base + "/"); return err == nil && r.Body.Close() == nil })
	if r, err := hc.PostForm(base+"/login", url.Values{"token": {tok}, "next": {"/"}}); err != nil || r.StatusCode != http.StatusOK {
		t.Fatalf("login: %v %v", r, err)
	}
	get := func(path string) string {
		r, err := hc.Get(base + path)
		if err != nil {
			t.Fatal(err)
		}
		defer r.Body.Close()
		body, _ := io.ReadAll(r.Body)
		return string(body)
	}
	if body := get("/claus"); !strings.Contains(body, `data-service="cataleg" data-key="formatge-curat"`) {
		t.Fatalf("/claus lacks cataleg's blocked key:\n%s", body)
	}
	body := get("/consumidors")
	m := regexp.MustCompile(`name="csrf" value="([^"]+)"`).FindStringSubmatch(body)
	if m == nil || !strings.Contains(body, `data-group="cataleg.estoc_baix" data-paused="false"`) {
		t.Fatalf("/consumidors:\n%s", body)
	}
	health := func() []string {
		r, err := http.Get(svcAddr(t, p, "cataleg") + system.HealthPath)
		if err != nil {
			t.Fatal(err)
		}
		defer r.Body.Close()
		var h system.Health
		_ = json.NewDecoder(r.Body).Decode(&h)
		return h.Paused
	}
	form := url.Values{"csrf": {m[1]}, "servei": {"cataleg"}, "grup": {"cataleg.estoc_baix"}}
	if r, err := hc.PostForm(base+"/consumidors/pausar", form); err != nil || r.StatusCode != http.StatusOK {
		t.Fatalf("pause: %v %v", r, err)
	}
	testkit.Eventually(t, time.Minute, "cataleg's /salut to list the paused group", func() bool { return slices.Equal(health(), []string{"cataleg.estoc_baix"}) })
	if r, err := hc.PostForm(base+"/consumidors/reprendre", form); err != nil || r.StatusCode != http.StatusOK {
		t.Fatalf("resume: %v %v", r, err)
	}
	testkit.Eventually(t, time.Minute, "cataleg's /salut to list no paused group", func() bool { return len(health()) == 0 })
}

// svcAddr is the base URL of service's HTTP API as km0 serve printed it.
func svcAddr(t *testing.T, p *proc, service string) string {
	t.Helper()
	var u string
	testkit.Eventually(t, time.Minute, service+"'s address", func() bool {
		m := regexp.MustCompile(`(?m)\b` + service + `\s+(http://\S+)`).FindStringSubmatch(p.output())
		if m != nil {
			u = strings.TrimSuffix(m[1], "/")
		}
		return m != nil
	})

	return u
}
