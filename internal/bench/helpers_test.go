package bench

import (
	"io"
	"os"
	"testing"
)

// captureStderr runs f and returns what it wrote to stdout and stderr.
func captureStderr(t *testing.T, f func()) string {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	old, oldOut := os.Stderr, os.Stdout
	os.Stderr, os.Stdout = w, w
	done := make(chan string)
	go func() {
		b, _ := io.ReadAll(r)
		done <- string(b)
	}()
	f()
	os.Stderr, os.Stdout = old, oldOut
	_ = w.Close()
	return <-done
}
