package main

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/kafkaacl"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/transport/kafka"
)

func init() {
	register(&command{name: "acl", summary: "print the minimal broker permissions of each service (kafka-acls or rabbitmqctl commands), or --apply them through the Kafka admin API", run: runACL})
}

func runACL(ctx context.Context, args []string) error { return aclCmd(ctx, os.Stdout, os.Stderr, args) }

func aclCmd(ctx context.Context, out, errOut io.Writer, args []string) error {
	fs := cli.NewFlags("acl", "print the minimal Kafka ACLs of each km0 service (its own principal: User:km0-<service>, and User:km0-dlq for km0 dlq) as kafka-acls commands, apply them with --apply, or print RabbitMQ's set_permissions with --rabbitmq")
	fs.SetOutput(errOut)
	brokers := cli.BrokersFlag(fs)
	ksec := cli.KafkaSecurityFlags(fs)
	services := fs.String("services", "", "services to grant, comma separated, among "+strings.Join(system.Services, ", ")+" and "+system.DLQPrincipalName+" (default all)")
	principals := fs.String("principals", os.Getenv("KM0_ACL_PRINCIPALS"), "principal of each service: SERVICE=User:NAME,... (default $KM0_ACL_PRINCIPALS, else User:km0-<service>)")
	topics := fs.String("topics", os.Getenv("KM0_TOPICS"), "rename domain topics as km0 serve does: CONTRACT=NAME,... (default $KM0_TOPICS)")
	groups := fs.String("groups", os.Getenv("KM0_GROUPS"), "rename consumer groups as km0 serve does: CONSUMIDOR=GROUP,... (default $KM0_GROUPS)")
	commandConfig := fs.String("command-config", "", "administrator's client properties `file` to name in the printed kafka-acls commands (--command-config)")
	apply := fs.Bool("apply", false, "create the ACLs on --brokers through the Kafka admin API (the flags' principal must be allowed to alter ACLs) instead of printing them")
	rabbit := fs.Bool("rabbitmq", false, "print rabbitmqctl set_permissions commands of request/reply over RabbitMQ instead")
	vhost := fs.String("vhost", "/", "with --rabbitmq: the vhost")
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	var o system.ACLOptions
	var err error
	if o.Topics, err = parseRenames("--topics", *topics); err != nil {
		return err
	}
	if o.Groups, err = parseRenames("--groups", *groups); err != nil {
		return err
	}
	if o.Principals, err = parseRenames("--principals", *principals); err != nil {
		return err
	}
	known := append(append([]string{}, system.Services...), system.DLQPrincipalName)
	for s, p := range o.Principals {
		if !slices.Contains(known, s) || !strings.HasPrefix(p, "User:") || len(p) == len("User:") {
			return fmt.Errorf("--principals %s=%s: want SERVICE=User:NAME with SERVICE one of %s", s, p, strings.Join(known, ", "))
		}
	}
	for _, s := range splitList(*services) {
		if !slices.Contains(known, s) {
			return fmt.Errorf("--services %s: want some of %s", s, strings.Join(known, ", "))
		}
		o.Services = append(o.Services, s)
	}
	if *rabbit {
		if *apply {
			return fmt.Errorf("--apply is for Kafka; run the printed rabbitmqctl commands on a RabbitMQ node")
		}
		for _, c := range system.RabbitCommands(system.RabbitPermissions(o), *vhost) {
			fmt.Fprintln(out, c)
		}
		return nil
	}
	acls := system.RequiredACLs(o)
	if !*apply {
		bootstrap := cmp.Or(*brokers, "BROKERS")
		for _, c := range kafkaacl.Commands(acls, bootstrap, *commandConfig) {
			fmt.Fprintln(out, c)
		}
		return nil
	}
	bs, err := cli.RequireBrokers(*brokers)
	if err != nil {
		return err
	}
	log := cli.Logger()
	kopts, err := ksec.Opts(ctx, bs, log)
	if err != nil {
		return err
	}
	cl, err := kafka.NewClient(bs, kopts...)
	if err != nil {
		return err
	}
	defer cl.Close()
	actx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	if err := kafkaacl.Apply(actx, kadm.NewClient(cl), acls); err != nil {
		return err
	}
	principalsN := map[string]bool{}
	for _, a := range acls {
		principalsN[a.Principal] = true
	}
	fmt.Fprintf(out, "km0 acl: %d ACLs of %d principals applied on %s\n", len(acls), len(principalsN), strings.Join(bs, ","))
	return nil
}
