package console

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/keyorder"
	"github.com/km0/km0/migrate"
)

// ServiceDB is the database of one service, as the console uses it: its
// per-key order tables (the blocked keys and their sequences, replayed as
// one) and its consumidors_pausats (pausing and resuming its consumer
// groups, consumer.PauseGroup).
type ServiceDB struct {
	Name string // the service, e.g. inventari
	// DB is the service's database (a pool).
	DB keyorder.DBTX
	// Schema of its tables. Default public.
	Schema string
	// Groups are the service's consumer groups the console offers to pause;
	// a group paused in consumidors_pausats shows even when not named.
	Groups []string
}

// serviceDBs are the databases of Config.ServiceDBs, plus Config.KeyOrder as
// a service without a name.
func (c *Console) serviceDBs() []ServiceDB {
	out := slices.Clone(c.cfg.ServiceDBs)
	if c.cfg.KeyOrder != nil {
		out = append(out, ServiceDB{DB: c.cfg.KeyOrder, Schema: c.cfg.KeyOrderSchema})
	}
	for i := range out {
		if out[i].Schema == "" {
			out[i].Schema = migrate.SchemaDefault
		}
	}
	return out
}

func (c *Console) serviceDB(name string) (ServiceDB, bool) {
	for _, s := range c.serviceDBs() {
		if s.Name == name {
			return s, true
		}
	}
	return ServiceDB{}, false
}

// blockedKey is a row of the blocked keys page.
type blockedKey struct {
	Service, Consumer, Key, HeadID, LastError, Letter string
	Reason                                            string // claus_bloquejades.motiu as stored: reintent or dlq
	Why                                               string // Reason for people (keyorder.Reason.English)
	Since                                             time.Time
	Behind                                            int
}

// blockedKeysLimit caps the blocked keys one service shows.
const blockedKeysLimit = 200

