package kafkaacl_test

import (
	"strings"
	"testing"

	"github.com/km0/km0/internal/kafkaacl"
)

// One consumer of one topic: Read on the topic and its group, the .retry
// read and written, the .dlq written; a principal of its own by default;
// duplicates (two groups on one topic) collapse.
func TestRequiredOfAConsumer(t *testing.T) {
	acls := kafkaacl.Required([]kafkaacl.Service{{Name: "cataleg", Consumers: []kafkaacl.Consumer{
		{Group: "cataleg.estoc_baix", Topics: []string{"inventari.esdeveniments"}},
		{Group: "cataleg.altre", Topics: []string{"inventari.esdeveniments"}},
	}}})
	var got []string
	for _, a := range acls {
		if a.Principal != "User:km0-cataleg" || a.Permission != kafkaacl.PermissionAllow {
			t.Fatalf("%+v", a)
		}
		got = append(got, a.ResourceType+" "+a.ResourceName+" "+a.Operation)
	}
	want := "Group cataleg.altre Read|Group cataleg.estoc_baix Read|Topic inventari.esdeveniments Read|" +
		"Topic inventari.esdeveniments.dlq Create|Topic inventari.esdeveniments.dlq DescribeConfigs|Topic inventari.esdeveniments.dlq Write|" +
		"Topic inventari.esdeveniments.retry Create|Topic inventari.esdeveniments.retry DescribeConfigs|Topic inventari.esdeveniments.retry Read|Topic inventari.esdeveniments.retry Write"
	if strings.Join(got, "|") != want {
		t.Fatalf("ACLs\n%s\nwant\n%s", strings.Join(got, "|"), want)
	}
	cmds := kafkaacl.Commands(acls, "b:9092", "")
	if len(cmds) != 5 || cmds[0] != "kafka-acls --bootstrap-server b:9092 --add --allow-principal User:km0-cataleg --allow-host '*' --operation Read --group cataleg.altre --resource-pattern-type literal" {
		t.Fatalf("%d commands: %q", len(cmds), cmds)
	}
}
