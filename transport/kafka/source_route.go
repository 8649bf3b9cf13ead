package kafka

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/transport"
)

// retryItem reads the headers of a retry copy. It returns nil for a copy of
// another consumer group (its grup_consumidor differs). A copy without the
// header or with an empty one, e.g. from a plain Python consumer, is taken.
// The copy's headers are trusted no further than the configuration
// (contract.Attempt, contract.NotBefore): intents counts as at least 1 and
// makes at most the last attempt, and no_abans is at most BackoffMax away,
// so a forged or broken copy can neither retry forever nor be held (and
// hold its partition's committed offset back) longer than a copy of our own.
func (p *partition) retryItem(r *kgo.Record, now time.Time) *item {
	s := p.s
	h := func(k string) (string, bool) {
		for _, x := range r.Headers {
			if x.Key == k {
				return string(x.Value), true
			}
		}
		return "", false
	}
	if g, _ := h(contract.HeaderGroup); g != "" && g != s.cfg.Group { // an empty one names no group: ours
		return nil
	}
	v, _ := h(contract.HeaderAttempts)
	it := p.item(r, contract.Attempt(v, s.set.MaxAttempts))
	if v, ok := h(contract.HeaderNotBefore); ok {
		it.notBefore = contract.NotBefore(v, now, s.set.BackoffMax)
	}
	if v, ok := h(contract.HeaderFirstFailure); ok {
		it.d.FirstFailure, _ = contract.ParseTime(v)
	}
	return it
}

// route copies each settlement's record to <topic>.retry (a retry) or
// <topic>.dlq (a dead letter), waits until the broker confirmed every copy,
// then reports them to the pipeline (Settled, which runs the
// BeforeSourceCommit crash point). Only then may the caller mark the source
// offsets: a crash before that redelivers the record, and the inbox absorbs
// whichever of the two copies comes second. It returns an error when the
// consumer crashed or the copies were abandoned (partition stopped while the
// broker refused them): then nothing may be marked.
func (s *Source) route(p *partition, ss []*transport.Settlement) error {
	if len(ss) == 0 {
		return nil
	}
	now := time.Now()
	recs := make([]*kgo.Record, len(ss))
	for i, st := range ss {
		d := st.Copied()
		rec := recordOf(d)
		f := contract.Failure{Dead: st.Dead, Attempt: d.Attempt, LastError: st.LastError, Origin: d.Origin, Now: now}
		topic := contract.RetryTopic(p.source)
		if st.Dead {
			f.Reason, topic = st.Reason, contract.DLQName(p.source)
		} else {
			f.NotBefore = st.NotBefore
		}
		recs[i] = s.copyOf(rec, topic, f)
	}
	if err := s.produceConfirmed(p, recs); err != nil {
		return err
	}
	for i, st := range ss {
		if !st.Dead && recs[i].Topic == contract.DLQName(p.source) { // a stub replaced a copy too large to store
			st.Dead, st.Reason = true, header(recs[i], contract.HeaderReason)
		}
	}
	return s.p.Settled(s.workCtx, ss)
}

// recordOf is the record a copy is made of: the delivery's own, or, for a
// message the pipeline kept in its store (Settlement.Copy), one rebuilt from
// the delivery's fields.
func recordOf(d *transport.Delivery) *kgo.Record {
	if r, ok := d.Ref.(*kgo.Record); ok {
		return r
	}
	r := &kgo.Record{Topic: d.Origin, Partition: d.Partition, Offset: d.Offset, Key: d.Key, Value: d.Value, Timestamp: d.Timestamp}
	for _, h := range d.Headers {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: h.Key, Value: []byte(h.Value)})
	}
	return r
}

