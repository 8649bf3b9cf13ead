package schema_test

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/km0/km0/schema"
)

// BenchmarkValidateHostile: a 1 MB comanda.creada whose linies holds ~350,000
// empty objects, each missing three required fields.
func BenchmarkValidateHostile(b *testing.B) {
	reg := registry(b)
	in := []byte(`{"id":"P-1","client":"c","mercat":"m","linies":[` + strings.TrimSuffix(strings.Repeat("{},", 350_000), ",") + `]}`)
	b.ReportAllocs()
	for b.Loop() {
		if err := reg.Validate("comanda.creada", 2, in); err == nil {
			b.Fatal("valid")
		}
	}
}

// A hostile document's error keeps a bounded sample of its problems and
// counts the rest, so that rejecting it costs a bounded amount of memory
// (before: one Problem per offending field, a million here, ~600 MB).
func TestHostileDocumentKeepsABoundedSampleOfProblems(t *testing.T) {
	t.Parallel()
	reg := registry(t)
	const items = 100_000
	in := []byte(`{"id":"P-1","client":"c","mercat":"m","linies":[` + strings.TrimSuffix(strings.Repeat("{},", items), ",") + `]}`)
	err := reg.Validate("comanda.creada", 2, in)
	var ve *schema.ValidationError
	if !errors.As(err, &ve) {
		t.Fatalf("got %v, want a *ValidationError", err)
	}
	if len(ve.Problems) != schema.MaxProblemsKept || len(ve.Problems)+ve.More != 3*items {
		t.Fatalf("%d problems kept + %d more, want %d + %d (3 required fields per line)",
			len(ve.Problems), ve.More, schema.MaxProblemsKept, 3*items-schema.MaxProblemsKept)
	}
	if !slices.IsSortedFunc(ve.Problems, func(a, b schema.Problem) int { return strings.Compare(a.Path, b.Path) }) {
		t.Fatal("problems not sorted by path")
	}
	if want := fmt.Sprintf("(+%d more)", 3*items-schema.MaxProblemsShown); !strings.Contains(err.Error(), want) {
		t.Fatalf("message %q does not say %s", err.Error(), want)
	}
}
