// Package cli is the flag conventions of the km0 binary, shared by cmd/km0,
// internal/bench and the command packages under internal/: usage lines, the
// credential flags (--NAME, --NAME-file, the environment), the check after
// parsing, the Kafka security and topic flags, the AMQP TLS flags, and how a
// command opens a pool and logs.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/internal/pgerr"
	"github.com/km0/km0/internal/redact"
	"github.com/km0/km0/transport/kafka"
)

// NewFlags returns a flag set whose usage names the command and summary.
func NewFlags(name, summary string) *flag.FlagSet {
	fs := flag.NewFlagSet("km0 "+name, flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "km0 %s: %s\n\nflags:\n", name, summary)
		printDefaults(fs)
	}
	return fs
}

// FlagAliases are the old spellings of renamed flags, per command (the
// first word after km0): OLD → NEW. ParseFlags registers each OLD a
// command's flag set lacks as a second name of its NEW flag, so scripts
// and manifests written for the old name still work; --help lists only
// NEW. One spelling for every listen address: --http-addr for a command's
// own HTTP server, --console-addr for the operator console, --kafka-addr
// and --embedded-kafka-addr for a Kafka broker's; flag names in English.
var FlagAliases = map[string]map[string]string{
	"up":    {"http": "http-addr", "console": "console-addr"},
	"serve": {"http": "http-addr", "console": "console-addr"},
	"demo":  {"console": "console-addr"},
	"relay": {"metrics-addr": "http-addr"},
	"kafka": {"addr": "kafka-addr"},
	"dlq":   {"estat": "state", "motiu": "reason"},
}

// aliasesOf returns the aliases of fs's command (see FlagAliases).
func aliasesOf(fs *flag.FlagSet) map[string]string {
	if w := strings.Fields(fs.Name()); len(w) > 1 {
		return FlagAliases[w[1]]
	}
	return nil
}

// addAliases registers the aliases of fs's command whose new flag fs has.
func addAliases(fs *flag.FlagSet) {
	for old, name := range aliasesOf(fs) {
		if f := fs.Lookup(name); f != nil && fs.Lookup(old) == nil {
			fs.Var(f.Value, old, "old name of --"+name)
		}
	}
}

// printDefaults is fs.PrintDefaults without the aliases.
func printDefaults(fs *flag.FlagSet) {
	aliases := aliasesOf(fs)
	shown := flag.NewFlagSet(fs.Name(), flag.ContinueOnError)
	shown.SetOutput(fs.Output())
	fs.VisitAll(func(f *flag.Flag) {
		if _, alias := aliases[f.Name]; alias && fs.Lookup(aliases[f.Name]) != nil {
			return
		}
		shown.Var(f.Value, f.Name, f.Usage)
		shown.Lookup(f.Name).DefValue = f.DefValue
	})
	shown.PrintDefaults()
}

// Parse parses args, mapping a flag error to ErrUsage (already printed).
// Then each flag whose value has a check (a credential flag's, see
// SecretString, and cmd/km0's mapFlag) reports what its Set could not: flag quotes the
// value of a failed Set, and a credential is never printed.
func Parse(fs *flag.FlagSet, args []string) error {
	if err := ParseFlags(fs, args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return ErrUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(fs.Output(), "km0: unexpected arguments: %s\n", strings.Join(fs.Args(), " "))
		return ErrUsage
	}
	var errs []error
	fs.VisitAll(func(f *flag.Flag) {
		if c, ok := f.Value.(Checker); ok {
			if err := c.Check(); err != nil {
				errs = append(errs, err)
			}
		}
	})
	if len(errs) > 0 {
		fmt.Fprintf(fs.Output(), "km0: %v\n", errors.Join(errs...))
		return ErrUsage
	}
	if ParseOnly {
		return ErrParsed
	}
	return nil
}

// ParseFlags is fs.Parse(args), but a flag error (flag prints it) is
// followed by one line pointing to --help instead of the whole help: the
// help is printed when it is asked for. A -h, -help or --help among args
// (before a --) asks for it. The old names of renamed flags are accepted
// (FlagAliases).
func ParseFlags(fs *flag.FlagSet, args []string) error {
	addAliases(fs)
	if !wantsHelp(args) {
		full := fs.Usage
		fs.Usage = func() { fmt.Fprintf(fs.Output(), "run %s --help for its flags\n", fs.Name()) }
		defer func() { fs.Usage = full }()
	}
	return fs.Parse(args)
}

