package dlq

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/keyorder"
)

// Sequence is a key blocked by a consumer in per-key order mode
// (consumer.PerKey), as `km0 dlq sequence` and the console show it: the
// head and the messages parked behind it (package keyorder), with the
// pending dead letters of each.
type Sequence struct {
	keyorder.Sequence
	// HeadLetters are the head's pending dead letters (one, or several
	// copies after a crash; replaying one is enough).
	HeadLetters []*Letter `json:"-"`
	// BehindLetters are the pending dead letters of the messages behind
	// the head, by id_esdeveniment (DeadLetterBlocked copies them there).
	BehindLetters map[string][]*Letter `json:"-"`
}

// ErrNotBlocked is returned for a key its consumer does not block.
var ErrNotBlocked = errors.New("dlq: key not blocked by this consumer")

// ErrNoHeadLetter is returned by ReplaySequence and EditSequence for a key
// whose head has no pending dead letter (it waits for a retry, or its letter
// was replayed already): nothing is changed.
var ErrNoHeadLetter = errors.New("dlq: nothing to replay")

// KeySequence reads consumer's sequence for key from the keyorder store ko
// (in db) and the dead letters of its messages from src, and records the
// head's newest pending letter as its id_carta (keyorder.Store.SetLetter). It returns an error
// wrapping ErrNotBlocked when the key is not blocked.
func KeySequence(ctx context.Context, src Source, ko *keyorder.Store, db keyorder.DBTX, consumer, key string) (*Sequence, error) {
	ks, ok, err := ko.Sequence(ctx, db, consumer, key)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, fmt.Errorf("%w: %s, key %q", ErrNotBlocked, consumer, Safe(key))
	}
	seq := &Sequence{Sequence: ks, BehindLetters: map[string][]*Letter{}}
	ids := []string{ks.Head.MessageID}
	for _, p := range ks.Behind {
		if p.ID != ks.Head.MessageID {
			ids = append(ids, p.ID)
		}
	}
	l, err := src.List(ctx, Filter{EventIDs: ids, States: []State{StatePending}})
	if err != nil {
		return nil, err
	}
	for _, lt := range l.Letters {
		if lt.EventID == ks.Head.MessageID {
			seq.HeadLetters = append(seq.HeadLetters, lt)
		} else {
			seq.BehindLetters[lt.EventID] = append(seq.BehindLetters[lt.EventID], lt)
		}
	}
	if len(seq.HeadLetters) > 0 {
		// claus_bloquejades.id_carta: the consumer could not know it.
		head := seq.newestHead()
		if err := ko.SetLetter(ctx, db, consumer, key, ks.Head.MessageID, head.ID); err != nil {
			return nil, err
		}
		seq.Head.LetterID = head.ID
	}
	return seq, nil
}

// ReplaySequence replays seq as one (the report's first item is the head's
// replay, the others the letters it marked purged): the head's newest pending letter goes
// back to its original topic (the consumer applies it and then releases
// every message behind it, in order, from its store), and the letters of the
// messages behind it are marked purged, since they are applied from the
// store and a replay of them alone would only park them again. A head with
// no pending letter (it waits for a retry, or StayParked with the letter
// already replayed) is refused: nothing is changed.
func ReplaySequence(ctx context.Context, src Source, seq *Sequence, o ReplayOptions) (*Report, error) {
	if len(seq.HeadLetters) == 0 {
		return nil, fmt.Errorf("%w: the head %s of key %q has no pending dead letter (motiu %s)",
			ErrNoHeadLetter, Safe(seq.Head.MessageID), Safe(seq.Key), seq.Head.Reason)
	}
	head := seq.newestHead()
	rep, err := src.Replay(ctx, Filter{IDs: []string{head.ID}}, o)
	if err != nil || rep.Done != 1 || o.DryRun {
		return rep, err
	}
	return seq.purgeBehind(ctx, src, head, rep, o.Actor)
}

// SequenceReplay is what ReplaySequences did with one blocked key.
type SequenceReplay struct {
	Key string
	// Report is ReplaySequence's report: the head's replay first, then the
	// letters it marked purged. Nil when nothing was replayed.
	Report *Report
	// Err is why the head was not replayed (ErrNoHeadLetter: nothing to
	// replay), or, with a Report, why marking the letters behind it failed.
	Err error
}

// Replayed reports whether the key's head went back to its topic and every
// letter behind it was marked.
func (r SequenceReplay) Replayed() bool {
	return r.Err == nil && r.Report != nil && r.Report.Done > 0 && r.Report.Refused == 0
}

// sequencesPage is how many blocked keys ReplaySequences reads at a time.
const sequencesPage = 500

