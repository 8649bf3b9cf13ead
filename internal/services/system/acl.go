package system

import (
	"cmp"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/dlq/kafkadlq"
	"github.com/km0/km0/internal/kafkaacl"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/transport/kafka"
)

// DLQPrincipalName is the service name of the DLQ indexer and replayer
// (`km0 dlq`) in ACLOptions.Principals: principal "User:km0-dlq" by default.
const DLQPrincipalName = "dlq"

// ACLOptions describe a deployment for RequiredACLs and KafkaACLServices.
// The zero value is the contract's names with principals "User:km0-<service>".
type ACLOptions struct {
	// Services to grant. Default all of Services, and the DLQ indexer.
	Services []string
	// Principals by service name (Services, DLQPrincipalName), each
	// "User:<name>". Default kafkaacl.PrincipalFor(service).
	Principals map[string]string
	// Groups renames consumer groups by consumidor (Config.Groups).
	Groups map[string]string
	// Topics renames topics (Config.Topics).
	Topics map[string]string
}

// consumersOf are each service's consumidors (ConsumerNames by owner).
var consumersOf = map[string][]string{}

func init() {
	for _, c := range ConsumerNames {
		for _, s := range Services {
			if len(c) > len(s) && c[:len(s)+1] == s+"." {
				consumersOf[s] = append(consumersOf[s], c)
			}
		}
	}
}

// KafkaACLServices is what each km0 process does on Kafka, under o: the
// six services (relay, consumers, request/reply: comandes asks
// pagaments.autoritzacions, pagaments answers it, inventari answers
// inventari.reserves) and the DLQ indexer (group km0.dlq.index reading every
// .dlq topic, replaying to the domain topics).
func KafkaACLServices(o ACLOptions) []kafkaacl.Service {
	topic := func(t string) string { return cmp.Or(o.Topics[t], t) }
	names := o.Services
	if len(names) == 0 {
		names = append(append([]string{}, Services...), DLQPrincipalName)
	}
	var out []kafkaacl.Service
	for _, name := range names {
		s := kafkaacl.Service{Name: name, Principal: o.Principals[name]}
		if name == DLQPrincipalName {
			s.Consumers = []kafkaacl.Consumer{{Group: kafkadlq.GroupDefault}}
			for _, svc := range Services {
				if t, ok := Topics[svc]; ok {
					s.Produces = append(s.Produces, topic(t))
					s.Reads = append(s.Reads, contract.DLQName(topic(t)))
				}
			}
			out = append(out, s)
			continue
		}
		if t, ok := Topics[name]; ok {
			s.Produces = []string{topic(t)}
		}
		for _, c := range consumersOf[name] {
			cons := kafkaacl.Consumer{Group: cmp.Or(o.Groups[c], c)}
			for _, t := range Subscriptions[c] {
				cons.Topics = append(cons.Topics, topic(t))
			}
			s.Consumers = append(s.Consumers, cons)
		}
		switch name {
		case comandes.Name:
			s.Requests = []string{pagaments.AuthQueue}
		case pagaments.Name:
			s.Serves = []string{pagaments.AuthQueue}
		case inventari.Name:
			s.Serves = []string{inventari.ReserveQueue}
		}
		out = append(out, s)
	}
	return out
}

// RequiredACLs are the minimal Kafka ACLs of the deployment o
// (kafkaacl.Required of KafkaACLServices), sorted.
func RequiredACLs(o ACLOptions) []kafkaacl.ACL { return kafkaacl.Required(KafkaACLServices(o)) }

// TopicSpecs are the topics the deployment needs with the settings km0
// creates them with under ts: the four domain topics with their .retry and
// .dlq (renamed by renames), and the request/reply topics
// pagaments.autoritzacions and inventari.reserves, each with
// kafka.PartitionsDefault partitions.
func TopicSpecs(renames map[string]string, ts kafka.TopicSettings) []kafka.TopicSpec {
	var out []kafka.TopicSpec
	for _, t := range append(domainTopics(renames), pagaments.AuthQueue, inventari.ReserveQueue) {
		out = append(out, ts.Spec(t, kafka.PartitionsDefault))
	}
	return out
}
