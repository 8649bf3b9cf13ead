package amqptest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/transport/amqp"
)

// VHost gives the test a RabbitMQ virtual host of its own (NewVHost) and
// returns URL() on it. A system started on it (system.Config.AMQPURL, km0
// serve/up --amqp-url, the demo) declares its fixed names there
// (pagaments.autoritzacions, inventari.reserves, km0.dlx, the events'
// exchange and queues), so two such tests, in one package or in two test
// binaries at once, never take each other's requests or events. Everything
// in it goes with it at cleanup.
func VHost(t testing.TB) string {
	t.Helper()
	return OnVHost(URL(), NewVHost(t))
}

// NewVHost creates a uniquely named virtual host through the management API
// (KM0_TEST_AMQP_MANAGEMENT_URL, else guest@127.0.0.1:15672), gives the user
// of URL() every permission on it, and returns its name. It holds the
// restart lock shared, as Dial does, and deletes the vhost at cleanup (with
// its queues, exchanges and bindings; connections to it are closed), after
// the cleanups registered later (the system, the processes on it). Without
// the management API the test fails naming it: the RabbitMQ tests that run
// the system need the plugin (README).
func NewVHost(t testing.TB) string {
	t.Helper()
	return NewVHostNamed(t, vhostPrefix(t.Name()))
}

// NewVHostNamed is NewVHost with a name of prefix + "." + random hex, prefix
// as given: a test of how code escapes a vhost gives one with a "/".
func NewVHostNamed(t testing.TB, prefix string) string {
	t.Helper()
	Shared(t)
	mgmt := managementURLEnv()
	if err := probeManagement(mgmt); err != nil {
		t.Fatalf("amqptest: a vhost of the test's own needs the RabbitMQ management API, which does not answer: %v"+
			" (enable it with: rabbitmq-plugins enable rabbitmq_management; or set KM0_TEST_AMQP_MANAGEMENT_URL)", err)
	}
	user := "guest"
	if u, err := amqp091.ParseURI(URL()); err == nil {
		user = u.Username
	}
	name := Name(prefix)
	path := "/api/vhosts/" + url.PathEscape(name)
	if err := managementDo(mgmt, http.MethodPut, path, map[string]string{"description": "km0 test " + t.Name()}); err != nil {
		t.Fatalf("amqptest: create vhost %s: %v", name, err)
	}
	t.Cleanup(func() {
		if err := managementDo(mgmt, http.MethodDelete, path, nil); err != nil && !errors.Is(err, errNotFound) {
			t.Errorf("amqptest: delete vhost %s: %v", name, err)
		}
	})
	perms := map[string]string{"configure": ".*", "write": ".*", "read": ".*"}
	if err := managementDo(mgmt, http.MethodPut, "/api/permissions/"+url.PathEscape(name)+"/"+url.PathEscape(user), perms); err != nil {
		t.Fatalf("amqptest: permissions of %s on vhost %s: %v", user, name, err)
	}
	return name
}

// OnVHost returns amqpURL with vhost as its path, escaped (a "/" in the
// name is %2F), its query kept.
func OnVHost(amqpURL, vhost string) string {
	u, err := url.Parse(amqpURL)
	if err != nil {
		return amqpURL
	}
	u.Path, u.RawPath = "/"+vhost, "/"+url.PathEscape(vhost)
	return u.String()
}

// DialURL is Dial to amqpURL (a VHost URL): it takes the shared lock and
// connects; the connection closes at cleanup.
func DialURL(t testing.TB, amqpURL string) *amqp.Conn {
	t.Helper()
	Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	c, err := amqp.Dial(ctx, amqp.Config{URL: amqpURL, Name: "km0-test " + t.Name(), ReconnectMax: time.Second})
	if err != nil {
		t.Fatalf("RabbitMQ is required and did not answer: %v (start it with: rabbitmq-server -detached)", err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// vhostNameRE is what a vhost name keeps of a test's name.
var vhostNameRE = regexp.MustCompile(`[^a-zA-Z0-9]+`)

// vhostPrefix is km0.test.<the test's name, shortened>: with the random
// hex NewVHostNamed adds, a leftover vhost (a killed test binary) says which
// test made it.
func vhostPrefix(test string) string {
	s := strings.Trim(vhostNameRE.ReplaceAllString(test, "-"), "-")
	if len(s) > 60 {
		s = s[:60]
	}
	return "km0.test." + s
}

// managementURLEnv is KM0_TEST_AMQP_MANAGEMENT_URL, else the plugin's
// default listener as guest.
func managementURLEnv() string {
	if u := os.Getenv("KM0_TEST_AMQP_MANAGEMENT_URL"); u != "" {
		return u
	}
	return "http://guest:guest@127.0.0.1:15672"
}

var errNotFound = errors.New("not found (404)")

// managementDo sends method path (already escaped) with body as JSON to the
// management API at base. Its errors never quote base (it holds the
// password).
func managementDo(base, method, path string, body any) error {
	pu, err := url.Parse(base)
	if err != nil || pu.Host == "" {
		return errors.New("KM0_TEST_AMQP_MANAGEMENT_URL is not an absolute URL")
	}
	user := pu.User
	pu.User = nil
	var r io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		r = bytes.NewReader(b)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, strings.TrimSuffix(pu.String(), "/")+path, r)
	if err != nil {
		return err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if user != nil {
		pw, _ := user.Password()
		req.SetBasicAuth(user.Username(), pw)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("%s: %v", pu.Host, errors.Unwrap(err))
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<10))
	switch {
	case resp.StatusCode == http.StatusNotFound:
		return errNotFound
	case resp.StatusCode >= 300:
		return fmt.Errorf("%s %s: %s answered %s %s", method, path, pu.Host, resp.Status, bytes.TrimSpace(msg))
	}
	return nil
}
