package requestreply_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"

	"github.com/km0/km0/outcome"
	"github.com/km0/km0/requestreply"
)

func TestServeTurnsErrorsAndPanicsIntoErrorReplies(t *testing.T) {
	t.Parallel()
	log := slog.New(slog.DiscardHandler)
	cases := []struct {
		name      string
		h         requestreply.Handler
		message   string
		retryable bool
	}{
		{"bad request", func(_ context.Context, r *requestreply.Request) ([]byte, error) {
			var v struct{}
			return nil, requestreply.DecodeJSON(r.Body, &v)
		}, "bad request: malformed JSON", false},
		{"transient", func(context.Context, *requestreply.Request) ([]byte, error) {
			return nil, errors.New("passarel·la: 503")
		}, "passarel·la: 503", true},
		{"panic", func(context.Context, *requestreply.Request) ([]byte, error) { panic("boom") }, "internal error: panic: boom", true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			body, isErr := requestreply.Serve(context.Background(), log, c.h, &requestreply.Request{ID: "x", Body: []byte(`{"a":`)})
			if !isErr {
				t.Fatalf("want an error reply, got %s", body)
			}
			_, err := requestreply.DecodeReply("pagaments", requestreply.ResultError, body)
			var re *requestreply.RemoteError
			if !errors.As(err, &re) || !strings.HasPrefix(re.Message, c.message) || re.Retryable != c.retryable || re.Service != "pagaments" {
				t.Fatalf("got %#v", err)
			}
		})
	}
	body, isErr := requestreply.Serve(context.Background(), log, func(context.Context, *requestreply.Request) ([]byte, error) {
		return []byte(`{"ok":true}`), nil
	}, &requestreply.Request{})
	if isErr || string(body) != `{"ok":true}` {
		t.Fatalf("success: %s %v", body, isErr)
	}
	if got, err := requestreply.DecodeReply("s", requestreply.ResultOK, body); err != nil || string(got) != string(body) {
		t.Fatalf("DecodeReply ok: %s %v", got, err)
	}
}

func TestTimeoutErrorIsErrTimeoutAndDeadlineExceeded(t *testing.T) {
	t.Parallel()
	var err error = &requestreply.TimeoutError{Service: "s", RequestID: "r"}
	if !errors.Is(err, requestreply.ErrTimeout) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatal("TimeoutError must match ErrTimeout and context.DeadlineExceeded")
	}
}

// DecodeJSON is strict: a body another decoder reads differently (a repeated
// member, a member named like a field but for case, invalid UTF-8) is a bad
// request, not the last or the case-folded value.
func TestDecodeJSONRefusesAmbiguousBodies(t *testing.T) {
	t.Parallel()
	var v struct {
		ID string `json:"id"`
	}
	for _, body := range []string{`{"id":"a","id":"b"}`, `{"ID":"b"}`, "{\"id\":\"\xff\"}", `{"id":"\ud800"}`} {
		if err := requestreply.DecodeJSON([]byte(body), &v); !outcome.IsPermanent(err) {
			t.Errorf("%s: got %v, want a permanent bad request", body, err)
		}
	}
	if err := requestreply.DecodeJSON([]byte(`{"id":"a","altre":1}`), &v); err != nil || v.ID != "a" {
		t.Fatalf("plain body: %v %+v", err, v)
	}
}
