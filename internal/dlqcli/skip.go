package dlqcli

import (
	"context"
	"fmt"
	"time"

	"github.com/km0/km0/dlq"
	"github.com/km0/km0/keyorder"
)

// skipSequence is `km0 dlq sequence --key K --skip --reason R`: the head of
// K, which can never succeed, is given up (recorded in the audit log with R)
// and the messages behind it are released in order (dlq.SkipSequence).
func (c *CLI) skipSequence(ctx context.Context, env *Env, ko *keyorder.Store, seq *dlq.Sequence, o dlq.SkipOptions,
	watch time.Duration, asJSON bool) error {
	rep, err := dlq.SkipSequence(ctx, env.Svc, ko, env.Pool, seq, o)
	if err != nil && (rep == nil || rep.Skipped == nil) {
		return err
	}
	var takes []dlq.Take
	if err == nil && watch > 0 && rep.Replay != nil {
		if takes, err = env.Svc.Watch(ctx, watch, 0, rep.Replay); err != nil {
			return err
		}
	}
	if asJSON {
		if jerr := c.printJSON(map[string]any{"report": rep, "takes": takes}); jerr != nil {
			return jerr
		}
		if err != nil {
			return err
		}
		return notTaken(takes)
	}
	for _, it := range rep.Skipped.Items {
		if it.Done {
			fmt.Fprintf(c.Out, "skipped the head %s (id_esdeveniment %s): marked purged, not delivered\n", it.ID, orDash(dlq.Safe(it.EventID)))
		} else {
			fmt.Fprintf(c.Out, "head letter %s: %s\n", it.ID, it.Refused)
		}
	}
	if err != nil {
		return err
	}
	if rep.Replay == nil {
		fmt.Fprintf(c.Out, "nothing waited behind it: key %q is released\n", dlq.Safe(seq.Key))
		return nil
	}
	for i, it := range rep.Replay.Items {
		switch {
		case it.Refused != "":
			fmt.Fprintf(c.Out, "refused %s: %s\n", it.ID, it.Refused)
		case i == 0:
			fmt.Fprintf(c.Out, "replayed %s, the new head -> %s (id_esdeveniment %s)\n", it.ID, it.Topic, orDash(dlq.Safe(it.EventID)))
		default:
			fmt.Fprintf(c.Out, "marked purged %s (released with the new head)\n", it.ID)
		}
	}
	if err := c.printTakes(takes, watch); err != nil {
		return err
	}
	fmt.Fprintf(c.Out, "%d message(s) behind the skipped head will be applied in order\n", len(behindOf(seq)))
	return nil
}
