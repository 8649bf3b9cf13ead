package demo

import (
	"context"
	"fmt"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

// readTopic reads every record of topic from the start to its current end.
func readTopic(ctx context.Context, cl *kgo.Client, brokers []string, topic string) ([]*kgo.Record, error) {
	ends, err := kadm.NewClient(cl).ListEndOffsets(ctx, topic)
	if err != nil {
		return nil, fmt.Errorf("end offsets of %s: %w", topic, err)
	}
	want := map[int32]int64{}
	ends.Each(func(o kadm.ListedOffset) {
		if o.Offset > 0 {
			want[o.Partition] = o.Offset
		}
	})
	if len(want) == 0 {
		return nil, nil
	}
	rd, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		return nil, err
	}
	defer rd.Close()
	var out []*kgo.Record
	for len(want) > 0 {
		fs := rd.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			return out, fmt.Errorf("reading %s: %w", topic, err)
		}
		fs.EachRecord(func(r *kgo.Record) {
			if end, ok := want[r.Partition]; ok && r.Offset < end {
				out = append(out, r)
				if r.Offset+1 >= end {
					delete(want, r.Partition)
				}
			}
		})
	}
	return out, nil
}

// header returns the value of header key of r.
func header(r *kgo.Record, key string) string {
	for _, h := range r.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// groupLag returns the total lag of each group.
func groupLag(ctx context.Context, cl *kgo.Client, groups []string) (map[string]int64, error) {
	lags, err := kadm.NewClient(cl).Lag(ctx, groups...)
	if err != nil {
		return nil, err
	}
	out := map[string]int64{}
	var firstErr error
	lags.Each(func(l kadm.DescribedGroupLag) {
		if l.DescribeErr != nil || l.FetchErr != nil {
			if firstErr == nil {
				firstErr = fmt.Errorf("lag of %s: %v %v", l.Group, l.DescribeErr, l.FetchErr)
			}
			return
		}
		out[l.Group] = l.Lag.Total()
	})
	return out, firstErr
}
