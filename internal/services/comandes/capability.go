package comandes

import (
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"net/http"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/internal/services/svc"
)

// OperatorTokenEnv is the environment variable km0 up reads the operator
// token from (Config.OperatorToken). Unset: operator access is off.
const OperatorTokenEnv = "KM0_COMANDES_OPERATOR_TOKEN"

// capabilityBytes is the entropy of an order capability: 32 random bytes,
// sent as 43 characters of unpadded base64url.
const capabilityBytes = 32

// newCapability returns a fresh order capability and the SHA-256 stored in
// comandes.hash_capacitat. A 256-bit random secret needs no slow hash.
func newCapability() (string, []byte) {
	b := make([]byte, capabilityBytes)
	_, _ = rand.Read(b) // never fails (crypto/rand)
	c := base64.RawURLEncoding.EncodeToString(b)
	h := sha256.Sum256([]byte(c))
	return c, h[:]
}

// sealKey derives the key that seals the capability of a 201 stored under
// an Idempotency-Key: SHA-256 of the key and the exact request body. The
// body is not stored (only its hash, another digest), so whoever can open
// the sealed capability is whoever can replay the request over HTTP and be
// given it anyway: the client that holds the key and the body.
func sealKey(idemKey string, body []byte) []byte {
	h := sha256.New()
	h.Write([]byte("km0/comandes/capacitat\x00"))
	h.Write([]byte(idemKey))
	h.Write([]byte{0})
	h.Write(body)
	return h.Sum(nil)
}

// sealCapability encrypts c with AES-256-GCM under sealKey: nonce ‖ ciphertext.
func sealCapability(idemKey string, body []byte, c string) []byte {
	aead := gcm(sealKey(idemKey, body))
	nonce := make([]byte, aead.NonceSize())
	_, _ = rand.Read(nonce)
	return aead.Seal(nonce, nonce, []byte(c), []byte(idemKey))
}

// openCapability reverses sealCapability; an error if sealed was not sealed
// under this key and body.
func openCapability(idemKey string, body, sealed []byte) (string, error) {
	aead := gcm(sealKey(idemKey, body))
	if len(sealed) < aead.NonceSize() {
		return "", errors.New("comandes: sealed capability too short")
	}
	c, err := aead.Open(nil, sealed[:aead.NonceSize()], sealed[aead.NonceSize():], []byte(idemKey))
	return string(c), err
}

func gcm(key []byte) cipher.AEAD {
	block, err := aes.NewCipher(key)
	if err != nil {
		panic(err) // a 32-byte key is always valid
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		panic(err)
	}
	return aead
}

// errUnauthorized: the request carries neither the order's capability nor
// the operator token.
var errUnauthorized = errors.New("comandes: no valid credential")

// bearer returns the credential of an "Authorization: Bearer <credential>"
// header, or "" without one.
func bearer(r *http.Request) string {
	scheme, cred, ok := strings.Cut(r.Header.Get("Authorization"), " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return ""
	}
	return strings.TrimSpace(cred)
}

// authorize returns nil when r may read or cancel order id: its bearer
// credential is the operator token (Config.OperatorToken, if set) or the
// order's capability. Otherwise errUnauthorized, whether or not the order
// exists: an unknown order, or one without a capability, is compared with a
// dummy hash, so the answer and the work done are the same (one indexed
// read, one constant-time comparison). Any other error is the database's.
func (s *Service) authorize(ctx context.Context, r *http.Request, id string) error {
	cred := bearer(r)
	if cred == "" {
		return errUnauthorized
	}
	sum := sha256.Sum256([]byte(cred))
	if s.operator != nil && subtle.ConstantTimeCompare(sum[:], s.operator) == 1 {
		return nil
	}
	var stored []byte
	err := s.cfg.Pool.QueryRow(ctx, `SELECT hash_capacitat FROM comandes WHERE id = $1`, id).Scan(&stored)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return err
	}
	known := err == nil && len(stored) == sha256.Size
	if !known {
		stored = s.dummy
	}
	if subtle.ConstantTimeCompare(sum[:], stored) == 1 && known {
		return nil
	}
	return errUnauthorized
}

// writeUnauthorized answers 401 with one body for every refused credential.
func writeUnauthorized(w http.ResponseWriter) {
	w.Header().Set("WWW-Authenticate", `Bearer realm="comandes"`)
	svc.WriteError(w, http.StatusUnauthorized, svc.CodeCredentialRequired, "Authorization",
		"a credential is required: Authorization: Bearer <the order's capacitat, or the operator token>")
}
