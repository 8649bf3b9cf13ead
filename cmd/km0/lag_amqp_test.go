package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/lag"
	"github.com/km0/km0/transport/amqp/amqplag"
)

// km0 lag --queue reports unacked messages without --amqp-management-url:
// the management API is found on the AMQP URL's host (the plugin's default
// port, the URL's credentials) and the queue on the URL's vhost: "/", and
// one of the test's own whose name holds a "/" (escaped %2F in the API's
// path). --amqp-management-url off leaves unacked unknown. km0 lag runs as
// a process without $KM0_AMQP_MANAGEMENT_URL (runKm0 passes on no KM0_*
// variable of the test's environment).
func TestLagCommandUnackedFromTheAMQPURL(t *testing.T) {
	t.Parallel()
	mgmt := amqptest.ManagementURL(t) // the plugin must run on the test broker's host
	for _, tc := range []struct {
		name string
		url  func(t *testing.T) string
	}{
		{"default vhost", func(*testing.T) string { return amqptest.URL() }},
		{"own vhost", func(t *testing.T) string {
			return amqptest.OnVHost(amqptest.URL(), amqptest.NewVHostNamed(t, "km0/lagcmd"))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) { // not parallel: those would wait behind every test of the package
			amqpURL := tc.url(t)
			q := amqptest.UnackedQueueAt(t, amqpURL, "km0.lagcmd", 1, 3)
			flags := []string{"--brokers", "", "--amqp-url", amqpURL, "--queue", q}
			run := func(args ...string) (string, string, error) {
				return runKm0(t, nil, append(append([]string{"lag"}, flags...), args...)...)
			}
			waitUnacked(t, mgmt, amqpURL, q, 3)
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

// waitUnacked waits until the management API at mgmt counts n unacked
// messages in queue, on the vhost of amqpURL. The API counts them seconds
// late (its statistics interval): a GET a poll meanwhile costs less CPU
// than a km0 lag run a poll (a connection to the broker, and to the API).
func waitUnacked(t *testing.T, mgmt, amqpURL, queue string, n int) {
	t.Helper()
	_, vhost, err := amqplag.ManagementURLFor(amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(mgmt)
	if err != nil {
		t.Fatal(err)
	}
	user := u.User
	u.User = nil
	api := strings.TrimSuffix(u.String(), "/") + "/api/queues/" + url.PathEscape(vhost) + "/" + url.PathEscape(queue)
	testkit.Eventuallyf(t, 30*time.Second, fmt.Sprintf("%d unacked in %s on the management API", n, queue), func() (bool, string) {
		req, err := http.NewRequest(http.MethodGet, api, nil)
		if err != nil {
			t.Fatal(err)
		}
		pass, _ := user.Password()
		req.SetBasicAuth(user.Username(), pass)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return false, err.Error()
		}
		defer resp.Body.Close()
		var q struct {
			Unacked *int `json:"messages_unacknowledged"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&q); err != nil || q.Unacked == nil {
			return false, fmt.Sprintf("%s: %v", resp.Status, err)
		}
		return *q.Unacked == n, fmt.Sprintf("%d unacked", *q.Unacked)
	})
}
