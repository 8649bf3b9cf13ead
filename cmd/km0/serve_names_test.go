package main

import (
	"context"
	"strings"
	"testing"
	"time"
)

// `km0 serve foo` names the unknown service before it asks for a database
// (none is configured here: the database error would come first otherwise).
//
// Not parallel: t.Setenv, for the environment runServe (the database URLs)
// reads in this process.
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
//
// Not parallel: t.Setenv, for the environment runServices ($KM0_DATABASE_URL)
// reads in this process.
func TestHTTPAddrsNamesOnlyServersThisProcessRuns(t *testing.T) {
	t.Setenv("KM0_DATABASE_URL", "")
	for _, c := range []struct {
		cmd      string
		services []string
		http     string
		want     string
	}{
		{"up", []string{"comandes", "inventari", "pagaments", "repartiment", "analitica", "cataleg"}, "pagaments=:8082",
			`--http-addr "pagaments=:8082": pagaments has no HTTP API (it consumes events and answers authorisations over request/reply); NAME is one of comandes, inventari, repartiment, analitica, cataleg, passarella, mapes`},
		{"serve cataleg", []string{"cataleg"}, "comandes=:8080", `--http-addr "comandes=:8080": comandes does not run in this process (it runs cataleg)`},
		{"serve cataleg", []string{"cataleg"}, "mapes=:8085", `--http-addr "mapes=:8085": mapes does not run in this process (it runs cataleg)`},
		{"up", []string{"comandes"}, "comandes=:1,comandes=:2", `--http-addr "comandes=:2": comandes given twice`},
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

// An error of one service carries one prefix, the service's, after the
// command's own (main prints "km0 up: "): not "system: comandes: svc: …".
// A configuration error carries none (not "system: …"), and names the known
// values as a list, not a printed Go slice.
//
// Not parallel: t.Setenv, for the environment runServices
// ($KM0_COMANDES_DATABASE_URL) reads in this process.
func TestUpErrorHasOnePrefixPerLayer(t *testing.T) {
	t.Setenv("KM0_COMANDES_DATABASE_URL", "")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := runServices(ctx, "up", []string{"comandes"}, []string{"--database-url", "postgres://postgres@127.0.0.1:1/postgres", "--embedded-kafka"})
	const want = "comandes: connect to postgres://postgres@127.0.0.1:1/postgres: failed to connect to `user=postgres database=postgres`"
	if err == nil || !strings.HasPrefix(err.Error(), want) || strings.Contains(err.Error(), "system:") || strings.Contains(err.Error(), "svc:") {
		t.Fatalf("km0 up with a server that refuses: %v, want it to start %q with no system: or svc: prefix", err, want)
	}
	for _, c := range []struct{ flag, value, want string }{
		{"--topics", "nope=x", `rename of unknown topic "nope" (known: comandes.esdeveniments, inventari.esdeveniments, pagaments.esdeveniments, repartiment.esdeveniments)`},
		{"--groups", "nope=x", `rename of unknown consumer group "nope" (known: comandes.confirmacio_pagament, inventari.descompte_estoc, ` +
			`pagaments.cobrament, repartiment.assignacio, analitica.comptadors, cataleg.estoc_baix, comandes.refus_estoc, comandes.repartiment)`},
		{"--topics", "comandes.esdeveniments=a/b", `topic comandes.esdeveniments renamed to "a/b": a topic name is 1 to 243 of a-z A-Z 0-9 . _ -`},
	} {
		err := runServices(ctx, "up", []string{"comandes"}, []string{"--database-url", "postgres://postgres@127.0.0.1:1/postgres", "--embedded-kafka", c.flag, c.value})
		if err == nil || err.Error() != c.want {
			t.Errorf("km0 up %s %s: %v, want %q (main adds \"km0 up: \")", c.flag, c.value, err, c.want)
		}
	}
}
