package kafka_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// These tests drive the classic group protocol (JoinGroup, SyncGroup,
// Heartbeat) by hand against the embedded broker, one kgo client per member
// so that closing a client kills that member's connection.

const (
	cgTopic = "viu.esdeveniments"
	cgGroup = "viu"
	cgParts = 6
)

// classicGroup sends the group requests of test members to cluster c.
type classicGroup struct {
	t   *testing.T
	ctx context.Context
	c   *kfake.Cluster
}

func newClassicGroup(t *testing.T) *classicGroup {
	b := kafkatest.NewWith(t, kafkaembed.Config{Topics: []string{cgTopic},
		Extra: []kfake.Opt{kfake.GroupMinSessionTimeout(100 * time.Millisecond)}})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return &classicGroup{t: t, ctx: ctx, c: b.Cluster()}
}

func (g *classicGroup) client() *kgo.Client {
	cl, err := kgo.NewClient(kgo.SeedBrokers(g.c.ListenAddrs()...))
	if err != nil {
		g.t.Fatal(err)
	}
	g.t.Cleanup(cl.Close)
	return cl
}

func codeErr(err error, code int16) error {
	if err == nil && code != 0 {
		return kerr.ErrorForCode(code)
	}
	return err
}

// join sends a JoinGroup with a 60 s rebalance timeout: longer than any
// test, so only session timeouts (and rejoins) can end a rebalance in time.
func (g *classicGroup) join(ctx context.Context, cl *kgo.Client, memberID string, session time.Duration) (*kmsg.JoinGroupResponse, error) {
	req := kmsg.NewPtrJoinGroupRequest()
	req.Group, req.MemberID, req.ProtocolType = cgGroup, memberID, "consumer"
	req.SessionTimeoutMillis, req.RebalanceTimeoutMillis = int32(session.Milliseconds()), 60_000
	meta := kmsg.NewConsumerMemberMetadata()
	meta.Topics = []string{cgTopic}
	req.Protocols = []kmsg.JoinGroupRequestProtocol{{Name: "range", Metadata: meta.AppendTo(nil)}}
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return nil, err
	}
	return resp, codeErr(nil, resp.ErrorCode)
}

// newMember joins with an empty member id and returns the id the broker
// gives back with MEMBER_ID_REQUIRED.
func (g *classicGroup) newMember(cl *kgo.Client, session time.Duration) string {
	resp, err := g.join(g.ctx, cl, "", session)
	if !errors.Is(err, kerr.MemberIDRequired) {
		g.t.Fatalf("first join: %v", err)
	}
	return resp.MemberID
}

// sync sends a SyncGroup; from the leader (members in jr) it spreads the
// partitions over the members the way a leader's balancer would.
func (g *classicGroup) sync(ctx context.Context, cl *kgo.Client, jr *kmsg.JoinGroupResponse) error {
	req := kmsg.NewPtrSyncGroupRequest()
	req.Group, req.MemberID, req.Generation = cgGroup, jr.MemberID, jr.Generation
	req.ProtocolType, req.Protocol = kmsg.StringPtr("consumer"), jr.Protocol
	parts := map[string][]int32{}
	for p := range int32(cgParts) {
		if len(jr.Members) > 0 {
			m := jr.Members[int(p)%len(jr.Members)].MemberID
			parts[m] = append(parts[m], p)
		}
	}
	for _, m := range jr.Members {
		a := kmsg.NewConsumerMemberAssignment()
		a.Topics = []kmsg.ConsumerMemberAssignmentTopic{{Topic: cgTopic, Partitions: parts[m.MemberID]}}
		req.GroupAssignment = append(req.GroupAssignment, kmsg.SyncGroupRequestGroupAssignment{MemberID: m.MemberID, MemberAssignment: a.AppendTo(nil)})
	}
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return err
	}
	return codeErr(nil, resp.ErrorCode)
}

