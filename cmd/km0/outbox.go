package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/relay"
	"github.com/km0/km0/relay/cdc"
)

func init() {
	register(&command{name: "outbox", summary: "operate the outbox: parked (list rows the broker refused) | release ID|--all | prune --older-than D", run: runOutbox})
}

func runOutbox(ctx context.Context, args []string) error {
	if len(args) == 0 || (args[0] != "parked" && args[0] != "release" && args[0] != "prune") {
		if len(args) > 0 && (args[0] == "-h" || args[0] == "--help") {
			outboxUsage()
			return nil
		}
		outboxUsage()
		return cli.ErrUsage
	}
	sub, args := args[0], args[1:]
	fs := cli.NewFlags("outbox "+sub, map[string]string{
		"parked":  "list the outbox rows the relay parked (refused for good), with the rows waiting behind each",
		"release": "release a parked row (km0 outbox release [flags] ID, or --all) so the relay retries it",
		"prune":   "delete published rows marked more than --older-than ago, in small batches (pending rows are never touched)",
	}[sub])
	dbURL := cli.DatabaseURLFlag(fs)
	schema := fs.String("schema", migrate.SchemaDefault, "PostgreSQL schema of the outbox")
	table := fs.String("outbox-table", migrate.OutboxDefault, "outbox table name")
	mode := fs.String("outbox", string(outbox.ModeTable), "table: the outbox's rows (<outbox>_aparcats); "+
		"wal: a WAL-mode outbox's parked messages (<outbox>_wal_aparcats, see docs/cdc.md)")
	all := false
	if sub == "release" {
		fs.BoolVar(&all, "all", false, "release every parked row")
	}
	var olderThan time.Duration
	var batch int
	if sub == "prune" {
		fs.DurationVar(&olderThan, "older-than", 0, "retention (required, positive): delete rows published longer ago than this, e.g. 168h")
		fs.IntVar(&batch, "batch", relay.PruneBatchDefault, fmt.Sprintf("rows per DELETE, each its own transaction, 1..%d", relay.PruneBatchMax))
	}
	// Accept the ID before or after the flags.
	var id string
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		id, args = args[0], args[1:]
	}
	if err := cli.ParseFlags(fs, args); err != nil {
		return parseErr(err)
	}
	if fs.NArg() > 0 && id == "" {
		id = fs.Arg(0)
	}
	if fs.NArg() > 1 || (sub != "release" && (id != "" || fs.NArg() > 0)) {
		fmt.Fprintf(os.Stderr, "km0 outbox %s: unexpected arguments\n", sub)
		return cli.ErrUsage
	}
	if sub == "prune" {
		switch {
		case olderThan <= 0:
			return fmt.Errorf("--older-than is required and must be positive (got %v)", olderThan)
		case batch < 1 || batch > relay.PruneBatchMax:
			return fmt.Errorf("--batch %d is outside 1..%d", batch, relay.PruneBatchMax)
		}
	}
	wal := *mode == string(outbox.ModeWAL)
	switch {
	case !wal && *mode != string(outbox.ModeTable):
		return fmt.Errorf("--outbox %q: want %s or %s", *mode, outbox.ModeTable, outbox.ModeWAL)
	case wal && sub == "prune":
		return errors.New("--outbox wal: a WAL-mode outbox has no rows to prune (its events live in the WAL, retained by the slot)")
	}
	names := migrate.Names{Schema: *schema, Outbox: *table}
	pool, err := cli.OpenPool(ctx, *dbURL, 1)
	if err != nil {
		return err
	}
	defer pool.Close()
	if wal {
		if err := relay.CheckOutbox(ctx, pool, names, true); err != nil {
			return err
		}
		return runOutboxWAL(ctx, pool, names, sub, id, all)
	}
	switch sub {
	case "prune":
		if err := relay.CheckOutbox(ctx, pool, names, false); err != nil {
			return err
		}
		n, err := relay.Prune(ctx, pool, names, olderThan, batch)
		if err != nil {
			return fmt.Errorf("pruned %d row(s), then: %w", n, err)
		}
		fmt.Printf("pruned %d published row(s) older than %v\n", n, olderThan)
		return nil
	case "parked":
		rows, err := relay.Parked(ctx, pool, names)
		if err != nil {
			return err
		}
		if err := printParked(rows, "rows"); err != nil {
			return err
		}
		if n, _ := cdc.ParkedWALCount(ctx, pool, names); n > 0 {
			fmt.Printf("(and %d parked message(s) of this outbox in WAL mode: km0 outbox parked --outbox wal)\n", n)
		}
		return nil
	default:
		if all == (id != "") {
			fmt.Fprintln(os.Stderr, "km0 outbox release: give either an ID or --all")
			return cli.ErrUsage
		}
		if all {
			n, err := relay.ReleaseAll(ctx, pool, names)
			if err != nil {
				return err
			}
			fmt.Printf("released %d parked row(s)\n", n)
			return nil
		}
		u, err := uuid.Parse(id)
		if err != nil {
			return fmt.Errorf("%q is not a row id (UUID): %w", id, err)
		}
		if err := relay.Release(ctx, pool, names, u); err != nil {
			return err
		}
		fmt.Printf("released %s: the relay will retry it\n", u)
		return nil
	}
}

// runOutboxWAL is parked and release for the WAL-mode outbox names, whose
// parked messages are rows of <outbox>_wal_aparcats (relay/cdc).
func runOutboxWAL(ctx context.Context, pool *pgxpool.Pool, names migrate.Names, sub, id string, all bool) error {
	if sub == "parked" {
		rows, err := cdc.ParkedWAL(ctx, pool, names)
		if err != nil {
			return err
		}
		return printParked(rows, "messages")
	}
	if all == (id != "") {
		fmt.Fprintln(os.Stderr, "km0 outbox release: give either an ID or --all")
		return cli.ErrUsage
	}
	if all {
		n, err := cdc.ReleaseAllWAL(ctx, pool, names)
		if err != nil {
			return err
		}
		fmt.Printf("released %d parked message(s)\n", n)
		return nil
	}
	u, err := uuid.Parse(id)
	if err != nil {
		return fmt.Errorf("%q is not a message id (UUID): %w", id, err)
	}
	if err := cdc.ReleaseWAL(ctx, pool, names, u); err != nil {
		return err
	}
	fmt.Printf("released %s: the relay will retry it\n", u)
	return nil
}

// printParked prints rows as an aligned table, or "no parked <what>".
func printParked(rows []relay.ParkedRow, what string) error {
	if len(rows) == 0 {
		fmt.Println("no parked " + what)
		return nil
	}
	tw := tabwriter.NewWriter(os.Stdout, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tAGREGAT_ID\tTIPUS\tAPARCAT_EN\tESPERANT\tMOTIU")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\n", r.ID, r.AggregateID, r.Type,
			r.ParkedAt.Format("2006-01-02 15:04:05"), r.Waiting, r.Reason)
	}
	return tw.Flush()
}

func outboxUsage() {
	fmt.Fprintln(os.Stderr, "usage: km0 outbox parked [--outbox wal] [flags]\n       km0 outbox release [--outbox wal] [flags] ID | --all\n       km0 outbox prune --older-than D [--batch N] [flags]\n(km0 outbox <sub> --help for the flags)")
}

// parseErr maps a flag error as cli.Parse does.
func parseErr(err error) error {
	if errors.Is(err, flag.ErrHelp) {
		return err
	}
	return cli.ErrUsage
}
