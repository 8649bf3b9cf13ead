package system

import (
	"cmp"
	"fmt"
	"regexp"
	"strings"

	"github.com/km0/km0/internal/kafkaacl"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/transport/amqp"
)

// RabbitPermission is one RabbitMQ user's permissions on a vhost, as
// `rabbitmqctl set_permissions` takes them: three regular expressions over
// the names of the queues and exchanges the user may configure (declare,
// delete), write (publish to, bind to) and read (consume from, bind from).
type RabbitPermission struct {
	User, Configure, Write, Read string
}

// RabbitPermissions are the minimal RabbitMQ permissions of request/reply
// over RabbitMQ under o, one user per service (default "km0-<service>",
// ACLOptions.Principals without the "User:" prefix): pagaments and
// inventari serve their queues (pagaments.autoritzacions,
// inventari.reserves, with their .dlq and wait queues and the exchange
// km0.dlx) and answer through the default exchange; comandes asks through
// the default exchange and reads its exclusive reply queue (amq.gen-*) or
// direct reply-to. A service with nothing on RabbitMQ gets "^$" three times.
//
// RabbitMQ checks no routing key on the default exchange: a user allowed to
// write amq.default can publish to any queue of the vhost. What the
// permissions stop is reading, declaring and binding another service's
// queues; the signing key (KM0_RR_HMAC_KEY) is what makes a forged request
// worthless.
func RabbitPermissions(o ACLOptions) []RabbitPermission {
	names := o.Services
	if len(names) == 0 {
		names = Services
	}
	dlx := regexp.QuoteMeta(amqp.DLXDefault)
	served := func(q string) string {
		q = regexp.QuoteMeta(q)
		return fmt.Sprintf("%s|%s(\\.dlq|\\.espera\\..+)?", dlx, q)
	}
	var out []RabbitPermission
	for _, name := range names {
		user := strings.TrimPrefix(cmp.Or(o.Principals[name], kafkaacl.PrincipalFor(name)), "User:")
		p := RabbitPermission{User: user, Configure: "^$", Write: "^$", Read: "^$"}
		switch name {
		case pagaments.Name, inventari.Name:
			q := pagaments.AuthQueue
			if name == inventari.Name {
				q = inventari.ReserveQueue
			}
			p.Configure = "^(" + served(q) + ")$"
			p.Write = "^(amq\\.default|" + served(q) + ")$"
			p.Read = "^(" + served(q) + ")$"
		case comandes.Name:
			p.Configure = "^amq\\.gen-.*$"
			p.Write = "^amq\\.default$"
			p.Read = "^(amq\\.gen-.*|amq\\.rabbitmq\\.reply-to)$"
		}
		out = append(out, p)
	}
	return out
}

// RabbitCommands returns perms as `rabbitmqctl set_permissions` commands
// on vhost, the expressions in single quotes.
func RabbitCommands(perms []RabbitPermission, vhost string) []string {
	var out []string
	for _, p := range perms {
		out = append(out, fmt.Sprintf("rabbitmqctl set_permissions -p '%s' '%s' '%s' '%s' '%s'", vhost, p.User, p.Configure, p.Write, p.Read))
	}
	return out
}
