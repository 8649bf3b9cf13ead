package main

import (
	"context"
	"testing"
	"time"
)

// `km0 serve foo` names the unknown service before it asks for a database
// (none is configured here: the database error would come first otherwise).
func TestServeUnknownServiceIsNamedBeforeTheDatabase(t *testing.T) {
	t.Setenv("KM0_DATABASE_URL", "")
	t.Setenv("KM0_FOO_DATABASE_URL", "")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := runServe(ctx, []string{"foo", "--brokers", "127.0.0.1:1"})
	want := `unknown service "foo": NAME is one of comandes, inventari, pagaments, repartiment, analitica, cataleg`
	if err == nil || err.Error() != want {
		t.Fatalf("km0 serve foo: %v, want %q", err, want)
	}
}

// `--http` names a server this process runs, or it is refused before any
// database is asked: pagaments has no HTTP API, and a service another
// process runs would otherwise be silently ignored.
func TestHTTPAddrsNamesOnlyServersThisProcessRuns(t *testing.T) {
	t.Setenv("KM0_DATABASE_URL", "")
	for _, c := range []struct {
		cmd      string
		services []string
		http     string
		want     string
	}{
		{"up", []string{"comandes", "inventari", "pagaments", "repartiment", "analitica", "cataleg"}, "pagaments=:8082",
			`--http "pagaments=:8082": pagaments has no HTTP API (it consumes events and answers authorisations over request/reply); NAME is one of comandes, inventari, repartiment, analitica, cataleg, passarella, mapes`},
		{"serve cataleg", []string{"cataleg"}, "comandes=:8080", `--http "comandes=:8080": comandes does not run in this process (it runs cataleg)`},
		{"serve cataleg", []string{"cataleg"}, "mapes=:8085", `--http "mapes=:8085": mapes does not run in this process (it runs cataleg)`},
		{"up", []string{"comandes"}, "comandes=:1,comandes=:2", `--http "comandes=:2": comandes given twice`},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := runServices(ctx, c.cmd, c.services, []string{"--brokers", "127.0.0.1:1", "--http", c.http})
		cancel()
		if err == nil || err.Error() != c.want {
			t.Errorf("km0 %s --http %s: %v, want %q", c.cmd, c.http, err, c.want)
		}
	}
	addrs, err := parseHTTPAddrs("comandes=:8080, mapes=:8085,passarella=:8086", []string{"comandes", "pagaments", "repartiment"}, "")
	if err != nil || len(addrs) != 3 || addrs["mapes"] != ":8085" {
		t.Fatalf("valid --http: %v %v", addrs, err)
	}
	if _, err := parseHTTPAddrs("passarella=:8086", []string{"pagaments"}, "http://gw"); err == nil {
		t.Fatal("passarella with --gateway-url: nil error")
	}
}
