package pgcluster_test

import (
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/pgcluster"
	"github.com/km0/km0/internal/tlstest"
)

// A cluster with Options.TLS takes TCP connections over TLS only: its URL
// (sslmode=verify-full with the test CA) is encrypted, plain TCP and another
// CA are refused naming the cause, and a CertUsers role authenticates with
// a client certificate of its name, and not without one or with another's;
// a PasswordUsers role authenticates with its password only.
func TestClusterWithTLSVerifiesBothWays(t *testing.T) {
	ca := tlstest.NewCA(t, "km0 test CA")
	srv := ca.Server(t, "127.0.0.1", "localhost")
	c, err := pgcluster.Start(pgcluster.Options{TLS: &pgcluster.TLS{CertFile: srv.CertFile, KeyFile: srv.KeyFile, CAFile: ca.CertFile,
		CertUsers: []string{"km0_cert"}, PasswordUsers: []string{"km0_pw"}}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	connect := func(u string) (*pgx.Conn, error) {
		conn, err := pgx.Connect(ctx, u)
		if err == nil {
			t.Cleanup(func() { conn.Close(context.Background()) })
		}
		return conn, err
	}
	admin, err := connect(c.URL)
	if err != nil {
		t.Fatal(err)
	}
	var ssl bool
	if err := admin.QueryRow(ctx, "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").Scan(&ssl); err != nil || !ssl {
		t.Fatalf("the cluster's URL: ssl = %v (%v), want true", ssl, err)
	}
	for _, q := range []string{"CREATE ROLE km0_cert LOGIN", "CREATE ROLE km0_pw LOGIN PASSWORD 'secret-pw'"} {
		if _, err := admin.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	pwURL := func(pw string) string { return strings.Replace(c.URL, "postgres@", "km0_pw:"+pw+"@", 1) }
	with := func(params map[string]string) string {
		u, _ := url.Parse(c.URL)
		q := u.Query()
		for k, v := range params {
			q.Set(k, v)
		}
		u.RawQuery = q.Encode()
		return u.String()
	}
	other := tlstest.NewCA(t, "another CA")
	mine, theirs := ca.Client(t, "km0_cert"), ca.Client(t, "km0_other")
	certURL := func(p tlstest.Pair) string {
		u := with(map[string]string{"sslcert": p.CertFile, "sslkey": p.KeyFile})
		return strings.Replace(u, "postgres@", "km0_cert@", 1)
	}
	for _, f := range []struct {
		name, url, want string
	}{
		{"plain TCP", with(map[string]string{"sslmode": "disable"}), "no encryption"},
		{"another CA", with(map[string]string{"sslrootcert": other.CertFile}), "certificate signed by unknown authority"},
		{"no client certificate", strings.Replace(c.URL, "postgres@", "km0_cert@", 1), "certificate"},
		{"another user's certificate", certURL(theirs), "certificate authentication failed for user \"km0_cert\""},
		{"a wrong password", pwURL("wrong"), "password authentication failed for user \"km0_pw\""},
		{"no password", strings.Replace(c.URL, "postgres@", "km0_pw@", 1), "password"},
	} {
		if _, err := connect(f.url); err == nil || !strings.Contains(err.Error(), f.want) {
			t.Errorf("%s: want an error naming %q, got %v", f.name, f.want, err)
		}
	}
	if _, err := connect(pwURL("secret-pw")); err != nil {
		t.Fatalf("the right password: %v", err)
	}
	conn, err := connect(certURL(mine))
	if err != nil {
		t.Fatalf("client certificate: %v", err)
	}
	var user string
	if err := conn.QueryRow(ctx, "SELECT current_user").Scan(&user); err != nil || user != "km0_cert" {
		t.Fatalf("client certificate: current_user = %q (%v), want km0_cert", user, err)
	}
}
