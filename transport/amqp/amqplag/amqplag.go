// Package amqplag is the RabbitMQ probe of package lag: a queue's ready
// messages and consumers (a passive declare), and the guess of the
// management API a broker has. It lives beside transport/amqp, apart from
// it, so that lag links no broker client.
package amqplag

import (
	"context"
	"errors"
	"net"
	"net/url"
	"strconv"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/lag"
	"github.com/km0/km0/transport/amqp"
)

// Probe is the lag.QueueProbe of a RabbitMQ connection.
type Probe struct{ conn *amqp.Conn }

var _ lag.QueueProbe = Probe{}

// New returns the Probe of conn; the caller closes conn.
func New(conn *amqp.Conn) Probe { return Probe{conn: conn} }

// Queue implements lag.QueueProbe with a passive declare.
func (p Probe) Queue(ctx context.Context, name string) (ready, consumers int, err error) {
	err = p.conn.Do(ctx, func(ch *amqp091.Channel) error {
		info, err := ch.QueueDeclarePassive(name, true, false, false, false, nil)
		ready, consumers = info.Messages, info.Consumers
		return err
	})
	return ready, consumers, err
}

// Ports of the RabbitMQ management API when enabled with its defaults
// (rabbitmq-plugins enable rabbitmq_management).
const (
	managementPort    = 15672
	managementTLSPort = 15671
)

// ManagementURLFor returns the management API a broker at amqpURL has when
// the plugin runs with its default listener: the same host and credentials,
// http on port 15672 (https on 15671 for amqps), and the URL's virtual host.
// amqpURL "" is amqp.URLDefault. It is a guess: the plugin may be disabled
// or listen elsewhere (lag.Config.ManagementBestEffort).
func ManagementURLFor(amqpURL string) (mgmt, vhost string, err error) {
	if amqpURL == "" {
		amqpURL = amqp.URLDefault
	}
	u, err := amqp091.ParseURI(amqpURL)
	if err != nil {
		return "", "", errors.New("amqplag: the RabbitMQ URL does not parse") // never quote it: it holds the password
	}
	scheme, port := "http", managementPort
	if u.Scheme == "amqps" {
		scheme, port = "https", managementTLSPort
	}
	m := url.URL{Scheme: scheme, Host: net.JoinHostPort(u.Host, strconv.Itoa(port)), User: url.UserPassword(u.Username, u.Password)}
	return m.String(), u.Vhost, nil
}