func header(r *kgo.Record, key string) string {
	for _, h := range r.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// copyOf builds the retry or DLQ copy of r for f: same key, value and
// headers (tipus, id_esdeveniment and any other), with the copy headers of
// contract.CopyHeaders in place of r's own.
func (s *Source) copyOf(r *kgo.Record, topic string, f contract.Failure) *kgo.Record {
	f.Partition, f.Offset, f.Timestamp, f.Group = r.Partition, r.Offset, r.Timestamp, s.cfg.Group
	f.Prior = func(k string) string { return header(r, k) }
	out := &kgo.Record{Topic: topic, Key: r.Key, Value: r.Value}
	for _, h := range r.Headers {
		if !contract.IsCopyHeader(h.Key) {
			out.Headers = append(out.Headers, h)
		}
	}
	for _, h := range contract.CopyHeaders(f) {
		out.Headers = append(out.Headers, kgo.RecordHeader{Key: h.Key, Value: []byte(h.Value)})
	}
	return out
}

// produceConfirmed produces recs and returns once the broker confirmed each
// (acks=all). Failed records are produced again after a backoff until they
// go through, the partition is stopped or the consumer crashes. A copy the
// broker refuses for good (the original plus our headers is over its size
// limit) is replaced, in recs too, by a header-only dead letter on
// <source>.dlq whose motiu says so and whose headers point at the original
// (topic_original, particio_original, offset_original), so the loss is never
// silent and the original can still be read from its topic.
func (s *Source) produceConfirmed(p *partition, recs []*kgo.Record) error {
	var fails int
	todo := recs
	slot := make(map[*kgo.Record]int, len(recs))
	for i, r := range recs {
		slot[r] = i
	}
	for {
		var again, solo []*kgo.Record
		fresh := func(r *kgo.Record) *kgo.Record {
			cp := &kgo.Record{Topic: r.Topic, Key: r.Key, Value: r.Value, Headers: r.Headers}
			slot[cp] = slot[r]
			return cp
		}
		settle := func(res kgo.ProduceResults, alone bool) {
			for _, res := range res {
				r := res.Record
				switch {
				case res.Err == nil:
				case IsRejectedForGood(res.Err) && len(r.Value) > 0 && !alone:
					// Kafka refuses a whole batch: this copy may fit on its own.
					solo = append(solo, fresh(r))
				case IsRejectedForGood(res.Err) && len(r.Value) > 0:
					s.log.Error("consumer: broker refused a retry/DLQ copy for good; dead-lettering a header-only stub",
						"topic", r.Topic, "id", header(r, contract.HeaderEventID), "err", res.Err)
					stub := tooLargeStub(r, contract.DLQName(p.source), res.Err)
					slot[stub] = slot[r]
					recs[slot[r]] = stub
					again = append(again, stub)
				default:
					again = append(again, fresh(r))
				}
			}
		}
		settle(s.cl.ProduceSync(s.workCtx, todo...), len(todo) == 1)
		for _, r := range solo {
			settle(s.cl.ProduceSync(s.workCtx, r), true)
		}
		if len(again) == 0 {
			return nil
		}
		if err := s.p.Err(); err != nil {
			return err
		}
		s.log.Warn("consumer: producing retry/DLQ copies", "failed", len(again), "topic", again[0].Topic)
		if !s.pause(p, &fails) {
			return errors.New("consumer: copies not confirmed; batch abandoned")
		}
		todo = again
	}
}

// ErrNoOriginalTopic is returned by Republish for a record that names no
// original topic (no topic_original header and no .dlq/.retry suffix).
var ErrNoOriginalTopic = errors.New("kafka: dead letter names no original topic")

// Republish produces a dead letter (or retry copy) rec back to its original
// topic, with the same key, value and id_esdeveniment, minus the retry/DLQ
// headers, and waits for the broker's confirmation. A consumer that already
// applied the event sees a duplicate; one that has not applies it once. Use a
// client built with kafka.ProducerOpts so the key lands on the partition the
// original producer chose. It returns ErrNoOriginalTopic, or the produce error.
func Republish(ctx context.Context, cl *kgo.Client, rec *kgo.Record) error {
	topic := header(rec, contract.HeaderOriginalTopic)
	if topic == "" {
		for _, suf := range []string{contract.DLQSuffix, contract.RetrySuffix} {
			if t, ok := strings.CutSuffix(rec.Topic, suf); ok && t != "" {
				topic = t
			}
		}
	}
	if topic == "" {
		return ErrNoOriginalTopic
	}
	out := &kgo.Record{Topic: topic, Key: rec.Key, Value: rec.Value}
	for _, h := range rec.Headers {
		if !contract.IsCopyHeader(h.Key) {
			out.Headers = append(out.Headers, h)
		}
	}
	if err := cl.ProduceSync(ctx, out).FirstErr(); err != nil {
		return fmt.Errorf("kafka: republish to %s: %w", topic, err)
	}
	return nil
}

// tooLargeStub is the dead letter that stands for a copy the broker refused
// for good: no value, motiu replaced, and only what is bounded, so the stub
// itself always fits whatever made the copy too large (a huge header or key
// is as refusable as a huge value, and a refused stub would be produced again
// forever, holding the partition's commit back). It keeps the first of each
// contract header (tipus, id_esdeveniment and the retry/DLQ ones) of at most
// stubMaxBytes, and the key when it is at most stubMaxBytes.
func tooLargeStub(r *kgo.Record, dlq string, cause error) *kgo.Record {
	reason := outcome.Truncate(fmt.Sprintf("permanent: massa_gran: copy refused by the broker (%v); original at %s/%s/%s",
		cause, header(r, contract.HeaderOriginalTopic), header(r, contract.HeaderOriginalPartition), header(r, contract.HeaderOriginalOffset)), 200)
	hs := make([]kgo.RecordHeader, 0, len(r.Headers)+1)
	seen := map[string]bool{}
	for _, h := range r.Headers {
		keep := contract.IsCopyHeader(h.Key) || h.Key == contract.HeaderType || h.Key == contract.HeaderEventID
		if !keep || seen[h.Key] || h.Key == contract.HeaderReason || h.Key == contract.HeaderNotBefore ||
			len(h.Value) > stubMaxBytes {
			continue
		}
		seen[h.Key] = true
		hs = append(hs, h)
	}
	hs = append(hs, kgo.RecordHeader{Key: contract.HeaderReason, Value: []byte(reason)})
	key := r.Key
	if len(key) > stubMaxBytes {
		key = nil
	}
	return &kgo.Record{Topic: dlq, Key: key, Value: []byte{}, Headers: hs}
}

// stubMaxBytes bounds each header value and the key a tooLargeStub keeps.
const stubMaxBytes = 256
