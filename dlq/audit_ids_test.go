package dlq

import "testing"

// The audit log line names the letters as words, never as a printed Go
// slice, and says how many it left out.
func TestAuditLogLineListsTheLettersAsText(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		ids  []string
		want string
	}{
		{nil, ""},
		{[]string{"t.dlq/0/1"}, "t.dlq/0/1"},
		{[]string{"a/0/1", "a/0/2", "a/0/3"}, "a/0/1, a/0/2 and 1 more"},
	} {
		if got := firstIDs(c.ids, 2); got != c.want {
			t.Errorf("firstIDs(%q, 2) = %q, want %q", c.ids, got, c.want)
		}
	}
}
