package system_test

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/amqprr"
	"github.com/km0/km0/transport/amqp"
)

// mgmt calls the machine's RabbitMQ management API as guest.
func mgmt(t *testing.T, method, path string, body any) {
	t.Helper()
	var r io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		r = strings.NewReader(string(b))
	}
	req, err := http.NewRequest(method, "http://127.0.0.1:15672/api/"+path, r)
	if err != nil {
		t.Fatal(err)
	}
	req.SetBasicAuth("guest", "guest")
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("RabbitMQ management API at 127.0.0.1:15672 (guest): %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 && !(method == http.MethodDelete && resp.StatusCode == http.StatusNotFound) {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("%s %s: %s %s", method, path, resp.Status, b)
	}
}

// On a vhost of the test's own, with one user per service holding only
// RabbitPermissions: pagaments serves pagaments.autoritzacions and comandes
// gets its answer; a user with inventari's permissions cannot consume the
// payment requests, nor declare (or redeclare) the queue.
func TestRabbitPermissionsAreEnoughAndNoMore(t *testing.T) {
	tag := strings.ToLower(rand.Text()[:10])
	vhost := "km0-acl-" + tag
	mgmt(t, http.MethodPut, "vhosts/"+url.PathEscape(vhost), map[string]any{})
	t.Cleanup(func() { mgmt(t, http.MethodDelete, "vhosts/"+url.PathEscape(vhost), nil) })
	principals := map[string]string{}
	pass := map[string]string{}
	for _, s := range system.Services {
		u := "km0-" + s + "-" + tag
		principals[s], pass[s] = "User:"+u, rand.Text()
		mgmt(t, http.MethodPut, "users/"+url.PathEscape(u), map[string]any{"password": pass[s], "tags": ""})
		t.Cleanup(func() { mgmt(t, http.MethodDelete, "users/"+url.PathEscape(u), nil) })
	}
	perms := system.RabbitPermissions(system.ACLOptions{Principals: principals})
	if len(perms) != len(system.Services) {
		t.Fatalf("%d permissions, want %d", len(perms), len(system.Services))
	}
	for _, p := range perms {
		mgmt(t, http.MethodPut, "permissions/"+url.PathEscape(vhost)+"/"+url.PathEscape(p.User),
			map[string]string{"configure": p.Configure, "write": p.Write, "read": p.Read})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	dial := func(service string) *amqp.Conn {
		u := strings.TrimPrefix(principals[service], "User:")
		c, err := amqp.Dial(ctx, amqp.Config{URL: fmt.Sprintf("amqp://%s:%s@127.0.0.1:5672/%s", u, pass[service], url.PathEscape(vhost)), Name: "km0-acl-test"})
		if err != nil {
			t.Fatalf("%s connects: %v", service, err)
		}
		t.Cleanup(func() { _ = c.Close() })
		return c
	}
	srv, err := amqprr.NewServer(ctx, amqprr.ServerConfig{Conn: dial("pagaments"), Queue: "pagaments.autoritzacions",
		Handler: func(_ context.Context, req *requestreply.Request) ([]byte, error) {
			return append([]byte("ok:"), req.Body...), nil
		}})
	if err != nil {
		t.Fatalf("pagaments serves with its permissions: %v", err)
	}
	srvCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- srv.Run(srvCtx) }()
	defer func() { stop(); <-done }()
	cli, err := amqprr.NewClient(ctx, amqprr.ClientConfig{Conn: dial("comandes")})
	if err != nil {
		t.Fatalf("comandes asks with its permissions: %v", err)
	}
	defer cli.Close()
	out, err := cli.Request(ctx, "pagaments.autoritzacions", "autoritzacio-C-1", []byte(`{"comanda_id":"C-1"}`))
	if err != nil || string(out) != `ok:{"comanda_id":"C-1"}` {
		t.Fatalf("authorisation over RabbitMQ with the services' permissions: %q, %v", out, err)
	}

	inv := dial("inventari")
	var consumeErr, declareErr error
	_ = inv.Do(ctx, func(ch *amqp091.Channel) error {
		_, consumeErr = ch.Consume("pagaments.autoritzacions", "", false, false, false, false, nil)
		return nil
	})
	_ = inv.Do(ctx, func(ch *amqp091.Channel) error {
		_, declareErr = ch.QueueDeclare("pagaments.autoritzacions", true, false, false, false, nil)
		return nil
	})
	for what, err := range map[string]error{"consume": consumeErr, "declare": declareErr} {
		var ae *amqp091.Error
		if !errors.As(err, &ae) || ae.Code != amqp091.AccessRefused {
			t.Errorf("inventari %s pagaments.autoritzacions: %v, want ACCESS_REFUSED (403)", what, err)
		}
	}
}

func TestRabbitCommands(t *testing.T) {
	cmds := system.RabbitCommands(system.RabbitPermissions(system.ACLOptions{}), "km0")
	all := strings.Join(cmds, "\n")
	for _, want := range []string{
		`rabbitmqctl set_permissions -p 'km0' 'km0-pagaments' '^(km0\.dlx|pagaments\.autoritzacions(\.dlq|\.espera\..+)?)$' '^(amq\.default|km0\.dlx|pagaments\.autoritzacions(\.dlq|\.espera\..+)?)$' '^(km0\.dlx|pagaments\.autoritzacions(\.dlq|\.espera\..+)?)$'`,
		`rabbitmqctl set_permissions -p 'km0' 'km0-comandes' '^amq\.gen-.*$' '^amq\.default$' '^(amq\.gen-.*|amq\.rabbitmq\.reply-to)$'`,
		`rabbitmqctl set_permissions -p 'km0' 'km0-cataleg' '^$' '^$' '^$'`,
	} {
		if !strings.Contains(all, want) {
			t.Errorf("no %s in:\n%s", want, all)
		}
	}
}