// wantsHelp reports whether args hold -h, -help or --help before any --.
func wantsHelp(args []string) bool {
	for _, a := range args {
		switch a {
		case "--":
			return false
		case "-h", "-help", "--h", "--help":
			return true
		}
	}
	return false
}

// ParseOnly makes Parse return ErrParsed after a successful Parse, so the
// command stops before doing anything: the deploy artefacts' test checks
// their command lines against the real flags this way (cmd/km0/deploy_test.go).
var ParseOnly bool

// ErrParsed is Parse's result while ParseOnly is set.
var ErrParsed = errors.New("km0: flags parsed (Parse only)")

// Checker is a flag.Value with a check after parsing.
type Checker interface{ Check() error }

// DatabaseURLFlag registers --database-url and --database-url-file,
// defaulting to KM0_DATABASE_URL (SecretString).
func DatabaseURLFlag(fs *flag.FlagSet) *string {
	return SecretString(fs, "database-url", os.Getenv("KM0_DATABASE_URL"), "PostgreSQL URL (default $KM0_DATABASE_URL)")
}

// SecretString registers a flag that may carry a credential (a URL with a
// password, a token) in its three forms: --NAME VALUE (shown by ps: its
// usage says so), --NAME-file PATH (the value is the file's content, one
// line; see ReadSecretFile), and def, its environment form (e.g.
// os.Getenv("KM0_DATABASE_URL")), which either flag replaces. def is
// assigned after registration and the value has no String, so --help never
// prints it. Giving both --NAME and --NAME-file is a usage error.
func SecretString(fs *flag.FlagSet, name, def, usage string) *string {
	v := &secretValue{name: name, val: def}
	fs.Var(v, name, usage+"; on the command line it shows in ps: prefer the environment or --"+name+"-file")
	fs.Func(name+"-file", "read --"+name+" from the file at `PATH` (one line; make it readable by this user only)", v.setFile)
	return &v.val
}

// secretValue is the value of a SecretString flag: which of its flags gave
// it, and a conflict found by Set, reported by check after parsing.
type secretValue struct {
	name, val, by string
	both          bool
}

func (v *secretValue) String() string { return "" } // never the value

// Set never fails: flag would print the value in its error.
func (v *secretValue) Set(s string) error {
	v.assign("--"+v.name, s)
	return nil
}

func (v *secretValue) setFile(path string) error {
	s, err := ReadSecretFile(path)
	if err != nil {
		return err
	}
	v.assign("--"+v.name+"-file", s)
	return nil
}

func (v *secretValue) assign(by, s string) {
	v.both = v.both || (v.by != "" && v.by != by)
	v.val, v.by = s, by
}

func (v *secretValue) Check() error {
	if v.both {
		return fmt.Errorf("give --%s or --%s-file, not both", v.name, v.name)
	}
	return nil
}

// SecretFileMax bounds what ReadSecretFile reads.
const SecretFileMax = 64 << 10

// ReadSecretFile returns the content of the file at path, trimmed of
// surrounding white space: the file form of a credential flag. An
// unreadable, empty, multi-line or larger than 64 KiB file is an error that
// names the path, never the content.
func ReadSecretFile(path string) (string, error) {
	b, err := ReadSmallFile(path)
	if err != nil {
		return "", err
	}
	s := strings.TrimSpace(string(b))
	switch {
	case s == "":
		return "", fmt.Errorf("%s is empty", path)
	case strings.ContainsAny(s, "\r\n"):
		return "", fmt.Errorf("%s has more than one line (want the value alone)", path)
	}
	return s, nil
}

// ReadSmallFile reads the file at path, refusing one over SecretFileMax.
func ReadSmallFile(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err // *fs.PathError: the path and why
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, SecretFileMax+1))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if len(b) > SecretFileMax {
		return nil, fmt.Errorf("%s is larger than %d KiB", path, SecretFileMax>>10)
	}
	return b, nil
}

// BrokersFlag registers --brokers, defaulting to KM0_KAFKA_BROKERS.
func BrokersFlag(fs *flag.FlagSet) *string {
	return fs.String("brokers", os.Getenv("KM0_KAFKA_BROKERS"),
		"Kafka bootstrap brokers, comma separated (default $KM0_KAFKA_BROKERS)")
}

// EventsFlag registers --events, defaulting to KM0_EVENTS.
func EventsFlag(fs *flag.FlagSet) *string {
	return fs.String("events", os.Getenv("KM0_EVENTS"),
		"broker of the domain events: kafka or rabbitmq, then optionally TOPIC=BROKER,... per topic, e.g. kafka,comandes.esdeveniments=rabbitmq (default $KM0_EVENTS, else kafka; give every process the same)")
}

