package cdc_test

import (
	"strings"
	"testing"

	"github.com/km0/km0/relay/cdc"
)

// CheckMode refuses each setting that the chosen relay or outbox mode does
// not read, naming it as the caller does (or by its field), and accepts what
// each relay reads.
func TestCheckModeRefusesTheOtherModesSettings(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		cdcRelay, wal bool
		given         []string
		slot          string
		want          string // "" for no error
	}{
		{false, false, nil, "", ""},
		{true, false, []string{"Slot", "Publication"}, "km0_ok_1", ""},
		{true, true, nil, "", ""},
		{false, false, []string{"Workers", "PollInterval", "PruneOlderThan", "DeletePublished"}, "", ""},
		{false, true, nil, "", "a WAL-mode outbox (outbox.ModeWAL) is streamed by the CDC relay (package relay/cdc) only, not the polling relay (package relay)"},
		{true, true, []string{"DeletePublished"}, "", "DeletePublished applies to a table outbox only"},
		{true, true, []string{"PruneOlderThan"}, "", "PruneOlderThan applies to a table outbox only"},
		{false, false, []string{"Publication"}, "", "Slot and Publication apply to the CDC relay (package relay/cdc) only"},
		{true, false, []string{"Workers"}, "", "Workers applies to the polling relay (package relay) only"},
		{true, false, []string{"PollInterval"}, "", "PollInterval applies to the polling relay (package relay) only"},
		{true, false, []string{"Slot"}, "Bad-Name", `Slot "Bad-Name": a slot name is`},
	} {
		err := cdc.CheckMode(c.cdcRelay, c.wal, c.given, c.slot, nil)
		switch {
		case c.want == "" && err != nil:
			t.Errorf("CheckMode(%v, %v, %v, %q): %v, want nil", c.cdcRelay, c.wal, c.given, c.slot, err)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
			t.Errorf("CheckMode(%v, %v, %v, %q): %v, want %q", c.cdcRelay, c.wal, c.given, c.slot, err, c.want)
		}
	}
	names := map[string]string{"Workers": "--workers", "Polling": "--mode polling"}
	if err := cdc.CheckMode(true, false, []string{"Workers"}, "", names); err == nil || !strings.HasPrefix(err.Error(), "--workers applies to --mode polling only") {
		t.Errorf("with the caller's names: %v", err)
	}
}
