package pagaments_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/inbox"
	"github.com/km0/km0/internal/faults"
	"github.com/km0/km0/internal/services/internal/svctest"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/pagaments/passarella"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/requestreply"
)

type bundle struct {
	pool *pgxpool.Pool
	gw   *passarella.Server
	url  string
}

func setup(t *testing.T, gwFaults passarella.Faults) *bundle {
	t.Helper()
	pool, _ := svctest.DB(t, migrate.Outbox, migrate.Inbox, pagaments.Migrations)
	if _, err := migrate.Up(context.Background(), pool, migrate.Names{Schema: passarella.SchemaDefault}, passarella.Migrations); err != nil {
		t.Fatal(err)
	}
	gw, err := passarella.New(passarella.Config{Pool: pool, Faults: gwFaults})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(gw.Handler())
	t.Cleanup(srv.Close)
	return &bundle{pool: pool, gw: gw, url: srv.URL}
}

func (b *bundle) service(t *testing.T, timeout time.Duration) *pagaments.Service {
	t.Helper()
	s, err := pagaments.New(pagaments.Config{Pool: b.pool, Outbox: svctest.Outbox(t), Gateway: &passarella.Client{BaseURL: b.url, APIKey: b.gw.APIKey(), Timeout: timeout}})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

var anna = map[string]any{"id": "P-2026-000123", "client": "anna", "mercat": "girona",
	"linies": []map[string]any{{"producte": "formatge-curat", "quantitat": 2, "preu_centims": 1450}}}

func TestCrashBetweenGatewayCallAndCommitChargesOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, passarella.Faults{})
	var crashes atomic.Int32
	s := b.service(t, time.Second)
	ctx := faults.WithPayments(context.Background(), faults.Payments{AfterCharge: func(string) error {
		// Crash point: the gateway has charged, the transaction has not committed.
		if crashes.Add(1) == 1 {
			return errors.New("simulated crash after the gateway call, before COMMIT")
		}
		return nil
	}})
	m := svctest.Message(t, "comandes.esdeveniments", "comanda.creada", 2, anna)
	ib := inbox.New(inbox.Config{})
	run := func() (inbox.Result, error) {
		return ib.Process(ctx, b.pool, pagaments.ConsumerCharge, m.Envelope.ID, func(tx pgx.Tx) error {
			return s.HandleOrderCreated(ctx, tx, m)
		})
	}
	if _, err := run(); err == nil {
		t.Fatal("the first attempt should have died")
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM pagaments"); n != 0 {
		t.Fatalf("the dead attempt left %d payments", n)
	}
	for i, want := range []inbox.Result{inbox.Processed, inbox.Duplicate} {
		if res, err := run(); err != nil || res != want {
			t.Fatalf("redelivery %d: %v %v", i, res, err)
		}
	}
	// The same order in another event (a producer retry with a new id) is not paid twice either.
	other := svctest.Message(t, "comandes.esdeveniments", "comanda.creada", 2, anna)
	if err := svctest.Run(t, b.pool, s.HandleOrderCreated, other); err != nil {
		t.Fatal(err)
	}
	charges, err := b.gw.Charges(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	c := charges["cobrament-P-2026-000123"]
	if len(charges) != 1 || c.TotalCents != 2900 || c.Calls != 3 {
		t.Fatalf("gateway charges %+v, want one of 2900 after 3 calls", charges)
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM pagaments WHERE import_centims = 2900 AND ref_passarella = $1", c.Ref); n != 1 {
		t.Fatalf("payments with the gateway ref: %d, want 1", n)
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM outbox WHERE tipus = 'pagament.confirmat' AND agregat = 'pagament' AND agregat_id = 'P-2026-000123'"); n != 1 {
		t.Fatalf("pagament.confirmat rows %d, want 1", n)
	}
}

