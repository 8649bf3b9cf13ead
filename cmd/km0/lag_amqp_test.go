package main

import (
	"bytes"
	"context"
	"encoding/json"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/lag"
)

// km0 lag --queue reports unacked messages without --amqp-management-url:
// the management API is found on the AMQP URL's host (the plugin's default
// port, the URL's credentials) and the queue on the URL's vhost: "/", and
// one of the test's own whose name holds a "/" (escaped %2F in the API's
// path). --amqp-management-url off leaves unacked unknown.
func TestLagCommandUnackedFromTheAMQPURL(t *testing.T) {
	amqptest.ManagementURL(t) // the plugin must run on the test broker's host
	t.Setenv("KM0_AMQP_MANAGEMENT_URL", "")
	for _, tc := range []struct {
		name string
		url  func(t *testing.T) string
	}{
		{"default vhost", func(*testing.T) string { return amqptest.URL() }},
		{"own vhost", func(t *testing.T) string {
			return amqptest.OnVHost(amqptest.URL(), amqptest.NewVHostNamed(t, "km0/lagcmd"))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			amqpURL := tc.url(t)
			q := amqptest.UnackedQueueAt(t, amqpURL, "km0.lagcmd", 1, 3)
			run := func(args ...string) (string, string, error) {
				var out, errOut bytes.Buffer
				err := lagCmd(context.Background(), &out, &errOut, append([]string{"--brokers", "", "--amqp-url", amqpURL, "--queue", q}, args...))
				return out.String(), errOut.String(), err
			}
			var snap lag.Snapshot
			testkit.Eventually(t, 30*time.Second, "3 unacked in km0 lag --json", func() bool {
				out, errOut, err := run("--json")
				snap = lag.Snapshot{}
				if err != nil || json.Unmarshal([]byte(out), &snap) != nil {
					t.Fatalf("km0 lag --json: %v\n%s%s", err, out, errOut)
				}
				return len(snap.Queues) == 1 && snap.Queues[0].Unacked == 3
			})

			if q0 := snap.Queues[0]; q0.Ready != 1 || q0.Consumers != 1 || len(snap.Notes) != 0 {
				t.Fatalf("snapshot: %+v notes %v", snap.Queues, snap.Notes)
			}
			out, _, err := run()
			if err != nil || !strings.Contains(out, "UNACKED") || !regexp.MustCompile(regexp.QuoteMeta(q)+`\s+1\s+3\s+1\n`).MatchString(out) {
				t.Fatalf("km0 lag: %v\n%s", err, out)
			}
			out, _, err = run("--amqp-management-url", "off")
			if err != nil || !regexp.MustCompile(regexp.QuoteMeta(q)+`\s+1\s+-\s+1\n`).MatchString(out) || strings.Contains(out, "note:") {
				t.Fatalf("km0 lag --amqp-management-url off: %v\n%s", err, out)
			}
		})
	}
}
