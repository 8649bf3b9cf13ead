package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// km0 acl --apply creates every ACL of system.RequiredACLs on a cluster
// with ACLs enforced, as its superuser authenticated by SCRAM-SHA-512 (the
// password from the environment); a second run changes nothing.
//
// Not parallel: t.Setenv, for the environment aclCmd (the SASL password)
// reads in this process.
func TestACLCommandApplies(t *testing.T) {
	pass := rand.Text()
	b := kafkatest.NewWith(t, kafkaembed.Config{Extra: []kfake.Opt{kfake.EnableSASL(), kfake.EnableACLs(), kfake.Superuser(kafka.SASLScramSHA512, "admin", pass)}})
	t.Setenv("KM0_KAFKA_SASL_PASSWORD", pass)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	want := len(system.RequiredACLs(system.ACLOptions{}))
	for range 2 {
		var out, errOut bytes.Buffer
		err := aclCmd(ctx, &out, &errOut, []string{"--apply", "--brokers", strings.Join(b.Addrs(), ","), "--kafka-sasl-mechanism", "SCRAM-SHA-512", "--kafka-sasl-username", "admin"})
		if err != nil || !strings.Contains(out.String(), " ACLs of 7 principals applied") {
			t.Fatalf("km0 acl --apply: %v\n%s%s", err, out.String(), errOut.String())
		}
	}
	opts, err := kafka.Security{SASLMechanism: kafka.SASLScramSHA512, SASLUsername: "admin", SASLPassword: pass}.Opts()
	if err != nil {
		t.Fatal(err)
	}
	res, err := kadm.NewClient(kafkatest.ClientFor(t, b.Addrs(), opts...)).DescribeACLs(ctx, kadm.NewACLs().AnyResource().Allow().AllowHosts().Operations(kadm.OpAny).ResourcePatternType(kadm.ACLPatternAny))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, r := range res {
		if r.Err != nil {
			t.Fatal(r.Err)
		}
		n += len(r.Described)
	}
	if n != want {
		t.Fatalf("%d ACLs on the cluster after two runs, want %d", n, want)
	}
}

// Without --apply it prints one kafka-acls command per principal and
// resource; --rabbitmq prints set_permissions; bad input is refused.
func TestACLCommandPrints(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var out, errOut bytes.Buffer
	if err := aclCmd(ctx, &out, &errOut, []string{"--brokers", "k:9093", "--services", "pagaments", "--principals", "pagaments=User:pag-prod", "--topics", "comandes.esdeveniments=prod.comandes"}); err != nil {
		t.Fatal(err)
	}
	s := out.String()
	for _, want := range []string{
		"kafka-acls --bootstrap-server k:9093 --add --allow-principal User:pag-prod --allow-host '*' --operation Read --topic prod.comandes --resource-pattern-type literal",
		"--allow-principal User:pag-prod --allow-host '*' --operation Read --group pagaments.cobrament",
	} {
		if !strings.Contains(s, want) {
			t.Errorf("no %q in:\n%s", want, s)
		}
	}
	if strings.Contains(s, "km0-") || strings.Contains(s, "--topic comandes.esdeveniments ") {
		t.Errorf("another principal or the renamed topic's contract name:\n%s", s)
	}
	out.Reset()
	if err := aclCmd(ctx, &out, &errOut, []string{"--rabbitmq", "--vhost", "km0"}); err != nil || strings.Count(out.String(), "rabbitmqctl set_permissions -p 'km0' ") != len(system.Services) {
		t.Fatalf("--rabbitmq: %v\n%s", err, out.String())
	}
	for _, bad := range [][]string{{"--services", "tresoreria"}, {"--principals", "pagaments=pag"}, {"--rabbitmq", "--apply"}} {
		if err := aclCmd(ctx, &out, &errOut, bad); err == nil {
			t.Errorf("%v: accepted", bad)
		}
	}
}
