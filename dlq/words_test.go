package dlq_test

import (
	"testing"

	"github.com/km0/km0/dlq"
)

// What the index stores in Catalan (estat, accio, resultat) reads English
// where people see it; a value the index does not know is shown as is.
func TestStoredValuesReadEnglish(t *testing.T) {
	t.Parallel()
	for in, want := range map[dlq.State]string{dlq.StatePending: "pending", dlq.StateReplayed: "replayed", dlq.StatePurged: "purged", "altre": "altre"} {
		if got := in.English(); got != want {
			t.Errorf("State(%q).English() = %q, want %q", in, got, want)
		}
	}
	for in, want := range map[string]string{dlq.ActionReplay: "replay", dlq.ActionPurge: "purge", dlq.ActionEdit: "edit and replay",
		dlq.ActionSkip: "skip", "altra": "altra"} {
		if got := dlq.ActionEnglish(in); got != want {
			t.Errorf("ActionEnglish(%q) = %q, want %q", in, got, want)
		}
	}
	for in, want := range map[string]string{"fet": "done", "fet: skipped: never valid": "done: skipped: never valid",
		"cancelled": "cancelled", "stopped: broker down": "stopped: broker down", "fetch failed": "fetch failed"} {
		if got := dlq.ResultEnglish(in); got != want {
			t.Errorf("ResultEnglish(%q) = %q, want %q", in, got, want)
		}
	}
}
