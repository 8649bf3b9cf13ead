package dlq

import "strings"

// The index stores its values in the contract's Catalan (estat, accio,
// resultat); these turn them into the English that people read in the CLI's
// and the console's output. Stored values and JSON keep the Catalan.

// English returns s as people read it: pending, replayed or purged; an
// unknown state as is.
func (s State) English() string {
	switch s {
	case StatePending:
		return "pending"
	case StateReplayed:
		return "replayed"
	case StatePurged:
		return "purged"
	}
	return string(s)
}

// ActionEnglish returns an audit action (AuditEntry.Action) as people read
// it: replay, purge, edit and replay, skip; an unknown action as is.
func ActionEnglish(action string) string {
	switch action {
	case ActionReplay:
		return "replay"
	case ActionPurge:
		return "purge"
	case ActionEdit:
		return "edit and replay"
	case ActionSkip:
		return "skip"
	}
	return action
}

// ResultEnglish returns an audit result (AuditEntry.Result) as people read
// it: the stored "fet" (done) reads "done", and "fet: skipped: <reason>"
// reads "done: skipped: <reason>"; the other results ("cancelled",
// "stopped: …") are English already and are returned as they are.
func ResultEnglish(result string) string {
	if rest, ok := strings.CutPrefix(result, resultDone); ok && (rest == "" || strings.HasPrefix(rest, ": ")) {
		return "done" + rest
	}
	return result
}

// resultDone is the audit result of an operation that did what was asked.
const resultDone = "fet"