// blockedKeys lists the blocked keys of sdb, oldest first; none when its
// database has no per-key order tables.
func blockedKeys(ctx context.Context, sdb ServiceDB) ([]blockedKey, error) {
	t := pgx.Identifier{sdb.Schema, "claus_bloquejades"}.Sanitize()
	p := pgx.Identifier{sdb.Schema, "missatges_aparcats"}.Sanitize()
	var exists *string
	if err := sdb.DB.QueryRow(ctx, `SELECT to_regclass($1)::text`, t).Scan(&exists); err != nil {
		return nil, fmt.Errorf("console: blocked keys of %s: %w", sdb.Name, err)
	}
	if exists == nil {
		return nil, nil
	}
	rows, err := sdb.DB.Query(ctx, `SELECT b.consumidor, b.clau, b.id_missatge, b.motiu, coalesce(b.ultim_error, ''), coalesce(b.id_carta, ''),
		b.bloquejada_en, (SELECT count(*) FROM `+p+` a WHERE a.consumidor = b.consumidor AND a.clau = b.clau AND a.id_missatge <> b.id_missatge)
		FROM `+t+` b ORDER BY b.bloquejada_en, b.consumidor, b.clau LIMIT $1`, blockedKeysLimit)
	if err != nil {
		return nil, fmt.Errorf("console: blocked keys of %s: %w", sdb.Name, err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (blockedKey, error) {
		k := blockedKey{Service: sdb.Name}
		var key []byte
		err := r.Scan(&k.Consumer, &key, &k.HeadID, &k.Reason, &k.LastError, &k.Letter, &k.Since, &k.Behind)
		k.Consumer, k.Key, k.HeadID, k.LastError = dlq.Safe(k.Consumer), dlq.Safe(string(key)), dlq.Safe(k.HeadID), dlq.Safe(k.LastError)
		k.Why = dlq.Safe(keyorder.Reason(k.Reason).English())
		return k, err
	})
}

// blockingConsumer is a consumer of a service that blocks keys: a row of
// the blocked keys page's per-consumer actions.
type blockingConsumer struct {
	Service, Consumer string
	Keys              int // its keys the page shows
}

// blockedPage lists every service's blocked keys, each with its head and the
// count parked behind it, and offers to replay each sequence as one, or
// every sequence of a consumer at once (replaySequences).
func (c *Console) blockedPage(w http.ResponseWriter, r *http.Request) {
	var keys []blockedKey
	var errs []string
	for _, sdb := range c.serviceDBs() {
		ks, err := blockedKeys(r.Context(), sdb)
		if err != nil {
			c.cfg.Logger.Error("console: blocked keys", "service", sdb.Name, "err", err)
			errs = append(errs, fmt.Sprintf("%s: the database is unavailable; the server log has the details", cmpName(sdb.Name)))
			continue
		}
		keys = append(keys, ks...)
	}
	var consumers []blockingConsumer
	at := map[[2]string]int{}
	for _, k := range keys {
		id := [2]string{k.Service, k.Consumer}
		i, ok := at[id]
		if !ok {
			i, at[id] = len(consumers), len(consumers)
			consumers = append(consumers, blockingConsumer{Service: k.Service, Consumer: k.Consumer})
		}
		consumers[i].Keys++
	}
	c.renderPage(w, r, http.StatusOK, "blocked", page{Title: "Blocked keys", Refresh: refreshSeconds, Data: map[string]any{
		"Keys": keys, "Consumers": consumers, "Errors": errs, "Services": len(c.serviceDBs()), "HasDLQ": c.cfg.Source != nil,
	}})
}

func cmpName(n string) string {
	if n == "" {
		return "the key-order database"
	}
	return n
}

// groupState is a row of the consumers page.
type groupState struct {
	Service, Group string
	Paused         bool
	Since          time.Time
	By             string
}

// groupStates lists the consumer groups of every service database with
// their pause state.
func (c *Console) groupStates(ctx context.Context) ([]groupState, []string) {
	var out []groupState
	var errs []string
	for _, sdb := range c.serviceDBs() {
		if sdb.Name == "" {
			continue // the key-order database names no service
		}
		paused, err := consumer.PausedGroups(ctx, sdb.DB, sdb.Schema)
		var pe *pgconn.PgError
		if errors.As(err, &pe) && pe.Code == "42P01" {
			paused, err = nil, nil // no consumidors_pausats yet: nothing paused
		}
		if err != nil {
			c.cfg.Logger.Error("console: paused groups", "service", sdb.Name, "err", err)
			errs = append(errs, sdb.Name+": the database is unavailable; the server log has the details")
			continue
		}
		seen := map[string]bool{}
		for _, p := range paused {
			seen[p.Group] = true
			out = append(out, groupState{Service: sdb.Name, Group: dlq.Safe(p.Group), Paused: true, Since: p.Since, By: dlq.Safe(p.By)})
		}
		for _, g := range sdb.Groups {
			if !seen[g] {
				out = append(out, groupState{Service: sdb.Name, Group: g})
			}
		}
	}
	slices.SortStableFunc(out, func(a, b groupState) int {
		if a.Service != b.Service {
			return cmpStr(a.Service, b.Service)
		}
		return cmpStr(a.Group, b.Group)
	})
	return out, errs
}

func cmpStr(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func (c *Console) consumersPage(w http.ResponseWriter, r *http.Request) {
	gs, errs := c.groupStates(r.Context())
	c.renderPage(w, r, http.StatusOK, "consumers", page{Title: "Consumer groups", Refresh: refreshSeconds, Data: map[string]any{
		"Groups": gs, "Errors": errs, "Done": r.URL.Query().Get("fet"),
	}})
}

// who names the session that acts, for the record (a digest of its CSRF
// token: never the token itself).
func who(r *http.Request) string {
	s := sessionOf(r)
	if s == nil {
		return "console"
	}
	d := sha256.Sum256([]byte(s.csrf))
	return "console session " + hex.EncodeToString(d[:4])
}

// pauseGroup pauses (pause) or resumes a consumer group of a service: a row
// in (or out of) the service's consumidors_pausats, which the service polls.
func (c *Console) pauseGroup(pause bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		service, err1 := text(r.PostFormValue("servei"))
		group, err2 := text(r.PostFormValue("grup"))
		if err1 != nil || err2 != nil || service == "" || group == "" {
			c.errorPage(w, r, http.StatusBadRequest, "a pause or resume needs servei and grup")
			return
		}
		sdb, ok := c.serviceDB(service)
		if !ok || (pause && !slices.Contains(sdb.Groups, group)) {
			c.errorPage(w, r, http.StatusNotFound, "no such consumer group in this console's services")
			return
		}
		ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), actionTimeout)
		defer cancel()
		verb := "paused"
		if pause {
			err := consumer.PauseGroup(ctx, sdb.DB, sdb.Schema, group, who(r))
			var pe *pgconn.PgError
			if errors.As(err, &pe) && pe.Code == "42P01" {
				c.errorPage(w, r, http.StatusConflict, "this service's database has no consumidors_pausats yet: start the service once (it creates the table)")
				return
			}
			if err != nil {
				c.fail(w, r, err)
				return
			}
		} else {
			verb = "resumed"
			if err := consumer.ResumeGroup(ctx, sdb.DB, sdb.Schema, group); err != nil {
				c.fail(w, r, err)
				return
			}
		}
		c.cfg.Logger.Warn("console: consumer group "+verb, "service", service, "grup", group, "per", who(r))
		http.Redirect(w, r, "/consumidors?fet="+url.QueryEscape(verb+" "+group), http.StatusSeeOther)
	}
}
