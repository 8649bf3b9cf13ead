package dlqcli

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/user"
	"text/tabwriter"
	"time"

	"github.com/km0/km0/dlq"
	"github.com/km0/km0/inbox"
	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/keyorder"
)

// sequence is `km0 dlq sequence`: the head of a key a per-key order consumer
// blocks and the messages parked behind it, in order, each with its pending
// dead letters; with --replay, the sequence replayed as one.
func (c *CLI) sequence(ctx context.Context, args []string) error {
	fs, o := c.flags("sequence", "show a key blocked by a per-key order consumer (its head and the messages behind it); --replay replays it as one")
	consumer := fs.String("consumer", "", "the consumer's Name (consumidor), e.g. inventari.descompte_estoc (required)")
	key := fs.String("key", "", "the message key (agregat_id), e.g. P-2026-000123 (without it: the consumer's blocked keys; with --replay: every one of them)")
	replay := fs.Bool("replay", false, "replay the head's dead letter; its consumer then applies every message behind it in order, and their letters are marked purged (without --key: every blocked key of the consumer)")
	edit := fs.String("edit", "", "with --replay and --key: replay the head with the envelope in this file instead of its own (validated against the event's JSON Schema first; the original is kept)")
	watch := fs.Duration("watch", dlq.WatchDefault, "with --replay: watch this long for the consumer dead-lettering a head again, and say so (0: do not watch)")
	skip := fs.Bool("skip", false, "with --key and --reason: give up the dead-lettered head (not delivered; recorded in the audit log) and release the messages behind it, in order")
	why := fs.String("reason", "", "with --skip: why the head can never succeed, for the audit log")
	dry := fs.Bool("dry-run", false, "with --replay: say what would be replayed; publish and mark nothing")
	retention := fs.Duration("retention", inbox.RetentionDefault, "the consumers' idempotency retention: an older head letter is refused")
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	if *consumer == "" || (*edit != "" && (*key == "" || !*replay)) || (*skip && (*key == "" || *why == "" || *replay || *dry)) {
		fmt.Fprintln(c.ErrOut, "km0 dlq sequence: want --consumer (and --key to show or replay one key; --edit needs --replay and --key; "+
			"--skip needs --key and --reason, without --replay or --dry-run)")
		fs.Usage()
		return cli.ErrUsage
	}
	env, err := c.Open(ctx, o, nil, true)
	if err != nil {
		return err
	}
	defer env.Close()
	ko, err := keyorder.New(keyorder.Config{Schema: *o.Schema})
	if err != nil {
		return err
	}
	if *key == "" && *replay {
		return c.replayAllSequences(ctx, env, ko, *consumer, dlq.ReplayOptions{DryRun: *dry, Retention: *retention, Actor: cliActor()}, *watch, *o.JSON)
	}
	if *key == "" {
		return c.blockedKeys(ctx, env, ko, *consumer, *o.JSON)
	}
	seq, err := dlq.KeySequence(ctx, env.Svc, ko, env.Pool, *consumer, *key)
	if errors.Is(err, dlq.ErrNotBlocked) {
		fmt.Fprintf(c.Out, "key %q is not blocked by %s: nothing waits\n", dlq.Safe(*key), dlq.Safe(*consumer))
		return nil
	}
	if err != nil {
		return err
	}
	if *skip {
		return c.skipSequence(ctx, env, ko, seq, dlq.SkipOptions{Actor: cliActor(), Reason: *why, Retention: *retention}, *watch, *o.JSON)
	}
	if *replay {
		var rep *dlq.Report
		if *edit != "" {
			value, rerr := os.ReadFile(*edit)
			if rerr != nil {
				return fmt.Errorf("--edit: %w", rerr)
			}
			if *dry {
				return errors.New("--edit with --dry-run: nothing to simulate; the edit is validated when it is replayed")
			}
			rep, err = dlq.EditSequence(ctx, env.Svc, seq, value, dlq.EditOptions{Actor: cliActor(), Retention: *retention})
		} else {
			rep, err = dlq.ReplaySequence(ctx, env.Svc, seq, dlq.ReplayOptions{DryRun: *dry, Retention: *retention, Actor: cliActor()})
		}
		if err != nil {
			return err
		}
		var takes []dlq.Take
		if !*dry && *watch > 0 && rep.Done > 0 {
			if takes, err = env.Svc.Watch(ctx, *watch, 0, rep); err != nil {
				return err
			}
		}
		if *o.JSON {
			if err := c.printJSON(map[string]any{"report": rep, "takes": takes}); err != nil {
				return err
			}
			return notTaken(takes)
		}
		for i, it := range rep.Items { // the head's replay first, then the letters marked purged
			switch {
			case it.Refused != "":
				fmt.Fprintf(c.Out, "refused %s: %s\n", it.ID, it.Refused)
			case i == 0:
				fmt.Fprintf(c.Out, "replayed the head %s -> %s (id_esdeveniment %s)\n", it.ID, it.Topic, orDash(dlq.Safe(it.EventID)))
			default:
				fmt.Fprintf(c.Out, "marked purged %s (released with the head)\n", it.ID)
			}
		}
		if rep.Done == 0 || rep.Refused > 0 {
			return fmt.Errorf("the head was not replayed")
		}
		if err := c.printTakes(takes, *watch); err != nil {
			return err
		}
		fmt.Fprintf(c.Out, "%d message(s) behind the head will be applied after it, in order\n", len(seq.Behind))
		return nil
	}
	if *o.JSON {
		return c.printJSON(sequenceView(seq))
	}
	tw := tabwriter.NewWriter(c.Out, 2, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "consumer:\t%s\nkey:\t%q\n", dlq.Safe(seq.Consumer), seq.Key)
	fmt.Fprintf(tw, "head:\t%s (%s, since %s)\n", dlq.Safe(seq.Head.MessageID), seq.Head.Reason.English(), stamp(seq.Head.Since))
	fmt.Fprintf(tw, "last error:\t%s\n", orDash(dlq.Safe(seq.Head.LastError)))
	for _, l := range seq.HeadLetters {
		fmt.Fprintf(tw, "head letter:\t%s\n", l.ID)
	}
	_ = tw.Flush()
	fmt.Fprintf(c.Out, "\n%d message(s) behind it:\n", len(behindOf(seq)))
	tw = tabwriter.NewWriter(c.Out, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SEQ\tID_ESDEVENIMENT\tTIPUS\tSTATE\tORIGIN\tLETTER")
	for _, p := range behindOf(seq) {
		letter := "-"
		if ls := seq.BehindLetters[p.ID]; len(ls) > 0 {
			letter = ls[0].ID
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\n", p.Seq, dlq.Safe(p.ID), orDash(dlq.Safe(tipusOf(p))), p.State.English(),
			fmt.Sprintf("%s/%d/%s", dlq.Safe(p.Topic), p.Partition, num(p.Offset)), letter)
	}
	return tw.Flush()
}

// behindOf is the messages behind the head (without the head's own stored
// row, kept while a released message that failed is the head).
func behindOf(seq *dlq.Sequence) []keyorder.Parked {
	out := make([]keyorder.Parked, 0, len(seq.Behind))
	for _, p := range seq.Behind {
		if p.ID != seq.Head.MessageID {
			out = append(out, p)
		}
	}
	return out
}

func tipusOf(p keyorder.Parked) string {
	for _, h := range p.Headers {
		if h.Key == "tipus" {
			return h.Value
		}
	}
	return ""
}

// sequenceView is the JSON of `km0 dlq sequence --json`.
func sequenceView(seq *dlq.Sequence) map[string]any {
	letters := func(ls []*dlq.Letter) []string {
		out := []string{}
		for _, l := range ls {
			out = append(out, l.ID)
		}
		return out
	}
	var behind []map[string]any
	for _, p := range behindOf(seq) {
		behind = append(behind, map[string]any{
			"seq": p.Seq, "id_esdeveniment": dlq.Safe(p.ID), "tipus": dlq.Safe(tipusOf(p)), "estat": p.State,
			"topic": dlq.Safe(p.Topic), "particio": p.Partition, "offset": p.Offset, "letters": letters(seq.BehindLetters[p.ID]),
		})
	}
	return map[string]any{
		"consumidor": dlq.Safe(seq.Consumer), "clau": dlq.Safe(seq.Key),
		"head": map[string]any{"id_esdeveniment": dlq.Safe(seq.Head.MessageID), "motiu": seq.Head.Reason,
			"ultim_error": dlq.Safe(seq.Head.LastError), "since": seq.Head.Since, "letters": letters(seq.HeadLetters)},
		"behind": behind,
	}
}

// blockedKeys lists the keys consumer blocks (up to 1,000), in key order.
func (c *CLI) blockedKeys(ctx context.Context, env *Env, ko *keyorder.Store, consumer string, asJSON bool) error {
	keys, err := ko.BlockedKeys(ctx, env.Pool, consumer, "", 1000)
	if err != nil {
		return fmt.Errorf("blocked keys of %s: %w (are the keyorder tables in --schema?)", dlq.Safe(consumer), err)
	}
	safe := make([]string, len(keys))
	for i, k := range keys {
		safe[i] = dlq.Safe(k)
	}
	if asJSON {
		return c.printJSON(map[string]any{"consumidor": dlq.Safe(consumer), "keys": safe})
	}
	fmt.Fprintf(c.Out, "%d key(s) blocked by %s\n", len(keys), dlq.Safe(consumer))
	for _, k := range safe {
		fmt.Fprintf(c.Out, "  %q\n", k)
	}
	return nil
}

// printTakes says, per replayed head, whether its consumer dead-lettered it
// again while it was watched, and fails if one did.
func (c *CLI) printTakes(takes []dlq.Take, watched time.Duration) error {
	for _, t := range takes {
		if t.Took {
			fmt.Fprintf(c.Out, "%s: no new dead letter within %s\n", t.ID, watched)
		} else {
			fmt.Fprintf(c.Out, "%s: %s\n", t.ID, t)
		}
	}
	return notTaken(takes)
}

func notTaken(takes []dlq.Take) error {
	n := 0
	for _, t := range takes {
		if !t.Took {
			n++
		}
	}
	if n > 0 {
		return fmt.Errorf("%d replay(s) did not take: the head was dead-lettered again (edit it with --edit FILE)", n)
	}
	return nil
}

// replayAllSequences replays every key consumer blocks, each as one
// (dlq.ReplaySequences), then watches them together.
func (c *CLI) replayAllSequences(ctx context.Context, env *Env, ko *keyorder.Store, consumer string, o dlq.ReplayOptions,
	watch time.Duration, asJSON bool) error {
	res, err := dlq.ReplaySequences(ctx, env.Svc, ko, env.Pool, consumer, nil, o)
	if err != nil {
		return err
	}
	var reps []*dlq.Report
	replayed, refused := 0, 0
	for _, r := range res {
		if r.Err != nil {
			refused++
			fmt.Fprintf(c.ErrOut, "key %q: %v\n", dlq.Safe(r.Key), r.Err)
			continue
		}
		if r.Replayed() {
			replayed++
		} else {
			refused++
		}
		reps = append(reps, r.Report)
	}
	var takes []dlq.Take
	if !o.DryRun && watch > 0 && replayed > 0 {
		if takes, err = env.Svc.Watch(ctx, watch, 0, reps...); err != nil {
			return err
		}
	}
	if asJSON {
		if err := c.printJSON(map[string]any{"reports": reps, "takes": takes}); err != nil {
			return err
		}
	} else {
		verb := "replayed"
		if o.DryRun {
			verb = "would replay"
		}
		fmt.Fprintf(c.Out, "%s %d blocked sequence(s) of %s, %d refused\n", verb, replayed, dlq.Safe(consumer), refused)
		if err := c.printTakes(takes, watch); err != nil {
			return err
		}
	}
	if err := notTaken(takes); err != nil {
		return err
	}
	if refused > 0 {
		return fmt.Errorf("%d sequence(s) not replayed", refused)
	}
	return nil
}

// cliActor is who runs `km0 dlq`, for the audit log: cli:<user>@<host>.
func cliActor() string {
	name := "?"
	if u, err := user.Current(); err == nil {
		name = u.Username
	}
	host, _ := os.Hostname()
	return "cli:" + name + "@" + host
}
