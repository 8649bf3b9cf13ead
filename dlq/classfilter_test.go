package dlq_test

import (
	"testing"

	"github.com/km0/km0/dlq"
)

// Filter.Class selects one failure group exactly: a longer class that
// starts with the same text (what a motiu prefix would also match) stays out.
func TestFilterClassIsExact(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.produceDead(t, dead{topic: comandes, key: "a", reason: "permanent: esquema: falta adreca"})
	b.produceDead(t, dead{topic: comandes, key: "b", reason: "permanent: esquema: falta client"})
	b.produceDead(t, dead{topic: comandes, key: "c", reason: "permanent: esquema2: x"})
	b.sync(t)
	ls := b.list(t, dlq.Filter{Class: "permanent: esquema"})
	if len(ls.Letters) != 2 || len(ls.Groups) != 1 || ls.Groups[0].Count != 2 {
		t.Fatalf("class filter: %d letters, groups %+v; want the 2 of permanent: esquema", len(ls.Letters), ls.Groups)
	}
	if n := len(b.list(t, dlq.Filter{Reason: "permanent: esquema"}).Letters); n != 3 {
		t.Fatalf("the motiu prefix matches %d, want 3 (why Class exists)", n)
	}
	if (dlq.Filter{Class: "x"}).Empty() {
		t.Fatal("a filter with a class is not empty")
	}
}