func TestGatewayFailureAndHangAreTransientAndNeverChargeTwice(t *testing.T) {
	t.Parallel()
	b := setup(t, passarella.Faults{
		Fail:    func(key string, attempt int) bool { return strings.HasSuffix(key, "000001") && attempt == 1 },
		Hang:    func(key string, attempt int) bool { return strings.HasSuffix(key, "000002") && attempt == 1 },
		HangFor: 5 * time.Second,
	})
	s := b.service(t, 300*time.Millisecond)
	for _, id := range []string{"P-2026-000001", "P-2026-000002"} {
		o := map[string]any{"id": id, "linies": []map[string]any{{"quantitat": 1, "preu_centims": 500}}}
		m := svctest.Message(t, "comandes.esdeveniments", "comanda.creada", 1, o)
		err := svctest.Run(t, b.pool, s.HandleOrderCreated, m)
		if k, _ := outcome.Classify(err, nil); k != outcome.KindTransient || !errors.Is(err, passarella.ErrUnavailable) {
			t.Fatalf("%s first attempt: %v, want transient unavailable", id, err)
		}
		m.Attempt = 2
		if err := svctest.Run(t, b.pool, s.HandleOrderCreated, m); err != nil {
			t.Fatalf("%s retry: %v", id, err)
		}
	}
	st := b.gw.Stats()
	if st.Failed != 1 || st.Hung != 1 || st.Charged != 2 || st.Replayed != 1 {
		t.Fatalf("gateway stats %+v: want 1 failed, 1 hung (charged), 2 charges, 1 replay", st)
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM pagaments"); n != 2 {
		t.Fatalf("payments %d, want 2", n)
	}
}

