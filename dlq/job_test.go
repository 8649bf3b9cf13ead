package dlq_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/km0/km0/dlq"
	"github.com/km0/km0/internal/testkit"
)

// A bulk replay job is capped, paced, cancellable and resumable without
// replaying twice. Eight letters at 10 per second: the run stopped (its
// process gone) after some letters, a letter replayed meanwhile by hand (as
// if the job had crashed between its replay and its mark), then resumed by a
// new Service: every letter is republished exactly once (8 records, each
// letter replayed once), and the runs kept the pace. A second job is
// cancelled while it runs and stops with letters left. 10,001 letters are
// refused.
func TestReplayJobIsPacedCancellableAndResumable(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var ids []string
	for i := 0; i < 8; i++ {
		id, _ := b.produceDead(t, dead{topic: comandes, key: "P-1", reason: "permanent: esquema: x"})
		ids = append(ids, id)
	}
	b.sync(t)
	if _, err := b.svc.CreateJob(b.ctx, make([]string, dlq.JobMaxLetters+1), 0, "t"); !errors.Is(err, dlq.ErrJobTooLarge) {
		t.Fatalf("a job of %d letters: %v, want ErrJobTooLarge", dlq.JobMaxLetters+1, err)
	}
	job, err := b.svc.CreateJob(b.ctx, ids, 10, "console:abc")
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	ctx, stop := context.WithCancel(b.ctx)
	done := make(chan error, 1)
	go func() { _, err := b.svc.RunJob(ctx, job, dlq.ReplayOptions{}); done <- err }()
	testkit.Eventually(t, 10*time.Second, "2 letters replayed by the job", func() bool {
		st, err := b.svc.JobStatus(b.ctx, job)
		return err == nil && st.Done >= 2
	})

	stop() // the process stops
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("stopped run: %v", err)
	}
	st, _ := b.svc.JobStatus(b.ctx, job)
	if st.State != dlq.JobPending || st.Done < 2 || st.Done >= 8 {
		t.Fatalf("after the stop: %+v", st)
	}
	// A step cut short between the replay and its mark: the letter is
	// replayed, the job does not know yet.
	if rep := b.replay(t, dlq.Filter{IDs: []string{ids[7]}}, dlq.ReplayOptions{}); rep.Done != 1 {
		t.Fatalf("replay by hand: %+v", rep)
	}
	svc2, err := dlq.NewService(dlq.ServiceConfig{Store: b.store, Backend: b.backend}) // after a restart
	if err != nil {
		t.Fatal(err)
	}
	st2, err := svc2.RunJob(b.ctx, job, dlq.ReplayOptions{})
	if err != nil || st2.State != dlq.JobFinished || st2.Done != 8 || st2.Left != 0 || st2.Total != 8 {
		t.Fatalf("resumed job: %+v %v", st2, err)
	}
	// 8 letters in two runs, each run's first letter at once: at least 6
	// intervals of 100 ms.
	if took := time.Since(start); took < 600*time.Millisecond {
		t.Fatalf("8 letters at 10/s took %s, want at least 0.6 s", took)
	}
	if n := b.records(t, comandesRetry); n != 8 {
		t.Fatalf("%d records republished, want 8 (each letter once)", n)
	}
	for _, id := range ids {
		if l := b.get(t, id); l.Replays != 1 {
			t.Fatalf("letter %s replayed %d times, want once", id, l.Replays)
		}
	}

	// Cancelled while it runs.
	job2, err := b.svc.CreateJob(b.ctx, ids, 5, "console:abc")
	if err != nil {
		t.Fatal(err)
	}
	res := make(chan *dlq.JobStatus, 1)
	go func() { st, _ := b.svc.RunJob(b.ctx, job2, dlq.ReplayOptions{Force: true}); res <- st }()
	testkit.Eventually(t, 10*time.Second, "the second job started", func() bool {
		st, err := b.svc.JobStatus(b.ctx, job2)
		return err == nil && st.Done >= 1
	})

	if err := b.svc.CancelJob(b.ctx, job2); err != nil {
		t.Fatal(err)
	}
	if st := <-res; st == nil || st.State != dlq.JobCancelled || st.Left == 0 {
		t.Fatalf("cancelled job: %+v", st)
	}
}

// One runner per job: while a RunJob runs a job, a second RunJob of it (a
// second console resuming it) is refused with ErrJobRunning and replays
// nothing; the first replays each letter once.
func TestReplayJobHasOneRunnerAtATime(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var ids []string
	for i := 0; i < 4; i++ {
		id, _ := b.produceDead(t, dead{topic: comandes, key: "P-1", reason: "permanent: esquema: x"})
		ids = append(ids, id)
	}
	b.sync(t)
	job, err := b.svc.CreateJob(b.ctx, ids, 4, "console:abc")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { _, err := b.svc.RunJob(b.ctx, job, dlq.ReplayOptions{}); done <- err }()
	testkit.Eventually(t, 10*time.Second, "the first run under way", func() bool {
		st, err := b.svc.JobStatus(b.ctx, job)
		return err == nil && st.Done >= 1
	})

	svc2, err := dlq.NewService(dlq.ServiceConfig{Store: b.store, Backend: b.backend})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := svc2.RunJob(b.ctx, job, dlq.ReplayOptions{}); !errors.Is(err, dlq.ErrJobRunning) {
		t.Fatalf("second runner: %v, want ErrJobRunning", err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n := b.records(t, comandesRetry); n != 4 {
		t.Fatalf("%d records, want 4: each letter once", n)
	}
	// Finished, the lock is free again: a new run finds nothing left.
	if st, err := svc2.RunJob(b.ctx, job, dlq.ReplayOptions{}); err != nil || st.State != dlq.JobFinished {
		t.Fatalf("run after the end: %+v %v", st, err)
	}
}

// A job run with Force keeps it when it is resumed without: letters already
// replayed (which only Force replays again) are replayed by the resumed run
// too, none refused.
func TestReplayJobResumedKeepsForce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var ids []string
	for i := 0; i < 4; i++ {
		id, _ := b.produceDead(t, dead{topic: comandes, key: "P-1", reason: "permanent: esquema: x"})
		ids = append(ids, id)
	}
	b.sync(t)
	if rep := b.replay(t, dlq.Filter{IDs: ids}, dlq.ReplayOptions{}); rep.Done != 4 {
		t.Fatalf("first replay: %+v", rep)
	}
	job, err := b.svc.CreateJob(b.ctx, ids, 4, "console:abc")
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(b.ctx)
	done := make(chan error, 1)
	go func() { _, err := b.svc.RunJob(ctx, job, dlq.ReplayOptions{Force: true}); done <- err }()
	testkit.Eventually(t, 10*time.Second, "1 letter forced", func() bool {
		st, err := b.svc.JobStatus(b.ctx, job)
		return err == nil && st.Done >= 1
	})

	stop()
	<-done
	st, err := b.svc.RunJob(b.ctx, job, dlq.ReplayOptions{}) // resumed by a runner that does not know
	if err != nil || st.State != dlq.JobFinished || st.Done != 4 || st.Refused != 0 {
		t.Fatalf("resumed forced job: %+v %v; want 4 done, 0 refused", st, err)
	}
	for _, id := range ids {
		if l := b.get(t, id); l.Replays != 2 {
			t.Fatalf("letter %s replayed %d times, want twice (by hand, then by the job)", id, l.Replays)
		}
	}
}
