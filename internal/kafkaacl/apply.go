package kafkaacl

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/twmb/franz-go/pkg/kadm"
)

// rule is the ACLs of one principal on one resource pattern: one
// kafka-acls command, one kadm builder.
type rule struct {
	principal, resourceType, name, pattern string
	ops                                    []string
}

func rules(acls []ACL) []rule {
	var out []rule
	for _, a := range acls {
		if n := len(out); n > 0 {
			r := &out[n-1]
			if r.principal == a.Principal && r.resourceType == a.ResourceType && r.name == a.ResourceName && r.pattern == a.Pattern {
				r.ops = append(r.ops, a.Operation)
				continue
			}
		}
		out = append(out, rule{principal: a.Principal, resourceType: a.ResourceType, name: a.ResourceName, pattern: a.Pattern, ops: []string{a.Operation}})
	}
	return out
}

// Commands returns acls (as sorted by Required) as kafka-acls commands, one
// per principal and resource, against bootstrap; commandConfig, if not
// empty, is the client properties file of an administrator
// (--command-config). Names are shell-safe by construction (Kafka topic
// and group names of km0's alphabet); nothing is quoted.
func Commands(acls []ACL, bootstrap, commandConfig string) []string {
	var out []string
	for _, r := range rules(acls) {
		var b strings.Builder
		fmt.Fprintf(&b, "kafka-acls --bootstrap-server %s", bootstrap)
		if commandConfig != "" {
			fmt.Fprintf(&b, " --command-config %s", commandConfig)
		}
		fmt.Fprintf(&b, " --add --allow-principal %s --allow-host '*'", r.principal)
		for _, op := range r.ops {
			fmt.Fprintf(&b, " --operation %s", op)
		}
		switch r.resourceType {
		case ResourceTopic:
			fmt.Fprintf(&b, " --topic %s", r.name)
		case ResourceGroup:
			fmt.Fprintf(&b, " --group %s", r.name)
		case ResourceCluster:
			b.WriteString(" --cluster")
		}
		fmt.Fprintf(&b, " --resource-pattern-type %s", strings.ToLower(r.pattern))
		out = append(out, b.String())
	}
	return out
}

var ops = map[string]kadm.ACLOperation{
	OpRead: kadm.OpRead, OpWrite: kadm.OpWrite, OpCreate: kadm.OpCreate, OpDelete: kadm.OpDelete,
	OpDescribe: kadm.OpDescribe, OpDescribeConfigs: kadm.OpDescribeConfigs,
}

// Apply creates acls on the cluster of adm (whose principal must be allowed
// to alter the cluster's ACLs: a superuser or Alter on the cluster).
// Creating an ACL that exists changes nothing, so Apply can run again. It
// returns every refusal at once, each naming its principal and resource.
func Apply(ctx context.Context, adm *kadm.Client, acls []ACL) error {
	var errs []error
	for _, r := range rules(acls) {
		b := kadm.NewACLs().Allow(r.principal).AllowHosts("*")
		switch r.resourceType {
		case ResourceTopic:
			b.Topics(r.name)
		case ResourceGroup:
			b.Groups(r.name)
		case ResourceCluster:
			b.Clusters()
		default:
			errs = append(errs, fmt.Errorf("kafkaacl: %s: unknown resource type %q", r.principal, r.resourceType))
			continue
		}
		if r.pattern == PatternPrefixed {
			b.ResourcePatternType(kadm.ACLPatternPrefixed)
		} else {
			b.ResourcePatternType(kadm.ACLPatternLiteral)
		}
		var kops []kadm.ACLOperation
		for _, o := range r.ops {
			k, ok := ops[o]
			if !ok {
				errs = append(errs, fmt.Errorf("kafkaacl: %s on %s %s: unknown operation %q", r.principal, r.resourceType, r.name, o))
				continue
			}
			kops = append(kops, k)
		}
		b.Operations(kops...)
		res, err := adm.CreateACLs(ctx, b)
		if err != nil {
			return errors.Join(append(errs, fmt.Errorf("kafkaacl: create ACLs of %s on %s %s: %w", r.principal, r.resourceType, r.name, err))...)
		}
		for _, x := range res {
			if x.Err != nil {
				errs = append(errs, fmt.Errorf("kafkaacl: %s %s on %s %s: %w", x.Principal, x.Operation, r.resourceType, r.name, x.Err))
			}
		}
	}
	return errors.Join(errs...)
}