func TestGatewayRejectsMissingKeyAndReusedKey(t *testing.T) {
	t.Parallel()
	b := setup(t, passarella.Faults{})
	req, _ := http.NewRequest(http.MethodPost, b.url+"/cobraments", strings.NewReader(`{"comanda_id":"P-2026-000001","import_centims":1}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+b.gw.APIKey())
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("no key: %v %v", resp.StatusCode, err)
	}
	cl := &passarella.Client{BaseURL: b.url, APIKey: b.gw.APIKey()}
	if _, err := cl.Charge(context.Background(), "cobrament-P-2026-000001", "P-2026-000001", 100); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Charge(context.Background(), "cobrament-P-2026-000001", "P-2026-000001", 999); !errors.Is(err, passarella.ErrRefused) {
		t.Fatalf("reused key with another amount: %v", err)
	}
	// A refusal is permanent for the charging handler.
	s := b.service(t, time.Second)
	bad := map[string]any{"id": "P-2026-000001", "linies": []map[string]any{{"quantitat": 3, "preu_centims": 1}}}
	if err := svctest.Run(t, b.pool, s.HandleOrderCreated, svctest.Message(t, "c", "comanda.creada", 1, bad)); !outcome.IsPermanent(err) || !strings.Contains(err.Error(), "targeta_refusada") {
		t.Fatalf("refused charge: %v", err)
	}
	if err := svctest.Run(t, b.pool, s.HandleOrderCreated, svctest.Message(t, "c", "comanda.creada", 1, map[string]any{"id": 5})); !outcome.IsPermanent(err) {
		t.Fatalf("malformed: %v", err)
	}
}

// An amount that overflows int64 is bad data: it must not wrap into a small
// (here zero) charge that confirms the order as paid.
func TestOverflowingAmountIsPermanentAndChargesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t, passarella.Faults{})
	s := b.service(t, time.Second)
	for i, lines := range [][]map[string]any{
		{{"quantitat": int64(1) << 62, "preu_centims": 4}},                                                   // product wraps to 0
		{{"quantitat": 2, "preu_centims": int64(1) << 62}, {"quantitat": 2, "preu_centims": int64(1) << 62}}, // each 2^63 > max
		{{"quantitat": -1, "preu_centims": -5}},                                                              // negative × negative
	} {
		o := map[string]any{"id": fmt.Sprintf("P-2026-00077%d", i), "linies": lines}
		if err := svctest.Run(t, b.pool, s.HandleOrderCreated, svctest.Message(t, "c", "comanda.creada", 1, o)); !outcome.IsPermanent(err) {
			t.Errorf("case %d: %v, want permanent", i, err)
		}
	}
	if st := b.gw.Stats(); st.Requests != 0 {
		t.Fatalf("gateway asked %d times, want 0", st.Requests)
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM pagaments"); n != 0 {
		t.Fatalf("payments %d, want 0", n)
	}
}

func TestAuthorizeDecidesOncePerOrder(t *testing.T) {
	t.Parallel()
	b := setup(t, passarella.Faults{})
	s := b.service(t, time.Second)
	ctx := context.Background()
	ask := func(body string) pagaments.AuthResponse {
		t.Helper()
		out, err := s.Authorize(ctx, []byte(body))
		if err != nil {
			t.Fatal(err)
		}
		var r pagaments.AuthResponse
		if err := json.Unmarshal(out, &r); err != nil {
			t.Fatal(err)
		}
		return r
	}
	if r := ask(`{"comanda_id":"P-2026-000001","import_centims":1000}`); !r.Approved {
		t.Fatalf("small amount refused: %+v", r)
	}
	if r := ask(`{"comanda_id":"P-2026-000002","import_centims":900000}`); r.Approved || !strings.HasPrefix(r.Reason, "import_excessiu") {
		t.Fatalf("large amount: %+v", r)
	}
	// The decision is stored: asking again for the same order gives the same answer.
	if r := ask(`{"comanda_id":"P-2026-000002","import_centims":900000}`); r.Approved || !strings.HasPrefix(r.Reason, "import_excessiu") {
		t.Fatalf("repeat changed the answer: %+v", r)
	}
	if r := ask(`{"comanda_id":"P-2026-000001","import_centims":1000}`); !r.Approved {
		t.Fatalf("repeat of the approved request: %+v", r)
	}
	if _, err := s.Authorize(ctx, []byte(`{"import_centims":"x"}`)); !outcome.IsPermanent(err) {
		t.Fatalf("malformed: %v", err)
	}
}

// Whoever asks first for an order id must not decide the real order's
// answer: a request with another amount than the stored decision's (a forged
// 999999999 before the real 100, or a pre-approved 1 cent) is refused as a
// conflict, a non-retryable error reply, and the stored decision stays.
func TestAuthorizeRefusesAnotherAmountAsAConflict(t *testing.T) {
	t.Parallel()
	b := setup(t, passarella.Faults{})
	s := b.service(t, time.Second)
	ctx := context.Background()
	log := slog.New(slog.DiscardHandler)
	serve := func(body string) ([]byte, error) {
		out, isErr := requestreply.Serve(ctx, log, func(ctx context.Context, r *requestreply.Request) ([]byte, error) {
			return s.Authorize(ctx, r.Body)
		}, &requestreply.Request{ID: "x", Body: []byte(body)})
		return requestreply.DecodeReply(pagaments.AuthQueue, map[bool]string{true: requestreply.ResultError, false: requestreply.ResultOK}[isErr], out)
	}
	for _, forged := range []struct{ order, first, real string }{
		{"P-2026-000951", "999999999", "100"}, // forged refusal first
		{"P-2026-000952", "1", "100"},         // forged approval of 1 cent first
	} {
		if _, err := serve(`{"comanda_id":"` + forged.order + `","import_centims":` + forged.first + `}`); err != nil {
			t.Fatal(err)
		}
		_, err := serve(`{"comanda_id":"` + forged.order + `","import_centims":` + forged.real + `}`)
		var re *requestreply.RemoteError
		if !errors.As(err, &re) || !errors.Is(err, requestreply.ErrConflict) || re.Retryable || !strings.HasPrefix(re.Message, "conflict: ") ||
			strings.Contains(re.Message, forged.first) {
			t.Fatalf("%s: the real request after a forged one got %v; want a non-retryable conflict that does not reveal the stored amount", forged.order, err)
		}
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM autoritzacions"); n != 2 {
		t.Fatalf("%d stored decisions, want 2 (a conflict stores nothing)", n)
	}
}

// Ids PostgreSQL would refuse (NUL, invalid UTF-8, over 8 KB) are refused
// before any SQL: a permanent error reply with a clear message and nothing
// of PostgreSQL in it.
func TestAuthorizeRefusesBadOrderIDsPermanentlyWithoutDatabaseText(t *testing.T) {
	t.Parallel()
	b := setup(t, passarella.Faults{})
	s := b.service(t, time.Second)
	ctx := context.Background()
	log := slog.New(slog.DiscardHandler)
	for _, id := range []string{`P-2026-\u0000951`, `P-2026-\u0007`, `P-2026-` + strings.Repeat("9", 8<<10)} {
		out, isErr := requestreply.Serve(ctx, log, func(ctx context.Context, r *requestreply.Request) ([]byte, error) {
			return s.Authorize(ctx, r.Body)
		}, &requestreply.Request{ID: "x", Body: []byte(`{"comanda_id":"` + id + `","import_centims":100}`)})
		_, err := requestreply.DecodeReply(pagaments.AuthQueue, requestreply.ResultError, out)
		var re *requestreply.RemoteError
		if !isErr || !errors.As(err, &re) || re.Retryable || !strings.Contains(re.Message, "comanda_id") ||
			strings.Contains(re.Message, "SQLSTATE") || strings.Contains(re.Message, "ERROR") {
			t.Errorf("id %.20q: got %s; want a permanent refusal naming comanda_id", id, out)
		}
	}
	if n := svctest.Count(t, b.pool, "SELECT count(*) FROM autoritzacions"); n != 0 {
		t.Fatalf("%d stored decisions, want 0", n)
	}
}

// The gateway answers a key or comanda_id PostgreSQL would refuse (a NUL,
// invalid UTF-8, too long) with 400, bad input, never 503 "unavailable"
// (which makes its callers retry); and the charging handler refuses such an
// order id permanently without calling the gateway.
func TestBadIDsAre400AtTheGatewayAndPermanentInTheCharge(t *testing.T) {
	t.Parallel()
	b := setup(t, passarella.Faults{})
	for _, c := range []struct{ key, body, want string }{
		{"cobrament-P-2026-000001", `{"comanda_id":"P-2026-\u0000001","import_centims":1}`,
			`{"error":"up to 200 bytes of UTF-8 without control characters (NUL included)","codi":"camp_invalid","camp":"comanda_id"}`},
		{"cobrament-P-2026-000001", `{"comanda_id":"` + strings.Repeat("P", 8<<10) + `","import_centims":1}`,
			`{"error":"expected {comanda_id, import_centims ≥ 0}","codi":"camp_invalid","camp":"cos"}`},
		{"cobrament-\xff", `{"comanda_id":"P-2026-000001","import_centims":1}`,
			`{"error":"required: up to 200 bytes of UTF-8 without control characters","codi":"clau_idempotencia_invalida","camp":"Idempotency-Key"}`},
	} {
		req, _ := http.NewRequest(http.MethodPost, b.url+"/cobraments", strings.NewReader(c.body))
		req.Header["Idempotency-Key"] = []string{c.key}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer "+b.gw.APIKey())
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest || strings.TrimSpace(string(body)) != c.want {
			t.Errorf("key %.20q body %.40s: %d %s, want 400 %s", c.key, c.body, resp.StatusCode, body, c.want)
		}
	}
	s := b.service(t, time.Second)
	nul := map[string]any{"id": "P-2026-\x00001", "linies": []map[string]any{{"quantitat": 1, "preu_centims": 1}}}
	if err := svctest.Run(t, b.pool, s.HandleOrderCreated, svctest.Message(t, "c", "comanda.creada", 1, nul)); !outcome.IsPermanent(err) || !strings.Contains(err.Error(), "esquema") {
		t.Fatalf("order id with a NUL: %v, want permanent esquema", err)
	}
	if st := b.gw.Stats(); st.Charged != 0 {
		t.Fatalf("%d charges, want 0", st.Charged)
	}
}
