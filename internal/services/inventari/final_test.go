package inventari_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/outcome"
)

// Insufficient stock and an unknown product are final (per-key order does
// not block the order's key on them); bad data and a database error are not.
func TestFinalIsTheStockRefusalOnly(t *testing.T) {
	t.Parallel()
	for _, err := range []error{
		outcome.Permanent(fmt.Errorf("%w: formatge-curat (5 left, 6 asked)", inventari.ErrInsufficient)),
		outcome.Permanent(fmt.Errorf("%w: trufa", inventari.ErrUnknownProduct)),
	} {
		if !inventari.Final(err) {
			t.Errorf("Final(%q) = false, want true", err)
		}
	}
	for _, err := range []error{outcome.Permanentf("esquema: comanda.creada sense linies"), outcome.Transient(errors.New("db: 57P01"))} {
		if inventari.Final(err) {
			t.Errorf("Final(%q) = true, want false", err)
		}
	}
}
