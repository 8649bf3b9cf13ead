package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/internal/tlstest"
	"github.com/km0/km0/lag"
)

// km0 lag over amqps:// with --amqp-tls-ca-file and --amqp-tls-server-name
// reads a queue through a TLS listener in front of the broker, and its
// unacked count through a TLS listener in front of the management API
// (https, the same CA and server name). Another CA fails at once, naming
// the cause.
func TestLagCommandOverTLS(t *testing.T) {
	t.Parallel()
	mgmtPlain := amqptest.ManagementURL(t)
	b := amqptest.NewTLSBroker(t, false)
	q := amqptest.UnackedQueue(t, "km0.lagtls", 1, 3)
	pu, err := url.Parse(mgmtPlain)
	if err != nil {
		t.Fatal(err)
	}
	mgmt := tlstest.Proxy(t, pu.Host, b.CA.Server(t, "127.0.0.1", b.ServerName), nil)
	mgmtURL := "https://" + pu.User.String() + "@" + mgmt.Addr
	// Every run names the management API and the CA on the command line,
	// which replaces $KM0_AMQP_MANAGEMENT_URL and $KM0_AMQP_TLS_CA_FILE.
	run := func(ca string, args ...string) (string, string, error) {
		var out, errOut bytes.Buffer
		err := lagCmd(context.Background(), &out, &errOut, append([]string{"--brokers", "", "--amqp-url", b.URL, "--queue", q,
			"--amqp-management-url", mgmtURL, "--amqp-tls-ca-file", ca, "--amqp-tls-server-name", b.ServerName}, args...))
		return out.String(), errOut.String(), err
	}
	waitUnacked(t, mgmtPlain, amqptest.URL(), q, 3)
	var snap lag.Snapshot
	testkit.Eventually(t, 30*time.Second, "3 unacked in km0 lag --json over TLS", func() bool {
		out, errOut, err := run(b.CA.CertFile, "--json")
		snap = lag.Snapshot{}
		if err != nil || json.Unmarshal([]byte(out), &snap) != nil {
			t.Fatalf("km0 lag --json: %v\n%s%s", err, out, errOut)
		}
		if len(snap.Errors) > 0 {
			t.Fatalf("km0 lag --json over TLS: errors %v\n%s", snap.Errors, errOut)
		}
		return len(snap.Queues) == 1 && snap.Queues[0].Unacked == 3
	})

	if q0 := snap.Queues[0]; q0.Ready != 1 || q0.Consumers != 1 || len(snap.Errors) != 0 {
		t.Fatalf("snapshot: %+v errors %v", snap.Queues, snap.Errors)
	}
	if b.Proxy.Accepted() == 0 || mgmt.Accepted() == 0 {
		t.Fatalf("TLS connections: broker %d, management %d; want both", b.Proxy.Accepted(), mgmt.Accepted())
	}
	other := tlstest.NewCA(t, "another CA")
	start := time.Now()
	_, _, err = run(other.CertFile)
	if err == nil || !strings.Contains(err.Error(), "certificate signed by unknown authority") || time.Since(start) > 10*time.Second {
		t.Fatalf("km0 lag with another CA: want an error naming the unknown authority at once, got %v after %v", err, time.Since(start))
	}
	if strings.Contains(err.Error(), "guest:guest") {
		t.Fatalf("the error shows the password: %v", err)
	}
	_, _, err = run("/nonexistent/ca.pem")
	if err == nil || !strings.Contains(err.Error(), "--amqp-tls-*") || !strings.Contains(err.Error(), "/nonexistent/ca.pem") {
		t.Fatalf("km0 lag with a missing CA file: want an error naming the flag and the file, got %v", err)
	}
}