// ReplaySequences replays, each as one (ReplaySequence), the keys that
// consumer blocks in the keyorder store ko (in db): the keys named, or every
// key it blocks when keys is nil, in key order. A key that is not blocked (any
// more) is passed over. A key whose head cannot be replayed is reported with
// its Err and the others are still replayed; the error returned is only one
// that stops the walk (the blocked keys or a sequence could not be read), with
// what was done until then. Watch the reports (Service.Watch) to learn which
// heads were dead-lettered again.
func ReplaySequences(ctx context.Context, src Source, ko *keyorder.Store, db keyorder.DBTX, consumer string, keys []string,
	o ReplayOptions) ([]SequenceReplay, error) {
	var out []SequenceReplay
	replay := func(ks []string) error {
		for _, k := range ks {
			seq, err := KeySequence(ctx, src, ko, db, consumer, k)
			if errors.Is(err, ErrNotBlocked) {
				continue // released meanwhile
			}
			if err != nil {
				return err
			}
			rep, err := ReplaySequence(ctx, src, seq, o)
			out = append(out, SequenceReplay{Key: k, Report: rep, Err: err})
		}
		return nil
	}
	if keys != nil {
		return out, replay(keys)
	}
	after := ""
	for {
		ks, err := ko.BlockedKeys(ctx, db, consumer, after, sequencesPage)
		if err != nil {
			return out, err
		}
		if err := replay(ks); err != nil {
			return out, err
		}
		if len(ks) < sequencesPage {
			return out, nil
		}
		after = ks[len(ks)-1]
	}
}

// EditSequence is ReplaySequence with the head's payload edited: the head's
// newest pending letter is replayed with value (Service.ReplayEdited:
// validated against its schema first, the original kept), and the letters
// behind it are marked purged once it went out. This is the way out of a
// head that can never succeed as it is, in order: its consumer applies the
// edited head, then every message behind it.
func EditSequence(ctx context.Context, svc Source, seq *Sequence, value []byte, o EditOptions) (*Report, error) {
	if len(seq.HeadLetters) == 0 {
		return nil, fmt.Errorf("%w: the head %s of key %q has no pending dead letter (motiu %s)",
			ErrNoHeadLetter, Safe(seq.Head.MessageID), Safe(seq.Key), seq.Head.Reason)
	}
	head := seq.newestHead()
	rep, err := svc.ReplayEdited(ctx, head.ID, value, o)
	if err != nil || rep.Done != 1 {
		return rep, err
	}
	return seq.purgeBehind(ctx, svc, head, rep, o.Actor)
}

// newestHead is the head's newest pending letter.
func (seq *Sequence) newestHead() *Letter {
	head := seq.HeadLetters[len(seq.HeadLetters)-1]
	for _, l := range seq.HeadLetters {
		if l.DeadAt.After(head.DeadAt) {
			head = l
		}
	}
	return head
}

// purgeBehind marks purged the letters behind the replayed head, and the
// head's other copies, appending to rep.
func (seq *Sequence) purgeBehind(ctx context.Context, src Source, head *Letter, rep *Report, actor string) (*Report, error) {
	var behind []string
	for _, ls := range seq.BehindLetters {
		for _, l := range ls {
			behind = append(behind, l.ID)
		}
	}
	for _, l := range seq.HeadLetters {
		if l.ID != head.ID {
			behind = append(behind, l.ID) // the head's other copies: the replay covers them
		}
	}
	if len(behind) == 0 {
		return rep, nil
	}
	pr, err := src.Purge(ctx, Filter{IDs: behind}, PurgeOptions{Confirmed: true, Actor: actor})
	if err != nil {
		return rep, fmt.Errorf("dlq: head replayed; marking the letters behind it: %w", err)
	}
	rep.Items = append(rep.Items, pr.Items...)
	return rep, nil
}

// HeadRef names a key a consumer blocks.
type HeadRef struct{ Consumer, Key string }

// BlockedHeads returns the keys (and their consumers) whose blocked head is
// the event eventID, from the keyorder tables in schema; none when the
// tables do not exist (no consumer runs in per-key order).
func BlockedHeads(ctx context.Context, db keyorder.DBTX, schema, eventID string) ([]HeadRef, error) {
	t := pgx.Identifier{schema, "claus_bloquejades"}.Sanitize()
	var exists *string
	if err := db.QueryRow(ctx, `SELECT to_regclass($1)::text`, t).Scan(&exists); err != nil {
		return nil, fmt.Errorf("dlq: blocked heads: %w", err)
	}
	if exists == nil {
		return nil, nil
	}
	rows, err := db.Query(ctx, `SELECT consumidor, clau FROM `+t+` WHERE id_missatge = $1 ORDER BY consumidor, clau LIMIT 20`, eventID)
	if err != nil {
		return nil, fmt.Errorf("dlq: blocked heads: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (HeadRef, error) {
		var h HeadRef
		var k []byte
		err := r.Scan(&h.Consumer, &k)
		h.Key = string(k)
		return h, err
	})
}
