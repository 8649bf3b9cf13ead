package system_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/services/system"
)

// A negative relay retention is refused before anything starts (0 is off,
// the default).
func TestStartRefusesANegativeRelayPruneOlderThan(t *testing.T) {
	t.Parallel()
	_, err := system.Start(context.Background(), system.Config{Brokers: []string{"127.0.0.1:1"},
		DatabaseURL: "postgres://127.0.0.1:1/x", RelayPruneOlderThan: -time.Hour})
	if err == nil || !strings.Contains(err.Error(), "RelayPruneOlderThan") {
		t.Fatalf("Start with a negative RelayPruneOlderThan: %v, want an error naming it", err)
	}
}
