package outcome_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/outcome"
)

func TestClassify(t *testing.T) {
	t.Parallel()
	boom := errors.New("boom")
	cases := []struct {
		name  string
		err   error
		c     outcome.Classifier
		kind  outcome.Kind
		delay time.Duration
	}{
		{"nil", nil, nil, 0, 0},
		{"permanent, wrapped", fmt.Errorf("handler: %w", outcome.Permanent(boom)), nil, outcome.KindPermanent, 0},
		{"transient", outcome.Transient(boom), nil, outcome.KindTransient, 0},
		{"retry after", outcome.RetryAfter(3*time.Second, boom), nil, outcome.KindTransient, 3 * time.Second},
		{"unclassified defaults to transient", boom, nil, outcome.KindTransient, 0},
		{"classifier decides", boom, func(error) outcome.Kind { return outcome.KindPermanent }, outcome.KindPermanent, 0},
		{"cancelled context is transient whatever the classifier", context.Canceled,
			func(error) outcome.Kind { return outcome.KindPermanent }, outcome.KindTransient, 0},
	}
	for _, tc := range cases {
		kind, delay := outcome.Classify(tc.err, tc.c)
		if kind != tc.kind || delay != tc.delay {
			t.Errorf("%s: got %v %v, want %v %v", tc.name, kind, delay, tc.kind, tc.delay)
		}
	}
	if outcome.Permanent(nil) != nil || outcome.Transient(nil) != nil || outcome.RetryAfter(time.Second, nil) != nil {
		t.Fatal("an outcome of a nil error must be nil")
	}
	if !errors.Is(outcome.Permanent(boom), boom) {
		t.Fatal("outcome hides its cause from errors.Is")
	}
}

func TestReasonHasThePrefixAndAtMost200BytesOfValidUTF8(t *testing.T) {
	t.Parallel()
	r := outcome.Reason(outcome.KindPermanent, errors.New("estoc_insuficient: formatge-curat"))
	if r != "permanent: estoc_insuficient: formatge-curat" {
		t.Fatalf("got %q", r)
	}
	long := outcome.Reason(outcome.KindTransient, errors.New(strings.Repeat("à", 300)))
	if !strings.HasPrefix(long, "transitori esgotat: ") || len(long) > 200 || !strings.HasSuffix(long, "à") {
		t.Fatalf("reason %d bytes, %q…", len(long), long[:40])
	}
}

func TestBackoffDoublesAndNeverOverflows(t *testing.T) {
	for _, c := range []struct {
		base, ceiling time.Duration
		attempt       int
		want          time.Duration
	}{
		{time.Second, time.Hour, 1, time.Second},
		{time.Second, time.Hour, 3, 4 * time.Second},
		{time.Second, time.Hour, 13, time.Hour}, // 4,096 s capped
		{time.Second, time.Hour, 1 << 30, time.Hour},
		{time.Second, 0, 30, time.Second << 29},
		{time.Second, 0, 100, time.Duration(math.MaxInt64)}, // Backoff << 99 overflowed to 0: no wait at all
		{time.Second, time.Hour, 0, time.Second},
	} {
		if got := outcome.Backoff(c.base, c.ceiling, c.attempt); got != c.want {
			t.Errorf("Backoff(%v, %v, %d) = %v, want %v", c.base, c.ceiling, c.attempt, got, c.want)
		}
	}
}
