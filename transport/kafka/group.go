package kafka

import (
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

// Group membership defaults of km0's consumer groups (consumer, the DLQ
// indexer, the request/reply server). They use the classic group protocol
// (JoinGroup/SyncGroup/Heartbeat) with franz-go's cooperative-sticky
// balancer, on a real cluster and on the embedded broker alike.
const (
	// SessionTimeoutDefault is how long the group coordinator waits for a
	// member's heartbeat before it removes the member and hands its
	// partitions to the others. It bounds how long the partitions of a
	// process that died without leaving (SIGKILL, a lost host) stay
	// unconsumed, and how long a restarted process waits before its group
	// rebalances: the rebalance its join starts waits for the dead member.
	// Heartbeats come from a client goroutine of their own, so a slow handler
	// or a long transaction does not delay them; only a process that cannot
	// run at all (or a network cut) for this long loses its membership.
	// 10 s (Kafka's default before 3.0, 45 s since) is chosen over 45 s for
	// recovery in seconds rather than most of a minute. It must lie within
	// the brokers' group.min.session.timeout.ms (6 s by default) and
	// group.max.session.timeout.ms.
	SessionTimeoutDefault = 10 * time.Second
	// HeartbeatIntervalMax caps the heartbeat interval. The interval is a
	// third of the session timeout, at most 1 s: a member learns of a
	// rebalance at its next heartbeat, so a short interval makes rebalances
	// short. (franz-go's default is 3 s.)
	HeartbeatIntervalMax = time.Second
)

// GroupOpts returns the membership options of a km0 group consumer: session
// timeout session (SessionTimeoutDefault if session <= 0) and a heartbeat
// every min(session/3, HeartbeatIntervalMax). Options given after them win.
//
// Static membership (kgo.InstanceID) is not set: it lets a restarted process
// take its partitions back at once, but two processes given the same instance
// id fence each other, and a stopped static member keeps its partitions for
// a full session timeout instead of handing them over when it leaves. Add it
// with the consumers' own options only if every process has a unique, stable
// name.
func GroupOpts(session time.Duration) []kgo.Opt {
	if session <= 0 {
		session = SessionTimeoutDefault
	}
	return []kgo.Opt{kgo.SessionTimeout(session), kgo.HeartbeatInterval(min(session/3, HeartbeatIntervalMax))}
}
