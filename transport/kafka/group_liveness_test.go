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
	"github.com/km0/km0/transport/kafka"
)

// TestEmbeddedExpiresMembersThatDiedWaitingInJoinGroup drives the classic
// group protocol by hand: a live leader L, and members that die (their
// connection closes) while their JoinGroup is parked in a rebalance. The
// rebalance completes when L rejoins; the dead members' JoinGroup responses
// cannot be delivered, and L, as leader, assigns them partitions. Each dead
// member must then be expired within its session timeout, so that L sees a
// rebalance and ends up alone in the group with every partition. (kfake armed
// the session timer only when the response reached the client, so such a
// member stayed in the Stable group for good.)
func TestEmbeddedExpiresMembersThatDiedWaitingInJoinGroup(t *testing.T) {
	t.Parallel()
	const (
		topic   = "viu.esdeveniments"
		group   = "viu"
		session = 500 * time.Millisecond
		dead    = 10 // a dead connection's reply fails about half the time: 10 make a miss near certain
	)
	b := kafkatest.NewWith(t, kafka.EmbeddedConfig{Topics: []string{topic},
		Extra: []kfake.Opt{kfake.GroupMinSessionTimeout(100 * time.Millisecond)}})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	newClient := func() *kgo.Client {
		cl, err := kgo.NewClient(kgo.SeedBrokers(b.Addrs()...))
		if err != nil {
			t.Fatal(err)
		}
		return cl
	}
	join := func(ctx context.Context, cl *kgo.Client, memberID string) (*kmsg.JoinGroupResponse, error) {
		req := kmsg.NewPtrJoinGroupRequest()
		req.Group, req.MemberID, req.ProtocolType = group, memberID, "consumer"
		req.SessionTimeoutMillis = int32(session.Milliseconds())
		// Long: only the session timeout may free a dead member in time.
		req.RebalanceTimeoutMillis = 60_000
		meta := kmsg.NewConsumerMemberMetadata()
		meta.Topics = []string{topic}
		req.Protocols = []kmsg.JoinGroupRequestProtocol{{Name: "range", Metadata: meta.AppendTo(nil)}}
		resp, err := req.RequestWith(ctx, cl)
		if err == nil && resp.ErrorCode != 0 {
			err = kerr.ErrorForCode(resp.ErrorCode)
		}
		return resp, err
	}
	// newMember joins with an empty member id and returns the id the broker
	// gives back with MEMBER_ID_REQUIRED.
	newMember := func(cl *kgo.Client) string {
		resp, err := join(ctx, cl, "")
		if !errors.Is(err, kerr.MemberIDRequired) {
			t.Fatalf("first join: %v", err)
		}
		return resp.MemberID
	}
	// leaderSync spreads the 6 partitions over the members of a join
	// response, the way a leader's balancer would.
	leaderSync := func(cl *kgo.Client, jr *kmsg.JoinGroupResponse) {
		req := kmsg.NewPtrSyncGroupRequest()
		req.Group, req.MemberID, req.Generation = group, jr.MemberID, jr.Generation
		req.ProtocolType, req.Protocol = kmsg.StringPtr("consumer"), jr.Protocol
		parts := map[string][]int32{}
		for p := range int32(kafka.PartitionsDefault) {
			m := jr.Members[int(p)%len(jr.Members)].MemberID
			parts[m] = append(parts[m], p)
		}
		for _, m := range jr.Members {
			a := kmsg.NewConsumerMemberAssignment()
			a.Topics = []kmsg.ConsumerMemberAssignmentTopic{{Topic: topic, Partitions: parts[m.MemberID]}}
			req.GroupAssignment = append(req.GroupAssignment, kmsg.SyncGroupRequestGroupAssignment{MemberID: m.MemberID, MemberAssignment: a.AppendTo(nil)})
		}
		resp, err := req.RequestWith(ctx, cl)
		if err == nil && resp.ErrorCode != 0 {
			err = kerr.ErrorForCode(resp.ErrorCode)
		}
		if err != nil {
			t.Fatalf("sync: %v", err)
		}
	}
	heartbeat := func(cl *kgo.Client, memberID string, gen int32) error {
		req := kmsg.NewPtrHeartbeatRequest()
		req.Group, req.MemberID, req.Generation = group, memberID, gen
		resp, err := req.RequestWith(ctx, cl)
		if err == nil && resp.ErrorCode != 0 {
			err = kerr.ErrorForCode(resp.ErrorCode)
		}
		return err
	}

	// L alone: a Stable group of one.
	l := newClient()
	defer l.Close()
	lid := newMember(l)
	jr, err := join(ctx, l, lid)
	if err != nil || jr.LeaderID != lid {
		t.Fatalf("leader join: %v (leader %q)", err, jr.LeaderID)
	}
	leaderSync(l, jr)

	// The others join and park (L has not rejoined), then die.
	var parked []*kgo.Client
	for range dead {
		cl := newClient()
		id := newMember(cl)
		go func() { _, _ = join(ctx, cl, id) }()
		parked = append(parked, cl)
	}
	if _, err := b.Cluster().WaitGroupInfo(ctx, group, func(g *kfake.GroupInfo) bool {
		return g != nil && g.State == "PreparingRebalance" && len(g.Members) == 1+dead
	}); err != nil {
		t.Fatalf("the members did not park in JoinGroup: %v", err)
	}
	for _, cl := range parked {
		cl.Close()
	}

	// L learns of the rebalance, rejoins and, as leader, assigns partitions
	// to every member in the join response, the dead ones included.
	if err := heartbeat(l, lid, jr.Generation); !errors.Is(err, kerr.RebalanceInProgress) {
		t.Fatalf("heartbeat during the rebalance: %v", err)
	}
	jr, err = join(ctx, l, lid)
	if err != nil || jr.LeaderID != lid || len(jr.Members) != 1+dead {
		t.Fatalf("rejoin: %v (leader %q, %d members)", err, jr.LeaderID, len(jr.Members))
	}
	leaderSync(l, jr)

	// L keeps heartbeating. Within the session timeout (plus margin) the dead
	// members expire: L's heartbeat says REBALANCE_IN_PROGRESS, and its next
	// join finds it alone.
	deadline := time.Now().Add(session + 5*time.Second)
	for {
		err := heartbeat(l, lid, jr.Generation)
		if errors.Is(err, kerr.RebalanceInProgress) {
			break
		}
		if err != nil {
			t.Fatalf("heartbeat: %v", err)
		}
		if time.Now().After(deadline) {
			g := b.Cluster().GroupInfo(group)
			t.Fatalf("dead members never expired: group %s with %d members, %s", g.State, len(g.Members), describe(g))
		}
		time.Sleep(session / 5) // the heartbeat interval, not a wait for a result
	}
	jctx, jcancel := context.WithDeadline(ctx, deadline.Add(5*time.Second))
	defer jcancel()
	jr, err = join(jctx, l, lid)
	if err != nil || len(jr.Members) != 1 {
		g := b.Cluster().GroupInfo(group)
		t.Fatalf("join after the expiry: %v; group %s", err, describe(g))
	}
	leaderSync(l, jr)
	g, err := b.Cluster().WaitGroupStable(ctx, group, 1)
	if err != nil || g.NumAssigned() != kafka.PartitionsDefault {
		t.Fatalf("group after the expiry: %v, %s", err, describe(g))
	}
}

func describe(g *kfake.GroupInfo) string {
	if g == nil {
		return "no group"
	}
	s := g.State
	for _, m := range g.Members {
		s += fmt.Sprintf(" [%s: %v]", m.MemberID, m.Assignment)
	}
	return s
}
