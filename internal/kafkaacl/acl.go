// Package kafkaacl derives the minimal Kafka ACLs of km0's processes from
// what each one reads, writes and joins, prints them as kafka-acls commands
// and applies them through kadm.
//
// One principal per service (default "User:km0-<service>"): a service may
// write its domain topic and the .retry/.dlq topics of what it consumes,
// read what it consumes, join its own groups, and take part in
// request/reply (the request topics it serves or asks, the reply topics
// "respostes." by prefix). Anything else is refused by the cluster.
package kafkaacl

import (
	"cmp"
	"slices"
	"strings"

	"github.com/km0/km0/contract"
)

// Resource types, pattern types, operations and permissions, spelled as
// kafka-acls and the Kafka protocol spell them.
const (
	ResourceTopic   = "Topic"
	ResourceGroup   = "Group"
	ResourceCluster = "Cluster"

	PatternLiteral  = "LITERAL"
	PatternPrefixed = "PREFIXED"

	OpRead     = "Read"
	OpWrite    = "Write"
	OpCreate   = "Create"
	OpDelete   = "Delete"
	OpDescribe = "Describe"
	// OpDescribeConfigs lets a producer learn a topic's max.message.bytes.
	OpDescribeConfigs = "DescribeConfigs"

	PermissionAllow = "Allow"
)

// ClusterName is the name of the cluster resource.
const ClusterName = "kafka-cluster"

// PrincipalPrefixDefault names a service's principal: "km0-<service>".
const PrincipalPrefixDefault = "km0-"

// ACL is one allow rule: Principal ("User:<name>") may do Operation on the
// resource ResourceType/ResourceName matched by Pattern, from any host.
type ACL struct {
	Principal    string
	ResourceType string
	ResourceName string
	Pattern      string
	Operation    string
	Permission   string
}

// Consumer is a consumer group and the topics it reads (the topics' .retry
// are read too, and .retry/.dlq written, by km0's consumers).
type Consumer struct {
	Group  string
	Topics []string
}

// Service is what one principal does on Kafka.
type Service struct {
	// Name of the service ("comandes"); Principal defaults from it.
	Name string
	// Principal is the Kafka principal. Default "User:km0-<Name>".
	Principal string
	// Produces are the topics its relay publishes ("<service>.esdeveniments").
	Produces []string
	// Consumers are its consumer groups.
	Consumers []Consumer
	// Reads are topics it reads as they are, without .retry or .dlq (the
	// DLQ indexer's .dlq topics).
	Reads []string
	// Serves are the request topics it answers (group "<topic>.servidor";
	// the replies go to topics under ReplyPrefix).
	Serves []string
	// Requests are the request topics it asks (its replies come on a topic
	// of its own under ReplyPrefix, created and deleted by it).
	Requests []string
	// ReplyPrefix of request/reply reply topics. Default "respostes.".
	ReplyPrefix string
	// ServerGroupSuffix is appended to a served topic to name the server's
	// group. Default ".servidor".
	ServerGroupSuffix string
}

// PrincipalFor is the default principal of service: "User:km0-<service>".
func PrincipalFor(service string) string { return "User:" + PrincipalPrefixDefault + service }

// Required returns the minimal allow ACLs of services, sorted and without
// duplicates. Topic creation is granted on the topics each process creates
// when absent (its domain topic, the .retry/.dlq of what it consumes, the
// request topics it serves, its reply topics); grant none of those and
// create the topics beforehand if the cluster's policy forbids it.
func Required(services []Service) []ACL {
	var out []ACL
	for _, s := range services {
		p := cmp.Or(s.Principal, PrincipalFor(s.Name))
		add := func(rt, name, pattern string, ops ...string) {
			for _, op := range ops {
				out = append(out, ACL{Principal: p, ResourceType: rt, ResourceName: name, Pattern: pattern, Operation: op, Permission: PermissionAllow})
			}
		}
		for _, t := range s.Produces {
			add(ResourceTopic, t, PatternLiteral, OpWrite, OpCreate, OpDescribeConfigs)
		}
		for _, c := range s.Consumers {
			add(ResourceGroup, c.Group, PatternLiteral, OpRead)
			for _, t := range c.Topics {
				add(ResourceTopic, t, PatternLiteral, OpRead)
				add(ResourceTopic, contract.RetryTopic(t), PatternLiteral, OpRead, OpWrite, OpCreate, OpDescribeConfigs)
				add(ResourceTopic, contract.DLQName(t), PatternLiteral, OpWrite, OpCreate, OpDescribeConfigs)
			}
		}
		for _, t := range s.Reads {
			add(ResourceTopic, t, PatternLiteral, OpRead)
		}
		prefix := cmp.Or(s.ReplyPrefix, "respostes.")
		for _, t := range s.Serves {
			add(ResourceGroup, t+cmp.Or(s.ServerGroupSuffix, ".servidor"), PatternLiteral, OpRead)
			add(ResourceTopic, t, PatternLiteral, OpRead, OpCreate, OpDescribeConfigs)
			add(ResourceTopic, prefix, PatternPrefixed, OpWrite, OpDescribeConfigs)
		}
		for _, t := range s.Requests {
			add(ResourceTopic, t, PatternLiteral, OpWrite, OpDescribeConfigs)
			add(ResourceTopic, prefix, PatternPrefixed, OpRead, OpCreate, OpDelete, OpDescribeConfigs)
		}
	}
	slices.SortFunc(out, compare)
	return slices.Compact(out)
}

func compare(a, b ACL) int {
	return cmp.Or(strings.Compare(a.Principal, b.Principal), strings.Compare(a.ResourceType, b.ResourceType),
		strings.Compare(a.ResourceName, b.ResourceName), strings.Compare(a.Pattern, b.Pattern), strings.Compare(a.Operation, b.Operation))
}