func RequireBrokers(s string) ([]string, error) {
	b := kafka.SplitBrokers(s)
	if len(b) == 0 {
		return nil, errors.New("no Kafka brokers: pass --brokers or set KM0_KAFKA_BROKERS")
	}
	return b, nil
}

// OpenPool opens a pool and checks it answers. The error never contains the
// password of the URL.
func OpenPool(ctx context.Context, url string, maxConns int32) (*pgxpool.Pool, error) {
	if url == "" {
		return nil, errors.New("no database: pass --database-url or set KM0_DATABASE_URL")
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("%w %s: want %s", ErrMalformedURL, redact.Malformed(url), DatabaseURLForm)
	}
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("database %s: %w", RedactURL(cfg), err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, ConnectError(cfg.ConnConfig.Config, err)
	}
	return pool, nil
}

// DatabaseURLForm is the form of --database-url an error shows.
const DatabaseURLForm = "postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE[?sslmode=disable|require|verify-full]"

// ConnectError names why a connection to the server of c failed: the
// database does not exist, the login was refused, or the server does not
// answer (then with pgx's cause). A refusal is the server's answer, so it
// is given alone: pgx's text would add a line per address and TLS mode it
// tried, and the TLS attempt's failure is not the cause.
func ConnectError(c pgconn.Config, err error) error {
	at := fmt.Sprintf("%s:%d", c.Host, c.Port)
	switch {
	case pgerr.MissingDatabase(err):
		return &ConnectRefusal{fmt.Sprintf("database %q does not exist on the PostgreSQL server at %s (create it, e.g. createdb -h %s -p %d -U %s %s, or name one that exists)",
			c.Database, at, c.Host, c.Port, c.User, c.Database), err}
	case pgerr.LoginRefused(err):
		var pe *pgconn.PgError
		errors.As(err, &pe)
		return &ConnectRefusal{fmt.Sprintf("the PostgreSQL server at %s refused the login of user %q to database %q: %s (check the password and the server's pg_hba.conf)", at, c.User, c.Database, pe.Message), err}
	}
	return fmt.Errorf("database postgres://%s@%s/%s does not answer: %w", c.User, at, c.Database, err)
}

// ErrMalformedURL starts the error of a --database-url that does not Parse.
var ErrMalformedURL = errors.New("invalid --database-url")

// ConnectRefusal is a server's refusal of a connection: its message names
// the cause; the server's error stays reachable by errors.As.
type ConnectRefusal struct {
	msg string
	err error
}

func (e *ConnectRefusal) Error() string { return e.msg }
func (e *ConnectRefusal) Unwrap() error { return e.err }

func RedactURL(cfg *pgxpool.Config) string {
	c := cfg.ConnConfig
	return fmt.Sprintf("postgres://%s@%s:%d/%s", c.User, c.Host, c.Port, c.Database)
}

// Logger is the process Logger: text to stderr, level from KM0_LOG_LEVEL.
func Logger() *slog.Logger {
	lvl := slog.LevelInfo
	if v := os.Getenv("KM0_LOG_LEVEL"); v != "" {
		_ = lvl.UnmarshalText([]byte(v))
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl}))
}

// KafkaSecurity is the Kafka security flag set every command that talks to
// Kafka registers (KafkaSecurityFlags): one spelling, each with an
// environment fallback, the password only from the environment or a file.
type KafkaSecurity struct {
	tls, skipVerify                *bool
	ca, cert, key, serverName      *string
	mechanism, username, tokenFile *string
	password                       string // $KM0_KAFKA_SASL_PASSWORD, or --kafka-sasl-password-file
	errs                           []error
}

