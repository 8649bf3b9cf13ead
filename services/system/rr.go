package system

import (
	"context"
	"errors"

	"github.com/km0/km0/services/comandes"
)

// RequestReplyAvailable says whether this build carries request/reply
// (package requestreply). Without it the authorisations and ReservarEstoc
// are not served and Config.Authorize is refused.
const RequestReplyAvailable = false

// rrStack is the system's request/reply transport. This build has none.
type rrStack struct{}

// ErrNoRequestReply refuses Config.Authorize in a build without request/reply.
var ErrNoRequestReply = errors.New("system: request/reply is not available in this build")

func newRR(_ context.Context, s *System) (*rrStack, error) {
	if s.cfg.Authorize {
		return nil, ErrNoRequestReply
	}
	return &rrStack{}, nil
}

// RequestReplyTransport names the request/reply transport in use.
func (s *System) RequestReplyTransport() string { return "cap (no disponible en aquesta build)" }

func (r *rrStack) serve(context.Context, string, func(context.Context, []byte) ([]byte, error)) error {
	return nil
}

func (r *rrStack) authorizer(context.Context) (comandes.Authorizer, error) {
	return nil, ErrNoRequestReply
}

func (r *rrStack) close() {}
