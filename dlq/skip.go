package dlq

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/keyorder"
)

// SkipOptions tune SkipSequence.
type SkipOptions struct {
	// Actor names who skips, for the audit log. Default "unknown".
	Actor string
	// Reason says why the head can never succeed; required, kept in the
	// audit log entry of the skip.
	Reason string
	// Retention is Replay's, for the letter of the message that becomes the
	// head.
	Retention time.Duration
}

// SkipReport says what SkipSequence did.
type SkipReport struct {
	// Skipped is the head's letters, marked purged (the audit log's skip
	// entry).
	Skipped *Report `json:"saltades"`
	// Next is the id_esdeveniment of the message that became the head and
	// was replayed; "" when nothing waited behind the skipped head (the key
	// is released).
	Next string `json:"seguent,omitempty"`
	// Replay is the replay of Next's letter and then the letters behind it
	// marked purged, as ReplaySequence reports it (nil when Next is ""):
	// watch it (Service.Watch) to see whether Next took.
	Replay *Report `json:"reproduccio,omitempty"`
}

// TxBeginner begins a transaction: a pgxpool.Pool, a pgx.Conn.
type TxBeginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// ErrSkipRefused wraps every reason SkipSequence changes nothing.
var ErrSkipRefused = errors.New("dlq: skip refused")

// SkipSequence is the way out of a dead-lettered head that can never
// succeed, keeping the order of what waits behind it: the head is given up
// (not delivered; its letters are marked purged and the audit log records a
// skip, ActionSkip, with who, when and o.Reason), the first message parked
// behind it becomes the key's head (keyorder.Store.Skip, in db, the
// consumer's database, committed first) and its dead letter is replayed to
// its consumer, which applies it and then releases the rest in order; their
// letters are marked purged as ReplaySequence does. With nothing behind the
// head, the key is simply released.
//
// It refuses (ErrSkipRefused, nothing changed) without a reason, for a head
// that waits for a retry or has no pending letter, when the message behind
// it has no pending letter to replay (Behind: StayParked keeps none: replay
// or edit the head instead) and when the sequence changed since seq was read.
// If the skip committed and the replay of the next message failed, the error
// says so: that message is the head now, and `km0 dlq sequence --replay`
// replays it.
func SkipSequence(ctx context.Context, src Source, ko *keyorder.Store, db TxBeginner, seq *Sequence, o SkipOptions) (*SkipReport, error) {
	o.Reason = strings.TrimSpace(o.Reason)
	if o.Reason == "" {
		return nil, fmt.Errorf("%w: say why the head can never succeed (a reason is required)", ErrSkipRefused)
	}
	if seq.Head.Reason != keyorder.ReasonDeadLettered {
		return nil, fmt.Errorf("%w: the head %s of key %q waits for a retry (motiu %s), it is not dead-lettered",
			ErrSkipRefused, Safe(seq.Head.MessageID), Safe(seq.Key), seq.Head.Reason)
	}
	if len(seq.HeadLetters) == 0 {
		return nil, fmt.Errorf("%w: the head %s of key %q has no pending dead letter", ErrSkipRefused, Safe(seq.Head.MessageID), Safe(seq.Key))
	}
	var behind []keyorder.Parked
	for _, p := range seq.Behind {
		if p.ID != seq.Head.MessageID {
			behind = append(behind, p)
		}
	}
	slices.SortFunc(behind, func(a, b keyorder.Parked) int { return cmp.Compare(a.Seq, b.Seq) })
	var next *Letter
	if len(behind) > 0 {
		ls := seq.BehindLetters[behind[0].ID]
		if len(ls) == 0 {
			return nil, fmt.Errorf("%w: the message %s behind the head has no pending dead letter to replay (its consumer keeps them parked): "+
				"replay or edit the head instead", ErrSkipRefused, Safe(behind[0].ID))
		}
		next = newest(ls)
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("dlq: skip: begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after Commit
	nextID := ""
	if next != nil {
		nextID = next.ID
	}
	p, ok, err := ko.Skip(ctx, tx, seq.Consumer, seq.Key, seq.Head.MessageID, nextID)
	switch {
	case errors.Is(err, keyorder.ErrNotHead), errors.Is(err, keyorder.ErrNotDeadLettered):
		return nil, fmt.Errorf("%w: the sequence of key %q changed since it was read (%v): read it again", ErrSkipRefused, Safe(seq.Key), err)
	case err != nil:
		return nil, fmt.Errorf("dlq: skip: %w", err)
	case ok != (next != nil) || (ok && p.ID != behind[0].ID):
		return nil, fmt.Errorf("%w: the messages behind the head of key %q changed since they were read: read it again", ErrSkipRefused, Safe(seq.Key))
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("dlq: skip: %w", err)
	}
	var heads []string
	for _, l := range seq.HeadLetters {
		heads = append(heads, l.ID)
	}
	out := &SkipReport{}
	out.Skipped, err = src.Purge(ctx, Filter{IDs: heads}, PurgeOptions{Confirmed: true, Actor: o.Actor, action: ActionSkip,
		note: "fet: skipped: " + o.Reason})
	if err != nil {
		return out, fmt.Errorf("dlq: the head is skipped; marking its letters purged: %w", err)
	}
	if next == nil {
		return out, nil
	}
	out.Next = behind[0].ID
	out.Replay, err = src.Replay(ctx, Filter{IDs: []string{next.ID}}, ReplayOptions{Actor: o.Actor, Retention: o.Retention})
	if err == nil && out.Replay.Done != 1 {
		reason := "refused"
		if len(out.Replay.Items) > 0 {
			reason = out.Replay.Items[0].Refused
		}
		err = errors.New(reason)
	}
	if err != nil {
		return out, fmt.Errorf("dlq: the head is skipped, and %s behind it is the head now, but its letter %s was not replayed: %w "+
			"(replay the sequence)", Safe(out.Next), next.ID, err)
	}
	var rest []string
	for _, ls := range seq.BehindLetters {
		for _, l := range ls {
			if l.ID != next.ID {
				rest = append(rest, l.ID)
			}
		}
	}
	if len(rest) == 0 {
		return out, nil
	}
	slices.Sort(rest)
	pr, err := src.Purge(ctx, Filter{IDs: rest}, PurgeOptions{Confirmed: true, Actor: o.Actor})
	if err != nil {
		return out, fmt.Errorf("dlq: next head replayed; marking the letters behind it: %w", err)
	}
	out.Replay.Items = append(out.Replay.Items, pr.Items...)
	return out, nil
}

// newest is the newest of letters ls (not empty).
func newest(ls []*Letter) *Letter {
	n := ls[len(ls)-1]
	for _, l := range ls {
		if l.DeadAt.After(n.DeadAt) {
			n = l
		}
	}
	return n
}
