package requestreply_test

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/km0/km0/requestreply"
)

// A key shorter than 32 bytes is refused, with its length and never its
// bytes in the error; no key means unsigned, and 32 bytes are enough.
func TestShortKeyIsRefused(t *testing.T) {
	t.Parallel()
	short := bytes.Repeat([]byte("k"), 16)
	err := requestreply.CheckKey(short)
	if !errors.Is(err, requestreply.ErrKeyTooShort) || !strings.Contains(err.Error(), "16 bytes") || strings.Contains(err.Error(), string(short)) {
		t.Fatalf("CheckKey(16 bytes) = %v, want ErrKeyTooShort naming the length only", err)
	}
	if _, err := requestreply.NewVerifier(requestreply.VerifierConfig{Key: short, Queue: "q"}); !errors.Is(err, requestreply.ErrKeyTooShort) {
		t.Fatalf("NewVerifier with a 16-byte key: %v", err)
	}
	if _, err := requestreply.NewReplyVerifier(short, nil, nil); !errors.Is(err, requestreply.ErrKeyTooShort) {
		t.Fatalf("NewReplyVerifier with a 16-byte key: %v", err)
	}
	if err := requestreply.CheckKey(nil); err != nil {
		t.Fatalf("no key: %v", err)
	}
	if err := requestreply.CheckKey(bytes.Repeat([]byte("k"), 32)); err != nil {
		t.Fatalf("32 bytes: %v", err)
	}
}

// A request's signature never verifies as a reply's: the two are tagged.
func TestRequestAndReplySignaturesDiffer(t *testing.T) {
	t.Parallel()
	key := bytes.Repeat([]byte("k"), 32)
	if requestreply.Sign(key, "", "a", "b", "c", "d", nil) == requestreply.SignReply(key, "a", "b", "c", "d", nil) {
		t.Fatal("a request and a reply over the same fields sign the same bytes")
	}
}
