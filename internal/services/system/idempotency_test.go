package system_test

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/system"
)

type reply struct {
	status int
	body   string
}

func postOrder(t *testing.T, base, key, body string) reply {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, base+"/comandes", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Error(err)
		return reply{}
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return reply{resp.StatusCode, string(b)}
}

// Two submissions of one order with one Idempotency-Key, the second a random
// moment after the first, while comandes asks pagaments to authorise the
// order over request/reply (Kafka): the second answer is the first answer,
// status and body, whichever point of the first request it lands on (before
// its authorisation, during it, during its commit, after it). 300 pairs, a
// few in flight at once; every fifth order is over the authorisation limit
// (a 402, stored under the key like a 201).
func TestSameKeyPairsUnderAuthorisationGetTheFirstAnswer(t *testing.T) {
	t.Parallel()
	sys, _ := startWith(t, []string{comandes.Name, pagaments.Name}, func(c *system.Config) { c.Authorize = true })
	t.Cleanup(sys.Close)
	base := sys.Addrs()[comandes.Name]
	order := func(i int) string {
		price := 1000
		if i%5 == 4 {
			price = int(pagaments.AuthLimitCentsDefault) + 1
		}
		return fmt.Sprintf(`{"id":"P-2026-%06d","client":"anna","mercat":"girona","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":%d}]}`, i, price)
	}
	// Warm up (the first request/reply round trip creates the reply topic)
	// and measure how long one order takes: the seconds land over that span.
	var took []time.Duration
	for i := range 9 {
		start := time.Now()
		if r := postOrder(t, base, fmt.Sprintf("k-escalfament-%d", i), order(999990-5*i)); r.status != http.StatusCreated {
			t.Fatalf("warm-up: %d %s", r.status, r.body)
		}
		took = append(took, time.Since(start))
	}
	slices.Sort(took)
	span := took[len(took)/2] * 5 / 4
	t.Logf("one order takes %v (median of %d); seconds land within %v of the first", took[len(took)/2], len(took), span)
	const pairs, inFlight = 300, 4
	var (
		wg       sync.WaitGroup
		sem      = make(chan struct{}, inFlight)
		mu       sync.Mutex
		mismatch []string
		statuses = map[int]int{}
	)
	for i := range pairs {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			key, body := fmt.Sprintf("k-%d", i), order(i)
			var first, second reply
			var pair sync.WaitGroup
			pair.Go(func() { first = postOrder(t, base, key, body) })
			pair.Go(func() {
				time.Sleep(rand.N(span)) // where the second lands in the first's run
				second = postOrder(t, base, key, body)
			})
			pair.Wait()
			mu.Lock()
			defer mu.Unlock()
			statuses[first.status]++
			if first != second {
				mismatch = append(mismatch, fmt.Sprintf("%s: %d %s / %d %s", key, first.status, first.body, second.status, second.body))
			}
		})
	}
	wg.Wait()
	if len(mismatch) > 0 {
		t.Fatalf("%d of %d pairs got two different answers, e.g.\n%s", len(mismatch), pairs, strings.Join(mismatch[:min(5, len(mismatch))], "\n"))
	}
	if statuses[http.StatusCreated] != pairs-pairs/5 || statuses[http.StatusPaymentRequired] != pairs/5 {
		t.Fatalf("first answers %v, want %d × 201 and %d × 402", statuses, pairs-pairs/5, pairs/5)
	}
	ctx := context.Background()
	var orders, events int
	pool := sys.Pool(comandes.Name)
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM comandes`).Scan(&orders); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE tipus = 'comanda.creada'`).Scan(&events); err != nil {
		t.Fatal(err)
	}
	if want := pairs - pairs/5 + len(took); orders != want || events != want {
		t.Fatalf("%d orders and %d comanda.creada, want %d of each", orders, events, want)
	}
}
