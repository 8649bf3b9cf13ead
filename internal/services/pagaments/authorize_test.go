package pagaments_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/pagaments/passarella"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/requestreply"
)

// Many concurrent authorisations, each order asked several times with
// different amounts (some over the limit), share commits: every order ends
// with one stored decision, and every answer agrees with it.
func TestConcurrentAuthorizationsAgreeWithTheOneStoredDecision(t *testing.T) {
	t.Parallel()
	b := setup(t, passarella.Faults{})
	s := b.service(t, time.Second)
	ctx := context.Background()
	const orders, asks = 40, 5
	type answer struct {
		order  int
		amount int64
		resp   pagaments.AuthResponse
	}
	answers := make(chan answer, orders*asks)
	var wg sync.WaitGroup
	for o := range orders {
		for a := range asks {
			wg.Add(1)
			go func() {
				defer wg.Done()
				amount := int64(1000 + 100_000*a) // a >= 2 is over the limit
				out, err := s.Authorize(ctx, []byte(fmt.Sprintf(`{"comanda_id":"C-%d","import_centims":%d}`, o, amount)))
				if errors.Is(err, requestreply.ErrConflict) {
					answers <- answer{o, amount, pagaments.AuthResponse{Reason: "conflicte"}}
					return
				}
				if err != nil {
					t.Error(err)
					return
				}
				var r pagaments.AuthResponse
				if err := json.Unmarshal(out, &r); err != nil {
					t.Error(err)
					return
				}
				answers <- answer{o, amount, r}
			}()
		}
	}
	wg.Wait()
	close(answers)
	stored := map[string]struct {
		cents    int64
		approved bool
	}{}
	rows, err := b.pool.Query(ctx, `SELECT comanda_id, import_centims, aprovada FROM autoritzacions`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		var c int64
		var ok bool
		if err := rows.Scan(&id, &c, &ok); err != nil {
			t.Fatal(err)
		}
		stored[id] = struct {
			cents    int64
			approved bool
		}{c, ok}
	}
	if len(stored) != orders {
		t.Fatalf("%d stored decisions for %d orders", len(stored), orders)
	}
	n := 0
	for a := range answers {
		n++
		st := stored[fmt.Sprintf("C-%d", a.order)]
		// The stored amount's requests get the stored decision; the others a conflict.
		want := st.approved && st.cents == a.amount
		conflict := st.cents != a.amount
		if a.resp.Approved != want || (a.resp.Reason == "conflicte") != conflict {
			t.Fatalf("order %d amount %d answered %+v; stored %+v", a.order, a.amount, a.resp, st)
		}
	}
	if n != orders*asks {
		t.Fatalf("%d answers, want %d", n, orders*asks)
	}
}

// One request PostgreSQL refuses (an order id too long for the key's index)
// fails alone, even when it shares a batch with others: they are answered.
//
// Not parallel: RaiseOrderIDLimit changes a package variable, which the
// parallel tests read (they run only once this one has ended).
func TestARefusedAuthorizationFailsAloneInItsBatch(t *testing.T) {
	pagaments.RaiseOrderIDLimit(t, 20_000) // past Authorize's own bound, so that PostgreSQL refuses it
	b := setup(t, passarella.Faults{})
	s := b.service(t, time.Second)
	ctx := context.Background()
	// Hold both batch writers on a row lock, so that the next calls queue
	// up and go in one batch together when it is released.
	tx, err := b.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // after Commit, a no-op
	if _, err := tx.Exec(ctx, `INSERT INTO autoritzacions (comanda_id, import_centims, aprovada) VALUES ('BLOC', 1, true)`); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for w := 1; w <= 2; w++ { // one after the other, so that each goes in a batch of its own
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := s.Authorize(ctx, []byte(`{"comanda_id":"BLOC","import_centims":1}`)); err != nil {
				t.Error(err)
			}
		}()
		testkit.Eventually(t, 20*time.Second, fmt.Sprintf("%d batch writers waiting on the lock", w), func() bool {
			var n int
			_ = b.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%INSERT INTO autoritzacions%'`).Scan(&n)
			return n == w
		})

	}
	const good = 20
	errs := make([]error, good+1)
	for i := range good + 1 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id := fmt.Sprintf("D-%d", i)
			if i == good {
				raw := make([]byte, 5000)
				_, _ = rand.Read(raw)
				id = hex.EncodeToString(raw) // incompressible, over btree's limit for an index row
			}
			_, errs[i] = s.Authorize(ctx, []byte(fmt.Sprintf(`{"comanda_id":%q,"import_centims":1000}`, id)))
		}()
	}
	testkit.Eventually(t, 20*time.Second, "the calls queued for one batch", func() bool { return pagaments.QueuedAuthorizations(s) == good+1 })
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	for i, err := range errs[:good] {
		if err != nil {
			t.Errorf("good request %d failed with the bad one: %v", i, err)
		}
	}
	if !outcome.IsPermanent(errs[good]) || strings.Contains(errs[good].Error(), "SQLSTATE") {
		t.Fatalf("the over-long order id: %v; want a permanent error that does not quote PostgreSQL", errs[good])
	}
}
