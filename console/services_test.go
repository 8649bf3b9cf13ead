package console_test

import (
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/km0/km0/console"
	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/keyorder"
	"github.com/km0/km0/migrate"
)

// serviceDB is a service's own database (a schema of its own here) with its
// key-order tables and consumidors_pausats.
func serviceDB(t *testing.T, name string, groups ...string) (console.ServiceDB, *pgtest.Schema) {
	t.Helper()
	s := pgtest.NewSchema(t)
	if _, err := migrate.Up(t.Context(), s.Pool, s.Names(), migrate.Inbox, keyorder.Migrations, consumer.PauseMigrations); err != nil {
		t.Fatal(err)
	}
	return console.ServiceDB{Name: name, DB: s.Pool, Schema: s.Name, Groups: groups}, s
}

// Every service keeps its blocked keys in its own database: the console
// shows those of each database it is given (page /claus, behind the login),
// with the service's name, so that a sequence replay reaches the right one.
func TestBlockedKeysOfEveryServiceDatabase(t *testing.T) {
	t.Parallel()
	inv, invS := serviceDB(t, "inventari")
	pag, pagS := serviceDB(t, "pagaments")
	for _, c := range []struct {
		s        *pgtest.Schema
		consumer string
		key      string
	}{{invS, "inventari.descompte_estoc", "P-2026-1"}, {pagS, "pagaments.cobrament", "P-2026-2"}, {pagS, "pagaments.cobrament", "P-2026-3"}} {
		ko, err := keyorder.New(keyorder.Config{Schema: c.s.Name})
		if err != nil {
			t.Fatal(err)
		}
		tx, err := c.s.Pool.Begin(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if err := ko.MarkHeadBlocked(t.Context(), tx, c.consumer, c.key, keyorder.Head{MessageID: "cap-" + c.key, Reason: keyorder.ReasonDeadLettered,
			LastError: "esquema"}); err != nil {
			t.Fatal(err)
		}
		if _, _, err := ko.Park(t.Context(), tx, c.consumer, c.key, keyorder.Message{ID: "darrere-" + c.key, Topic: comandes, Value: []byte(`{}`)}); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	b := setupWith(t, token, func(c *console.Config) { c.KeyOrder = nil; c.ServiceDBs = []console.ServiceDB{inv, pag} })
	br := b.browser(t)
	if resp, _ := br.get("/claus"); resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("GET /claus without login: %d, want 303 to the login", resp.StatusCode)
	}
	br.login(token)
	_, body := br.get("/claus")
	if !strings.Contains(body, `<b id="blocked-total">3</b>`) || !strings.Contains(body, `data-service="inventari" data-key="P-2026-1"`) ||
		!strings.Contains(body, `data-service="pagaments" data-key="P-2026-3"`) || !strings.Contains(body, `<td class="num">1</td>`) {
		t.Fatalf("blocked keys page:\n%s", body)
	}
}

// Pausing a consumer group from the console writes the service's
// consumidors_pausats (which the service polls) with who did it, behind the
// login and the form token; resuming deletes the row.
func TestPauseAndResumeAConsumerGroup(t *testing.T) {
	t.Parallel()
	inv, invS := serviceDB(t, "inventari", "inventari.descompte_estoc")
	b := setupWith(t, token, func(c *console.Config) { c.ServiceDBs = []console.ServiceDB{inv} })
	paused := func() []consumer.PausedGroup {
		gs, err := consumer.PausedGroups(t.Context(), invS.Pool, invS.Name)
		if err != nil {
			t.Fatal(err)
		}
		return gs
	}
	br := b.browser(t)
	form := url.Values{"servei": {"inventari"}, "grup": {"inventari.descompte_estoc"}}
	if resp, _ := br.post("/consumidors/pausar", form); resp.StatusCode != http.StatusUnauthorized || len(paused()) != 0 {
		t.Fatalf("pause without login: %d, %d paused", resp.StatusCode, len(paused()))
	}
	csrf := br.login(token)
	if resp, _ := br.post("/consumidors/pausar", form); resp.StatusCode != http.StatusForbidden || len(paused()) != 0 {
		t.Fatalf("pause without the form token: %d, %d paused", resp.StatusCode, len(paused()))
	}
	form.Set("csrf", csrf)
	bad := url.Values{"csrf": {csrf}, "servei": {"inventari"}, "grup": {"unknown"}}
	if resp, _ := br.post("/consumidors/pausar", bad); resp.StatusCode != http.StatusNotFound || len(paused()) != 0 {
		t.Fatalf("pause of an unknown group: %d, %d paused", resp.StatusCode, len(paused()))
	}
	if _, body := br.get("/consumidors"); !strings.Contains(body, `data-group="inventari.descompte_estoc" data-paused="false"`) {
		t.Fatalf("consumers page before the pause:\n%s", body)
	}
	if resp, _ := br.post("/consumidors/pausar", form); resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("pause: %d", resp.StatusCode)
	}
	gs := paused()
	if len(gs) != 1 || gs[0].Group != "inventari.descompte_estoc" || !strings.HasPrefix(gs[0].By, "console session ") || strings.Contains(gs[0].By, csrf) {
		t.Fatalf("paused after the pause: %+v", gs)
	}
	if _, body := br.get("/consumidors"); !strings.Contains(body, `data-group="inventari.descompte_estoc" data-paused="true"`) {
		t.Fatalf("consumers page after the pause:\n%s", body)
	}
	if resp, _ := br.post("/consumidors/reprendre", form); resp.StatusCode != http.StatusSeeOther || len(paused()) != 0 {
		t.Fatalf("resume: %d, %d paused", resp.StatusCode, len(paused()))
	}
}