// KafkaSecurityFlags registers --kafka-tls, --kafka-tls-ca-file,
// --kafka-tls-cert-file, --kafka-tls-key-file, --kafka-tls-server-name,
// --kafka-tls-insecure-skip-verify, --kafka-sasl-mechanism,
// --kafka-sasl-username, --kafka-sasl-password-file and
// --kafka-sasl-oauth-token-file, each defaulting to its KM0_KAFKA_*
// variable (docs/operations.md, "Kafka security"). There is no password
// flag: the password comes from $KM0_KAFKA_SASL_PASSWORD or the file. A
// boolean variable that is not a boolean is reported by Parse.
func KafkaSecurityFlags(fs *flag.FlagSet) *KafkaSecurity {
	k := &KafkaSecurity{password: os.Getenv("KM0_KAFKA_SASL_PASSWORD")}
	envBool := func(name string) bool {
		v := os.Getenv(name)
		if v == "" {
			return false
		}
		b, err := strconv.ParseBool(v)
		if err != nil {
			k.errs = append(k.errs, fmt.Errorf("$%s: want true or false", name))
		}
		return b
	}
	k.tls = fs.Bool("kafka-tls", envBool("KM0_KAFKA_TLS"), "Kafka: connect with TLS, verifying the brokers' certificates (default $KM0_KAFKA_TLS; any --kafka-tls-* flag turns it on)")
	k.ca = fs.String("kafka-tls-ca-file", os.Getenv("KM0_KAFKA_TLS_CA_FILE"), "Kafka: PEM `file` of the authorities trusted for the brokers' certificates (default $KM0_KAFKA_TLS_CA_FILE, else the system's roots)")
	k.cert = fs.String("kafka-tls-cert-file", os.Getenv("KM0_KAFKA_TLS_CERT_FILE"), "Kafka: PEM client certificate `file` for mutual TLS, with --kafka-tls-key-file (default $KM0_KAFKA_TLS_CERT_FILE)")
	k.key = fs.String("kafka-tls-key-file", os.Getenv("KM0_KAFKA_TLS_KEY_FILE"), "Kafka: PEM `file` of the client certificate's key (default $KM0_KAFKA_TLS_KEY_FILE)")
	k.serverName = fs.String("kafka-tls-server-name", os.Getenv("KM0_KAFKA_TLS_SERVER_NAME"), "Kafka: name checked in the brokers' certificates (default $KM0_KAFKA_TLS_SERVER_NAME, else each broker's host)")
	k.skipVerify = fs.Bool("kafka-tls-insecure-skip-verify", envBool("KM0_KAFKA_TLS_INSECURE_SKIP_VERIFY"), "Kafka: accept any certificate (encrypted but NOT authenticated; logs a warning; default $KM0_KAFKA_TLS_INSECURE_SKIP_VERIFY)")
	k.mechanism = fs.String("kafka-sasl-mechanism", os.Getenv("KM0_KAFKA_SASL_MECHANISM"), "Kafka: SASL mechanism, one of "+strings.Join(kafka.SASLMechanisms, ", ")+" (default $KM0_KAFKA_SASL_MECHANISM, else none)")
	k.username = fs.String("kafka-sasl-username", os.Getenv("KM0_KAFKA_SASL_USERNAME"), "Kafka: SASL user of PLAIN and SCRAM (default $KM0_KAFKA_SASL_USERNAME); the password comes from $KM0_KAFKA_SASL_PASSWORD or --kafka-sasl-password-file")
	fs.Func("kafka-sasl-password-file", "Kafka: read the SASL password from the file at `PATH` (one line; make it readable by this user only; default $KM0_KAFKA_SASL_PASSWORD)", func(path string) error {
		s, err := ReadSecretFile(path)
		if err != nil {
			return err
		}
		k.password = s
		return nil
	})
	k.tokenFile = fs.String("kafka-sasl-oauth-token-file", os.Getenv("KM0_KAFKA_SASL_OAUTH_TOKEN_FILE"), "Kafka: OAUTHBEARER token `file`, read again for each new connection (default $KM0_KAFKA_SASL_OAUTH_TOKEN_FILE)")
	fs.Var(k, "kafka-sasl-password", "not accepted: a password on the command line shows in ps; use $KM0_KAFKA_SASL_PASSWORD or --kafka-sasl-password-file")
	return k
}

// KafkaSecurity is also the flag.Value of --kafka-sasl-password, refused
// after parsing (check) without quoting what was given.
func (k *KafkaSecurity) String() string { return "" }

func (k *KafkaSecurity) Set(string) error {
	k.errs = append(k.errs, errors.New("--kafka-sasl-password is not accepted (it would show in ps): set $KM0_KAFKA_SASL_PASSWORD or pass --kafka-sasl-password-file"))
	return nil
}

func (k *KafkaSecurity) Check() error { return errors.Join(k.errs...) }

// Security returns the settings of the flags, the AWS credentials read
// from the environment, warnings to log.
func (k *KafkaSecurity) Security(log *slog.Logger) kafka.Security {
	return kafka.Security{TLS: *k.tls, TLSCAFile: *k.ca, TLSCertFile: *k.cert, TLSKeyFile: *k.key, TLSServerName: *k.serverName,
		TLSInsecureSkipVerify: *k.skipVerify, SASLMechanism: strings.ToUpper(strings.TrimSpace(*k.mechanism)), SASLUsername: *k.username,
		SASLPassword: k.password, SASLOAuthTokenFile: *k.tokenFile, Logger: log}
}

