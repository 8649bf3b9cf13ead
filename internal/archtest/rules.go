package archtest

// Layer is one row of the package map (docs/design/packages.md), from the
// bottom (contract) to the top (application).
type Layer string

// The layers, bottom to top.
const (
	Contract   Layer = "contract"   // the wire vocabulary: imports nothing of km0
	Base       Layer = "base"       // outcome, migrate, the transport interfaces, small internal helpers
	Pattern    Layer = "pattern"    // the patterns: outbox, relay, inbox, consumer, dlq, ...
	Transport  Layer = "transport"  // the broker implementations and request/reply adapters
	Tool       Layer = "tool"       // the operator console: a library of the binary
	TestKit    Layer = "testkit"    // helpers for tests and examples
	Appl       Layer = "app"        // the services, the demo, the benchmarks, the binary
	ThirdParty Layer = "thirdparty" // vendored modules
)

// layers places every package of the module (relative to the module path).
// A package that is in no entry fails the test: a new package takes its
// place in the map.
var layers = map[string]Layer{
	"contract": Contract,

	"outcome":              Base,
	"migrate":              Base,
	"transport":            Base,
	"schemas":              Base,
	"internal/pgerr":       Base,
	"internal/strictjson":  Base,
	"internal/redact":      Base,
	"internal/faults":      Base,
	"internal/pause":       Base,
	"internal/buildinfo":   Base,
	"internal/localserver": Base,
	"internal/hostguard":   Base,

	"envelope":  Pattern,
	"tracing":   Pattern,
	"inbox":     Pattern,
	"keyorder":  Pattern,
	"outbox":    Pattern,
	"relay":     Pattern,
	"relay/cdc": Pattern,

	"relay/internal/relaycore": Pattern,
	"consumer":                 Pattern,
	"requestreply":             Pattern,
	"schema":                   Pattern,
	"dlq":                      Pattern,
	"lag":                      Pattern,

	"transport/kafka":          Transport,
	"internal/kafkaacl":        Transport,
	embedPackage:               Transport,
	"transport/amqp":           Transport,
	"dlq/kafkadlq":             Transport,
	"dlq/amqpdlq":              Transport,
	"transport/kafka/kafkalag": Transport,
	"transport/amqp/amqplag":   Transport,
	"requestreply/amqprr":      Transport,
	"requestreply/kafkarr":     Transport,

	"console": Tool,

	"internal/pgtest":                    TestKit,
	"internal/pgcluster":                 TestKit,
	"internal/kafkatest":                 TestKit,
	"internal/relaytest":                 TestKit,
	"internal/testlog":                   TestKit,
	"internal/tlstest":                   TestKit,
	"internal/doctest":                   TestKit,
	"internal/archtest":                  TestKit,
	"internal/pgbouncer":                 TestKit,
	"internal/testkit":                   TestKit,
	"consumer/consumertest":              TestKit,
	"transport/transporttest":            TestKit,
	"internal/amqptest":                  TestKit,
	"internal/rrtest":                    TestKit,
	"internal/services/internal/svctest": TestKit,

	"internal/bench":                         Appl,
	"internal/cli":                           Appl,
	"internal/dlqcli":                        Appl,
	"internal/consolesrv":                    Appl,
	"internal/bench/consumerbench":           Appl,
	"internal/doctor":                        Appl,
	"internal/schemacheck":                   Appl,
	"cmd/km0":                                Appl,
	"internal/services/analitica":            Appl,
	"internal/services/cataleg":              Appl,
	"internal/services/comandes":             Appl,
	"internal/services/demo":                 Appl,
	"internal/services/inventari":            Appl,
	"internal/services/pagaments":            Appl,
	"internal/services/pagaments/passarella": Appl,
	"internal/services/repartiment":          Appl,
	"internal/services/svc":                  Appl,
	"internal/services/system":               Appl,
}

// mayImport says which layers a layer's non-test code may import. Tests
// (package x and x_test) may import anything.
var mayImport = map[Layer][]Layer{
	Contract:  {},
	Base:      {Contract, Base},
	Pattern:   {Contract, Base, Pattern},
	Transport: {Contract, Base, Pattern, Transport},
	Tool:      {Contract, Base, Pattern, Transport, Tool},
	TestKit:   {Contract, Base, Pattern, Transport, Tool, TestKit},
	Appl:      {Contract, Base, Pattern, Transport, Tool, TestKit, Appl},
}

// brokerFree are the layers whose non-test dependencies (transitively)
// hold no broker client: a pattern talks to a broker only through the
// interfaces of package transport.
var brokerFree = map[Layer]bool{Contract: true, Base: true, Pattern: true}

// brokerModules are the broker clients' import path prefixes.
var brokerModules = []string{"github.com/twmb/franz-go/", "github.com/rabbitmq/amqp091-go"}

// embeddedBroker is the in-process broker's import path prefix. Only
// embedPackage and the test kits import it, and no library package but
// embedPackage links it, also transitively: a program that uses
// kafka.NewSource does not carry kfake.
const embeddedBroker = "github.com/twmb/franz-go/pkg/kfake"

// embedPackage is the library package of the embedded broker, the one
// library package allowed to import kfake; the library does not import it
// (only test kits and the application do).
const embedPackage = "transport/kafka/kafkaembed"

// Exception is a known violation of the map, tolerated until the change
// named in Target removes it. An exception that no longer occurs fails the
// test, so the list only shrinks and what it held stays enforced.
type Exception struct {
	Pkg    string // the importing package, relative to the module
	Rule   string // "import <pkg>", "broker", or "embedded"
	Target string // the change of issue 22 that removes it
}

// exceptions are today's violations.
var exceptions = []Exception{}
