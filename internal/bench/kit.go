package bench

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"

	"github.com/km0/km0/requestreply"
)

// newSigningKey returns a random request/reply signing key of
// requestreply.MinKeyBytes bytes, hex-encoded (so it can travel in the
// environment of the processes a benchmark starts).
func newSigningKey() ([]byte, error) {
	b := make([]byte, requestreply.MinKeyBytes)
	if _, err := rand.Read(b); err != nil {
		return nil, fmt.Errorf("generate a request/reply signing key: %w", err)
	}
	return []byte(hex.EncodeToString(b)), nil
}

// adaptiveOr is n, or "adaptive" for 0 (the relay's adaptive default).
func adaptiveOr(n int) any {
	if n == 0 {
		return "adaptive"
	}
	return n
}

// The relay modes of `km0 relay --mode`.
const (
	modePolling = "polling"
	modeCDC     = "cdc"
)