func (g *classicGroup) heartbeat(cl *kgo.Client, memberID string, gen int32) error {
	req := kmsg.NewPtrHeartbeatRequest()
	req.Group, req.MemberID, req.Generation = cgGroup, memberID, gen
	resp, err := req.RequestWith(g.ctx, cl)
	if err != nil {
		return err
	}
	return codeErr(nil, resp.ErrorCode)
}

// leader makes a Stable group whose only member is a leader with a long
// session, and returns its client and last join response.
func (g *classicGroup) leader() (*kgo.Client, *kmsg.JoinGroupResponse) {
	l := g.client()
	id := g.newMember(l, time.Minute)
	jr, err := g.join(g.ctx, l, id, time.Minute)
	if err != nil || jr.LeaderID != id {
		g.t.Fatalf("leader join: %v", err)
	}
	if err := g.sync(g.ctx, l, jr); err != nil {
		g.t.Fatalf("leader sync: %v", err)
	}
	return l, jr
}

// waitParked waits until n members are in the group, rebalancing.
func (g *classicGroup) waitParked(n int) {
	if _, err := g.c.WaitGroupInfo(g.ctx, cgGroup, func(i *kfake.GroupInfo) bool {
		return i != nil && i.State == "PreparingRebalance" && len(i.Members) == n
	}); err != nil {
		g.t.Fatalf("%d members did not park in JoinGroup: %v", n, err)
	}
}

func (g *classicGroup) describe() string {
	i := g.c.GroupInfo(cgGroup)
	if i == nil {
		return "no group"
	}
	s := i.State
	for _, m := range i.Members {
		s += fmt.Sprintf(" [%s: %v]", m.MemberID, m.Assignment)
	}
	return s
}

