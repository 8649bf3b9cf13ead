package doctor

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/km0/km0/internal/kafkaacl"
	"github.com/km0/km0/internal/services/system"
)

// checkACLs compares the cluster's ACLs with the minimal ones of the
// deployment (system.RequiredACLs): one row per principal, listing what it
// lacks with the kafka-acls command that grants it. A required ACL is held
// by an allow rule of the same principal (or User:*) and resource type whose
// operation is the same or All and whose resource is the same name, "*" or
// a prefix of it.
func checkACLs(ctx context.Context, r *Report, cl *kgo.Client, cfg Config) {
	target := strings.Join(cfg.Brokers, ",")
	var have []kafkaacl.ACL
	err := cfg.withTimeout(ctx, func(ctx context.Context) (err error) {
		have, err = describeAllACLs(ctx, cl)
		return err
	})
	switch {
	case errors.Is(err, kerr.SecurityDisabled):
		r.warn("kafka ACLs", target, "the cluster has no authorizer: every principal may read and write every topic",
			"enable an authorizer and grant each service its own principal's ACLs (docs/deploying.md)")
		return
	case errors.Is(err, kerr.ClusterAuthorizationFailed):
		r.warn("kafka ACLs", target, "this principal may not describe the ACLs, so they were not checked",
			"run km0 doctor with an admin principal (DESCRIBE on the cluster) to check them")
		return
	case err != nil:
		r.fail("kafka ACLs", target, "the ACLs could not be described: "+err.Error(), "check that the brokers answer")
		return
	}
	want := system.RequiredACLs(system.ACLOptions{Principals: cfg.Principals, Groups: cfg.System.Groups, Topics: cfg.System.Topics})
	missing := map[string][]kafkaacl.ACL{}
	var order []string
	for _, w := range want {
		if _, seen := missing[w.Principal]; !seen {
			missing[w.Principal] = nil
			order = append(order, w.Principal)
		}
		if !heldBy(w, have) {
			missing[w.Principal] = append(missing[w.Principal], w)
		}
	}
	for _, p := range order {
		m := missing[p]
		if len(m) == 0 {
			r.ok("kafka ACLs", p, "all of its minimal ACLs are granted")
			continue
		}
		var seen, fix []string
		for _, a := range m {
			seen = append(seen, fmt.Sprintf("%s on %s %s", a.Operation, strings.ToLower(a.ResourceType), a.ResourceName))
			fix = append(fix, aclCommand(a))
		}
		r.fail("kafka ACLs", p, "missing: "+strings.Join(seen, ", "), strings.Join(fix, "; "))
	}
}

// heldBy reports whether an allow rule of have grants w.
func heldBy(w kafkaacl.ACL, have []kafkaacl.ACL) bool {
	for _, h := range have {
		if !strings.EqualFold(h.Permission, kafkaacl.PermissionAllow) || !strings.EqualFold(h.ResourceType, w.ResourceType) ||
			(h.Principal != w.Principal && h.Principal != "User:*") ||
			(!strings.EqualFold(h.Operation, w.Operation) && !strings.EqualFold(h.Operation, "All")) {
			continue
		}
		switch {
		case h.ResourceName == "*" && strings.EqualFold(h.Pattern, kafkaacl.PatternLiteral):
			return true
		case strings.EqualFold(h.Pattern, kafkaacl.PatternPrefixed) && strings.HasPrefix(w.ResourceName, h.ResourceName):
			return true
		case strings.EqualFold(h.Pattern, w.Pattern) && h.ResourceName == w.ResourceName:
			return true
		}
	}
	return false
}

// aclCommand is the kafka-acls command that grants a.
func aclCommand(a kafkaacl.ACL) string {
	res := map[string]string{kafkaacl.ResourceTopic: "--topic", kafkaacl.ResourceGroup: "--group", kafkaacl.ResourceCluster: "--cluster"}[a.ResourceType]
	cmd := fmt.Sprintf("kafka-acls.sh --add --allow-principal %s --operation %s %s %s", a.Principal, a.Operation, res, a.ResourceName)
	if a.Pattern == kafkaacl.PatternPrefixed {
		cmd += " --resource-pattern-type prefixed"
	}
	return cmd
}

// describeAllACLs returns every ACL of the cluster, spelled as kafkaacl
// spells them (kafka-acls' words: Topic, LITERAL, Read, Allow).
func describeAllACLs(ctx context.Context, cl *kgo.Client) ([]kafkaacl.ACL, error) {
	req := kmsg.NewPtrDescribeACLsRequest()
	req.ResourceType = kmsg.ACLResourceTypeAny
	req.ResourcePatternType = kmsg.ACLResourcePatternTypeAny
	req.Operation = kmsg.ACLOperationAny
	req.PermissionType = kmsg.ACLPermissionTypeAny
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return nil, err
	}
	if err := kerr.ErrorForCode(resp.ErrorCode); err != nil {
		return nil, err
	}
	var out []kafkaacl.ACL
	for _, res := range resp.Resources {
		for _, a := range res.ACLs {
			out = append(out, kafkaacl.ACL{Principal: a.Principal, ResourceType: words(res.ResourceType.String()),
				ResourceName: res.ResourceName, Pattern: res.ResourcePatternType.String(),
				Operation: words(a.Operation.String()), Permission: words(a.PermissionType.String())})
		}
	}
	return out, nil
}

// words turns kmsg's DESCRIBE_CONFIGS into kafka-acls' DescribeConfigs.
func words(s string) string {
	var b strings.Builder
	for _, w := range strings.Split(strings.ToLower(s), "_") {
		if w != "" {
			b.WriteString(strings.ToUpper(w[:1]) + w[1:])
		}
	}
	return b.String()
}
