package pagaments_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/pagaments/passarella"
	"github.com/km0/km0/outcome"
)

// A refused card is final (per-key order does not block the order's key on
// it); an unavailable gateway or bad data is not.
func TestFinalIsTheRefusedCardOnly(t *testing.T) {
	t.Parallel()
	refused := outcome.Permanent(fmt.Errorf("targeta_refusada: P-1: %w", passarella.ErrRefused))
	if !pagaments.Final(refused) || refused.Error() != "targeta_refusada: P-1: "+passarella.ErrRefused.Error() {
		t.Fatalf("Final(%q) = false, want true", refused)
	}
	for _, err := range []error{outcome.Permanentf("esquema: comanda.creada without id or linies"),
		outcome.Transient(errors.New("passarella: 503"))} {
		if pagaments.Final(err) {
			t.Errorf("Final(%q) = true, want false", err)
		}
	}
}