// TestEmbeddedExpiresMembersThatDiedWaitingInJoinGroup: members die (their
// connection closes) while their JoinGroup is parked in a rebalance. The
// rebalance completes when the live leader L rejoins; the dead members'
// responses cannot be delivered, and L assigns them partitions. Each dead
// member must then expire within its session timeout, so that L sees a
// rebalance and ends up alone with every partition. (kfake armed the session
// timer only when the response reached the client: such a member stayed in
// the Stable group for good, holding its partitions.)
func TestEmbeddedExpiresMembersThatDiedWaitingInJoinGroup(t *testing.T) {
	t.Parallel()
	const (
		session = time.Second // the dead members'
		dead    = 10          // a dead connection's reply fails about half the time: 10 make a miss near certain
	)
	g := newClassicGroup(t)
	l, jr := g.leader()
	lid := jr.MemberID

	var parked []*kgo.Client
	for range dead {
		cl := g.client()
		id := g.newMember(cl, session)
		go func() { _, _ = g.join(g.ctx, cl, id, session) }()
		parked = append(parked, cl)
	}
	g.waitParked(1 + dead)
	for _, cl := range parked {
		cl.Close()
	}

	if err := g.heartbeat(l, lid, jr.Generation); !errors.Is(err, kerr.RebalanceInProgress) {
		t.Fatalf("heartbeat during the rebalance: %v", err)
	}
	jr, err := g.join(g.ctx, l, lid, time.Minute)
	if err != nil || jr.LeaderID != lid || len(jr.Members) != 1+dead {
		t.Fatalf("rejoin: %v; group %s", err, g.describe())
	}
	if err := g.sync(g.ctx, l, jr); err != nil {
		t.Fatalf("sync: %v", err)
	}

	// Within the session timeout (plus margin) the dead members expire: L's
	// heartbeat says REBALANCE_IN_PROGRESS, and its next join finds it alone.
	deadline := time.Now().Add(session + 5*time.Second)
	for {
		err := g.heartbeat(l, lid, jr.Generation)
		if errors.Is(err, kerr.RebalanceInProgress) {
			break
		}
		if err != nil {
			t.Fatalf("heartbeat: %v", err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("dead members never expired: group %s", g.describe())
		}
		time.Sleep(100 * time.Millisecond) // the heartbeat interval, not a wait for a result
	}
	jctx, jcancel := context.WithDeadline(g.ctx, deadline.Add(5*time.Second))
	defer jcancel()
	jr, err = g.join(jctx, l, lid, time.Minute)
	if err != nil || len(jr.Members) != 1 {
		t.Fatalf("join after the expiry: %v; group %s", err, g.describe())
	}
	if err := g.sync(g.ctx, l, jr); err != nil {
		t.Fatalf("sync: %v", err)
	}
	if i, err := g.c.WaitGroupStable(g.ctx, cgGroup, 1); err != nil || i.NumAssigned() != cgParts {
		t.Fatalf("group after the expiry: %v, %s", err, g.describe())
	}
}

// TestEmbeddedKeepsALiveMemberParkedInJoinGroupPastItsSession: a live member
// M learns of a rebalance at a heartbeat and waits in JoinGroup for a
// rebalance that outlasts M's session timeout (the leader L is slow to
// rejoin). Like Kafka, the broker must keep M, which cannot heartbeat while
// it waits, and answer its JoinGroup when the rebalance completes. (kfake's
// session timer, armed by that heartbeat, removed M and dropped its JoinGroup
// unanswered: the client waited for its request timeout, the rebalance
// timeout plus 10 s in kgo, while the group went on without it.)
func TestEmbeddedKeepsALiveMemberParkedInJoinGroupPastItsSession(t *testing.T) {
	t.Parallel()
	const session = time.Second // M's
	g := newClassicGroup(t)
	l, jr := g.leader()
	lid := jr.MemberID

	// M joins; the group of L and M is Stable.
	m := g.client()
	mid := g.newMember(m, session)
	mjoin := make(chan *kmsg.JoinGroupResponse, 1)
	go func() {
		jr, err := g.join(g.ctx, m, mid, session)
		if err == nil {
			err = g.sync(g.ctx, m, jr)
		}
		if err != nil {
			t.Errorf("M's first join and sync: %v", err)
		}
		mjoin <- jr
	}()
	g.waitParked(2)
	if err := g.heartbeat(l, lid, jr.Generation); !errors.Is(err, kerr.RebalanceInProgress) {
		t.Fatalf("heartbeat during the rebalance: %v", err)
	}
	jr, err := g.join(g.ctx, l, lid, time.Minute)
	if err != nil || len(jr.Members) != 2 {
		t.Fatalf("L's rejoin: %v; group %s", err, g.describe())
	}
	if err := g.sync(g.ctx, l, jr); err != nil {
		t.Fatalf("L's sync: %v", err)
	}
	mjr := <-mjoin

	// N joins. M hears of it at its heartbeat and rejoins at once; L rejoins
	// only after three of M's session timeouts.
	n := g.client()
	nid := g.newMember(n, time.Minute)
	go func() { _, _ = g.join(g.ctx, n, nid, time.Minute) }()
	g.waitParked(3)
	if err := g.heartbeat(m, mid, mjr.Generation); !errors.Is(err, kerr.RebalanceInProgress) {
		t.Fatalf("M's heartbeat during the rebalance: %v", err)
	}
	mdone := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(g.ctx, 15*time.Second)
		defer cancel()
		_, err := g.join(ctx, m, mid, session)
		mdone <- err
	}()
	time.Sleep(3 * session) // the scenario (a slow rejoin), not a wait for a result
	if err := g.heartbeat(l, lid, jr.Generation); !errors.Is(err, kerr.RebalanceInProgress) {
		t.Fatalf("L's heartbeat during the rebalance: %v", err)
	}
	jr, err = g.join(g.ctx, l, lid, time.Minute)
	if err != nil || len(jr.Members) != 3 {
		t.Fatalf("L's rejoin: %v; M was dropped while it waited: group %s", err, g.describe())
	}
	if err := <-mdone; err != nil {
		t.Fatalf("M's parked JoinGroup: %v", err)
	}
}
