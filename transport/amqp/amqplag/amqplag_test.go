package amqplag_test

import (
	"strings"
	"testing"

	"github.com/km0/km0/transport/amqp/amqplag"
)

// The guessed management API of an AMQP URL: same host and credentials, the
// plugin's default port, the URL's virtual host.
func TestManagementURLFor(t *testing.T) {
	for _, c := range []struct{ in, url, vhost string }{
		{"", "http://guest:guest@127.0.0.1:15672", "/"},
		{"amqp://app:p%40ss@rabbit.example:5672/prod", "http://app:p%40ss@rabbit.example:15672", "prod"},
		{"amqps://app:pw@rabbit.example/", "https://app:pw@rabbit.example:15671", "/"},
		{"amqp://u:p@[::1]:5673/%2f", "http://u:p@[::1]:15672", "/"},
	} {
		u, vh, err := amqplag.ManagementURLFor(c.in)
		if err != nil || u != c.url || vh != c.vhost {
			t.Errorf("ManagementURLFor(%q) = %q, %q, %v; want %q, %q", c.in, u, vh, err, c.url, c.vhost)
		}
	}
	if _, _, err := amqplag.ManagementURLFor("http://x:s3cr3t@%zz"); err == nil || strings.Contains(err.Error(), "s3cr3t") {
		t.Fatalf("bad URL: %v", err)
	}
}
