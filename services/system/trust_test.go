package system_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/kafkarr"
	"github.com/km0/km0/services/comandes"
	"github.com/km0/km0/services/internal/svctest"
	"github.com/km0/km0/services/pagaments"
	"github.com/km0/km0/services/system"
)

// The trust boundary of pagaments.autoritzacions, end to end (Kafka):
// with KM0_RR_HMAC_KEY set, a request published without the key is refused
// and decides nothing, so the real order is authorised; and a request that
// does carry the key (an insider) with another amount makes the real order a
// 409 that is not stored under its Idempotency-Key, never the other request's
// decision.
func TestForgedAuthorisationsDecideNoOrder(t *testing.T) {
	key := "clau-de-prova-compartida"
	t.Setenv(requestreply.SigningKeyEnv, key)
	sys, b := startWith(t, []string{comandes.Name, pagaments.Name}, func(c *system.Config) { c.Authorize = true })
	t.Cleanup(sys.Close)
	base := sys.Addrs()[comandes.Name]
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	forge := func(signingKey []byte, order string, cents string) error {
		cl, err := kafkarr.NewClient(ctx, kafkarr.ClientConfig{Brokers: b.Addrs(), Timeout: 20 * time.Second, SigningKey: signingKey})
		if err != nil {
			t.Fatal(err)
		}
		defer cl.Close()
		_, err = cl.Request(ctx, pagaments.AuthQueue, "autoritzacio-"+order, []byte(`{"comanda_id":"`+order+`","import_centims":`+cents+`}`))
		return err
	}
	order := func(id string) string {
		return `{"id":"` + id + `","client":"anna","mercat":"girona","linies":[{"producte":"carbasso","quantitat":1,"preu_centims":100}]}`
	}

	// Without the key: refused, nothing stored, the real order is approved.
	var re *requestreply.RemoteError
	if err := forge(nil, "P-2026-000951", "999999999"); !errors.As(err, &re) || re.Message != requestreply.ErrUnauthenticated.Error() {
		t.Fatalf("unsigned forged request: %v, want ErrUnauthenticated", err)
	}
	if err := forge([]byte("una-altra-clau"), "P-2026-000951", "999999999"); !errors.As(err, &re) || re.Message != requestreply.ErrUnauthenticated.Error() {
		t.Fatalf("forged request signed with another key: %v, want ErrUnauthenticated", err)
	}
	if r := postOrder(t, base, "k-951", order("P-2026-000951")); r.status != http.StatusCreated {
		t.Fatalf("the real order after unsigned forgeries: %d %s, want 201", r.status, r.body)
	}

	// With the key and another amount first: a conflict, a 409 on every try,
	// nothing stored under the key.
	if err := forge([]byte(key), "P-2026-000952", "1"); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		r := postOrder(t, base, "k-952", order("P-2026-000952"))
		if r.status != http.StatusConflict || !strings.Contains(r.body, "autorització diferent") {
			t.Fatalf("the real order after a pre-approval of 1 cent: %d %s, want 409", r.status, r.body)
		}
	}
	if n := svctest.Count(t, sys.Pool(comandes.Name), "SELECT count(*) FROM peticions_idempotents WHERE clau = 'k-952'"); n != 0 {
		t.Fatalf("the conflict was stored under the order's Idempotency-Key")
	}
	if n := svctest.Count(t, sys.Pool(comandes.Name), "SELECT count(*) FROM comandes"); n != 1 {
		t.Fatalf("%d orders, want 1 (P-2026-000951)", n)
	}
}
