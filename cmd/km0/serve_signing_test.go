package main

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/pgtest"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/requestreply"
)

// testSigningKeyEnv gives the km0 processes of the tests a shared signing key.
const testSigningKeyEnv = requestreply.SigningKeyEnv + "=clau-de-prova-dels-processos-km0"

// Without a signing key, `km0 serve pagaments` and `km0 serve comandes
// --authorize` refuse to start (ErrConfig, naming the variable and the flag
// that accepts unsigned requests), and so does any with a 16-byte key;
// `km0 serve comandes` without --authorize needs none (checked by the rest
// of the configuration, which then fails on the unreachable database).
//
// Not parallel: t.Setenv, for the environment runServe (the signing key, the
// database URL) reads in this process.
func TestServeRefusesToStartWithoutASigningKey(t *testing.T) {
	t.Setenv("KM0_DATABASE_URL", "")
	own := []string{"--service-database-url", "postgres://postgres@127.0.0.1:1/qualsevol", "--brokers", "127.0.0.1:1"}
	for _, c := range []struct {
		key  string
		args []string
		want []string
	}{
		{"", append([]string{"pagaments"}, own...), []string{requestreply.SigningKeyEnv, "--accept-unsigned-requests"}},
		{"", append([]string{"comandes", "--authorize"}, own...), []string{requestreply.SigningKeyEnv, "--accept-unsigned-requests"}},
		{strings.Repeat("k", 16), append([]string{"pagaments"}, own...), []string{"16 bytes"}},
	} {
		t.Setenv(requestreply.SigningKeyEnv, c.key)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := runServe(ctx, c.args)
		cancel()
		if !errors.Is(err, system.ErrConfig) {
			t.Fatalf("km0 serve %s (key of %d bytes): %v, want ErrConfig", strings.Join(c.args, " "), len(c.key), err)
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("km0 serve %s: %v, want it to name %q", strings.Join(c.args, " "), err, w)
			}
		}
	}
	t.Setenv(requestreply.SigningKeyEnv, "")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// The embedded broker: with an unreachable Kafka the process would wait for it (startSystem).
	if err := runServe(ctx, []string{"comandes", "--service-database-url", "postgres://postgres@127.0.0.1:1/qualsevol", "--embedded-kafka"}); err == nil || errors.Is(err, system.ErrConfig) {
		t.Fatalf("km0 serve comandes without --authorize: %v, want the database's error, not ErrConfig", err)
	}
}

// `km0 serve pagaments --accept-unsigned-requests` without a key starts,
// warns in its log, and its /salut (the simulated gateway's server) says it
// accepts unsigned requests.
func TestServeAcceptUnsignedRequestsStartsAndShowsIt(t *testing.T) {
	t.Parallel()
	b := kafkatest.New(t, system.DomainTopics()...)
	addr := freeAddr(t)
	p := startKm0(t, []string{serviceDatabaseEnv("pagaments") + "=" + pgtest.NewDatabase(t), requestreply.SigningKeyEnv + "="},
		"serve", "pagaments", "--accept-unsigned-requests", "--brokers", strings.Join(b.Addrs(), ","), "--http", system.GatewayName+"="+addr)
	p.waitRunning(t, 60*time.Second)
	resp, err := http.Get("http://" + addr + system.HealthPath)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var h system.Health
	if err := json.NewDecoder(resp.Body).Decode(&h); err != nil || !h.UnsignedRequests {
		t.Fatalf("/salut: %+v, %v: want peticions_sense_signar true", h, err)
	}
	if log := p.log(); !strings.Contains(log, "without a signing key") {
		t.Fatalf("no warning about unsigned requests in the log:\n%s", log)
	}
}

// km0 up, which runs comandes and pagaments in one process, generates a
// random key of its own when none is set (fresh each start); km0 serve
// generates none (its peers could not share it); a key set is used as is.
//
// Not parallel: t.Setenv, for the environment signingKey reads in this
// process.
func TestUpGeneratesASigningKeyServeDoesNot(t *testing.T) {
	t.Setenv(requestreply.SigningKeyEnv, "")
	a, errA := signingKey("up", false)
	b, errB := signingKey("up", false)
	if errA != nil || errB != nil || requestreply.CheckKey(a) != nil || len(a) < requestreply.MinKeyBytes || string(a) == string(b) {
		t.Fatalf("km0 up: keys %d and %d bytes (%v, %v), want two different keys of at least %d bytes", len(a), len(b), errA, errB, requestreply.MinKeyBytes)
	}
	if k, err := signingKey("serve pagaments", false); k != nil || err != nil {
		t.Fatalf("km0 serve: a key of %d bytes (%v), want none", len(k), err)
	}
	if k, _ := signingKey("up", true); k != nil {
		t.Fatalf("km0 up --accept-unsigned-requests: a key of %d bytes, want none", len(k))
	}
	t.Setenv(requestreply.SigningKeyEnv, "clau-de-prova-dels-processos-km0")
	if k, _ := signingKey("up", false); string(k) != "clau-de-prova-dels-processos-km0" {
		t.Fatal("km0 up did not use the key set")
	}
}
