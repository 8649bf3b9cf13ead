package svc_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/km0/km0/internal/services/svc"
)

func TestRequireJSON(t *testing.T) {
	t.Parallel()
	for ct, want := range map[string]bool{"application/json": true, "application/json; charset=utf-8": true, "APPLICATION/JSON;charset=UTF-8": true,
		"": false, "text/plain": false, "application/json; charset=utf-16": false, "application/json; boundary=x": false, "application/json;;": false,
		"multipart/form-data; boundary=x": false, "application/x-www-form-urlencoded": false} {
		r := httptest.NewRequest(http.MethodPost, "/x", strings.NewReader("{}"))
		if ct != "" {
			r.Header.Set("Content-Type", ct)
		}
		w := httptest.NewRecorder()
		if got := svc.RequireJSON(w, r); got != want || (!got && w.Code != http.StatusUnsupportedMediaType) {
			t.Errorf("Content-Type %q: got %v (%d), want %v", ct, got, w.Code, want)
		}
	}
}
