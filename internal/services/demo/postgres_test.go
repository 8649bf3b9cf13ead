package demo

import (
	"context"
	"os"
	"testing"
)

// The third way FindServer gets a database: a throwaway cluster from the
// installed server binaries, as the postgres user when running as root.
func TestThrowawayClusterStartsAnswersAndIsRemoved(t *testing.T) {
	s, err := startThrowaway(context.Background())
	if err != nil {
		t.Fatalf("throwaway PostgreSQL (initdb/pg_ctl are part of this machine's PostgreSQL install): %v", err)
	}
	dir := s.Source[len("throwaway cluster in "):]
	if err := ping(context.Background(), s.URL); err != nil {
		s.Close()
		t.Fatalf("throwaway server does not answer: %v", err)
	}
	s.Close()
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("folder %s not removed: %v", dir, err)
	}
	if err := ping(context.Background(), s.URL); err == nil {
		t.Fatal("server still answers after Close")
	}
}
