package cdc

import (
	"fmt"
	"slices"
)

// The names CheckMode gives, by default, to the relays, the outbox modes
// and the settings that apply to one of them only. A caller that took them
// from a command line passes its own names (its flags) instead.
var modeNames = map[string]string{
	"CDC":     "the CDC relay (package relay/cdc)",
	"Polling": "the polling relay (package relay)",
	"WAL":     "a WAL-mode outbox (outbox.ModeWAL)",
	"Table":   "a table outbox",
}

// CheckMode returns what is wrong with relaying an outbox in WAL mode (wal,
// outbox.ModeWAL) or a table, by the CDC relay of this package (cdcRelay) or
// the polling relay of package relay, with the settings given (by field
// name, of relay.Config and Config: Slot, Publication, Workers, PollInterval,
// PruneOlderThan, DeletePublished) and slot (Config.Slot):
//   - a WAL-mode outbox is streamed by the CDC relay only (it has no rows to claim);
//   - PruneOlderThan and DeletePublished apply to a table outbox only;
//   - Slot and Publication apply to the CDC relay only;
//   - Workers and PollInterval apply to the polling relay only (the CDC relay
//     streams with one session and is woken by the stream);
//   - slot must be a slot name (ValidSlot).
//
// The errors name the settings by names[field], and "CDC", "Polling",
// "WAL" and "Table" by names[...] too; a missing name is the field's own
// (or a description of the mode). A command checks its flags with it before
// anything connects.
func CheckMode(cdcRelay, wal bool, given []string, slot string, names map[string]string) error {
	name := func(k string) string {
		if n, ok := names[k]; ok {
			return n
		}
		if n, ok := modeNames[k]; ok {
			return n
		}
		return k
	}
	has := func(f string) bool { return slices.Contains(given, f) }
	if wal {
		if !cdcRelay {
			return fmt.Errorf("%s is streamed by %s only, not %s", name("WAL"), name("CDC"), name("Polling"))
		}
		for _, f := range []string{"PruneOlderThan", "DeletePublished"} {
			if has(f) {
				return fmt.Errorf("%s applies to %s only: a WAL-mode outbox has no rows", name(f), name("Table"))
			}
		}
	}
	if !cdcRelay {
		if has("Slot") || has("Publication") {
			return fmt.Errorf("%s and %s apply to %s only", name("Slot"), name("Publication"), name("CDC"))
		}
		return nil
	}
	switch {
	case has("Workers"):
		return fmt.Errorf("%s applies to %s only (the CDC relay streams with one session)", name("Workers"), name("Polling"))
	case has("PollInterval"):
		return fmt.Errorf("%s applies to %s only (the CDC relay is woken by the stream, it never polls)", name("PollInterval"), name("Polling"))
	case slot != "" && !ValidSlot(slot):
		return fmt.Errorf("%s %q: a slot name is 1 to 63 lower-case letters, digits and underscores", name("Slot"), slot)
	}
	return nil
}