// KafkaPingTimeout bounds the start-up check of a secured connection.
const KafkaPingTimeout = 15 * time.Second

// Opts returns the kgo options of the flags for every Kafka client of the
// command. With TLS or SASL it also checks them once against brokers
// (kafka.Ping within KafkaPingTimeout): a refused certificate or password
// is an error naming the cause at start, not a hang; a broker that does not
// answer is only logged, as without security. The settings are logged
// without their secrets. Without brokers (no Kafka, or the embedded
// broker, which speaks plaintext) there are none.
func (k *KafkaSecurity) Opts(ctx context.Context, brokers []string, log *slog.Logger) ([]kgo.Opt, error) {
	if len(brokers) == 0 {
		return nil, nil // no Kafka, or the embedded broker (plaintext)
	}
	sec := k.Security(log)
	opts, err := sec.Opts()
	if err != nil || !sec.Enabled() {
		return opts, err
	}
	log.Info("kafka: connecting with "+sec.String(), "brokers", strings.Join(brokers, ","))
	cl, err := kafka.NewClient(brokers, opts...)
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	pctx, cancel := context.WithTimeout(ctx, KafkaPingTimeout)
	defer cancel()
	if err := kafka.Ping(pctx, cl); errors.Is(err, kafka.ErrSecurity) {
		return nil, err
	} else if err != nil {
		log.Warn("kafka: the brokers do not answer yet; going on", "err", err)
	}
	return opts, nil
}

// KafkaTopicFlags is --kafka-replication-factor, the replication factor of
// the topics a command creates.
type KafkaTopicFlags struct {
	rf  *int
	err error
}

// NewKafkaTopicFlags registers --kafka-replication-factor (default
// $KM0_KAFKA_REPLICATION_FACTOR, else kafka.ReplicationFactorAuto: 3 on a
// cluster of three brokers or more, one per broker on a smaller one, and 1
// on the embedded broker); min.insync.replicas follows (one less, at least 1) and the
// retention is the contract's 14 days.
func NewKafkaTopicFlags(fs *flag.FlagSet) *KafkaTopicFlags {
	k := &KafkaTopicFlags{}
	def := 0
	if v := os.Getenv("KM0_KAFKA_REPLICATION_FACTOR"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 32767 {
			k.err = fmt.Errorf("$KM0_KAFKA_REPLICATION_FACTOR %q: want a whole number from 1", v)
		}
		def = n
	}
	k.rf = fs.Int("kafka-replication-factor", def, "Kafka: replication factor of the topics km0 creates; min.insync.replicas is one less, retention 14 days (default $KM0_KAFKA_REPLICATION_FACTOR, else 3, or one per broker on a cluster of fewer than 3 brokers with a warning; 1 on the embedded broker); existing topics are left as they are")
	return k
}

// Settings returns the topic settings of the flag; embedded: the embedded
// broker (one node) is the target.
func (k *KafkaTopicFlags) Settings(embedded bool) (kafka.TopicSettings, error) {
	if k.err != nil {
		return kafka.TopicSettings{}, k.err
	}
	switch rf := *k.rf; {
	case rf < 0 || rf > 32767:
		return kafka.TopicSettings{}, fmt.Errorf("--kafka-replication-factor %d: want a whole number from 1", rf)
	case rf > 0:
		return kafka.TopicSettings{ReplicationFactor: int16(rf)}, nil
	case embedded:
		return kafka.TopicSettings{ReplicationFactor: kafka.ReplicationFactorEmbedded}, nil
	default:
		return kafka.TopicSettings{ReplicationFactor: kafka.ReplicationFactorAuto}, nil
	}
}

// ErrUsage is a usage error already printed: the binary exits 2 without
// printing it again.
var ErrUsage = errors.New("usage")

// ListFlag is a repeatable string flag.
type ListFlag []string

func (l *ListFlag) String() string     { return strings.Join(*l, ",") }
func (l *ListFlag) Set(v string) error { *l = append(*l, v); return nil }

// ParseInterspersed parses flags that may come after positional arguments.
func ParseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	var rest []string
	for {
		if err := ParseFlags(fs, args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, err
			}
			return nil, ErrUsage
		}
		if fs.NArg() == 0 {
			return rest, nil
		}
		rest = append(rest, fs.Arg(0))
		args = fs.Args()[1:]
	}
}
