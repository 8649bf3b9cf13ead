package comandes_test

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/internal/svctest"
	"github.com/km0/km0/internal/services/inventari"
)

// An order comandes cannot serve (a product inventari does not have) is a 400
// naming the line and the product, before pagaments is asked: nothing is
// stored, authorised or charged, with or without an Idempotency-Key.
func TestUnknownProductIs400NamingItAndStoresNothing(t *testing.T) {
	t.Parallel()
	var asked atomic.Int64
	b := setup(t, authFunc(func(context.Context, string, int64) error { asked.Add(1); return nil }))
	unicorn := strings.Replace(good, `"producte":"carbasso"`, `"producte":"unicorn"`, 1)
	for _, key := range []string{"", "k-unicorn"} {
		status, out := b.post(t, key, unicorn)
		msg, _ := out["error"].(string)
		if status != http.StatusBadRequest || out["camp"] != "linies[1].producte" || !strings.Contains(msg, `"unicorn"`) {
			t.Fatalf("key %q: %d %v, want 400 naming linies[1].producte and unicorn", key, status, out)
		}
	}
	if n := asked.Load(); n != 0 {
		t.Fatalf("pagaments asked %d times for an order that cannot be served", n)
	}
	for _, table := range []string{"comandes", "outbox", "peticions_idempotents"} {
		if n := svctest.Count(t, b.pool, "SELECT count(*) FROM "+table); n != 0 {
			t.Fatalf("%d rows in %s, want 0", n, table)
		}
	}
	// Known products are accepted, however little stock they have: running
	// out is inventari's business, after acceptance.
	if status, out := b.post(t, "", good); status != http.StatusCreated {
		t.Fatalf("known products: %d %v", status, out)
	}
}

// comandes' default catalogue is what inventari stocks from its first
// migration.
func TestProductsDefaultIsInventarisSeed(t *testing.T) {
	t.Parallel()
	want := make([]string, 0, len(inventari.InitialStock))
	for p := range inventari.InitialStock {
		want = append(want, p)
	}
	got := slices.Clone(comandes.ProductsDefault)
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("ProductsDefault %v, inventari's seed %v", got, want)
	}
}

// pagaments answers a conflict when it holds another authorisation for the
// order id (someone asked first with another amount). That is a 409, not the
// other request's decision and not a 503; it is never stored under the
// Idempotency-Key, so the key's retry asks again once the conflict is gone.
func TestAuthorisationConflictIs409AndNotStoredUnderTheKey(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	conflict := true
	b := setup(t, authFunc(func(context.Context, string, int64) error {
		mu.Lock()
		defer mu.Unlock()
		if conflict {
			return fmt.Errorf("conflict: the order already holds an authorisation for another amount: %w", comandes.ErrAuthConflict)
		}
		return nil
	}))
	for _, key := range []string{"", "k-conflicte"} {
		if status, out := b.post(t, key, good); status != http.StatusConflict || out["camp"] != "id" || out["codi"] != "autoritzacio_en_conflicte" {
			t.Fatalf("key %q: %d %v, want 409 autoritzacio_en_conflicte on id", key, status, out)
		}
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM peticions_idempotents"); n != 0 {
		t.Fatalf("the conflict was stored under the key (%d rows)", n)
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM comandes"); n != 0 {
		t.Fatalf("%d orders, want 0", n)
	}
	mu.Lock()
	conflict = false
	mu.Unlock()
	if status, out := b.post(t, "k-conflicte", good); status != http.StatusCreated {
		t.Fatalf("retry with the key: %d %v, want 201 (the conflict was not replayed)", status, out)
	}
}
