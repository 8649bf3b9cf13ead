package main

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/km0/km0/internal/consolesrv"
	"github.com/km0/km0/internal/dlqcli"
	"github.com/km0/km0/internal/hostguard"

	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/lag"
)

// systemConsole starts the operator console of a running system (km0 up
// --console, km0 demo --keep-running) over its parts (system.OpenConsole:
// the dead-letter index in the database km0_dlq[_suffix] on adminURL's
// server, dropped at stop when drop is set; the lag; the HTTP servers) and
// prints its URL. Lag over rule's thresholds for rule.For is logged and
// sent to the DLQ webhook ($KM0_DLQ_WEBHOOK), as by km0 console. With no
// $KM0_DLQ_ADMIN_TOKEN it makes a random token for the run (runToken) and
// prints the path of the file that holds it, so that letters are never open.
func systemConsole(ctx context.Context, sys *system.System, addr, adminURL, suffix string, brokers []string, drop bool, rule lag.Rule, out io.Writer, name string, log *slog.Logger) (stop func(), err error) {
	c, err := sys.OpenConsole(ctx, system.ConsoleConfig{AdminURL: adminURL, Suffix: suffix, Drop: drop, Brokers: brokers, Logger: log, Name: name})
	if err != nil {
		return nil, err
	}
	closers := []func(){c.Close}
	cleanup := func() {
		for _, f := range slices.Backward(closers) {
			f()
		}
	}
	token := os.Getenv(dlqcli.AdminTokenEnv)
	if token == "" {
		var path string
		var remove func()
		if token, path, remove, err = runToken(); err != nil {
			cleanup()
			return nil, err
		}
		closers = append(closers, remove)
		fmt.Fprintf(out, "%s: no $%s: this run's admin token is in %s (mode 0600, removed at stop); log in to the console with it\n", name, dlqcli.AdminTokenEnv, path)
	}
	_, stopConsole, err := consolesrv.Serve(ctx, consolesrv.Parts{Addr: addr, Allowed: strings.Split(os.Getenv(hostguard.AllowedHostsEnv), ","),
		Token: token, Source: c.Source, Broker: c.Broker, Alerter: c.Alerter, ServiceDBs: c.ServiceDBs, Lag: consolesrv.LagTargets{Config: c.Lag, Brokers: c.LagBrokers, ClientOpts: c.LagClientOpts},
		Interval: lag.IntervalDefault, Rule: rule, Services: c.Services, Registry: c.Registry, Out: out, Name: name, Log: log})
	if err != nil {
		cleanup()
		return nil, err
	}
	closers = append(closers, stopConsole)
	return cleanup, nil
}

// runToken makes a random admin token for one run of a system's console
// and writes it to a new file that only this user can read (never to the
// terminal or the log); remove deletes the file.
func runToken() (token, path string, remove func(), err error) {
	b := make([]byte, 32)
	_, _ = rand.Read(b) // never fails (crypto/rand)
	token = base64.RawURLEncoding.EncodeToString(b)
	f, err := os.CreateTemp("", "km0-admin-token-*") // mode 0600
	if err != nil {
		return "", "", nil, fmt.Errorf("console: the run's admin token: %w", err)
	}
	if _, err = f.WriteString(token + "\n"); err == nil {
		err = f.Close()
	}
	if err != nil {
		_ = f.Close()
		_ = os.Remove(f.Name())
		return "", "", nil, fmt.Errorf("console: the run's admin token: %w", err)
	}
	return token, f.Name(), func() { _ = os.Remove(f.Name()) }, nil
}

// alertFlags are the lag-alert thresholds of the console that km0 up
// --console and km0 demo --keep-running start: the flags of km0 console.
type alertFlags struct {
	maxLag   *thresholdFlag[int64]
	maxAge   *thresholdFlag[time.Duration]
	alertFor *time.Duration
}

func addAlertFlags(fs *flag.FlagSet, with string) *alertFlags {
	f := &alertFlags{maxLag: &thresholdFlag[int64]{}, maxAge: &thresholdFlag[time.Duration]{},
		alertFor: fs.Duration("alert-for", 5*time.Minute, with+": how long a lag threshold must be exceeded before the alert")}
	fs.Var(f.maxLag, "max-lag", with+": alert (log and $KM0_DLQ_WEBHOOK) when a group's lag or an outbox's pending rows stay over this for --alert-for (0: any lag; default: off)")
	fs.Var(f.maxAge, "max-age", with+": alert when a group's oldest unprocessed record or an outbox's oldest row stays older than this for --alert-for (0: any age; default: off)")
	return f
}

func (f *alertFlags) rule() lag.Rule {
	return lag.Rule{MaxLag: f.maxLag.v, LagSet: f.maxLag.set, MaxAge: f.maxAge.v, AgeSet: f.maxAge.set, For: *f.alertFor}
}

// check refuses thresholds that no console would watch, and bad values.
func (f *alertFlags) check(console bool, with string) error {
	if *f.alertFor < 0 {
		return errors.New("--alert-for must not be negative")
	}
	if !console && (f.maxLag.set || f.maxAge.set) {
		return fmt.Errorf("--max-lag and --max-age are thresholds of the console: they need %s", with)
	}
	return nil
}
