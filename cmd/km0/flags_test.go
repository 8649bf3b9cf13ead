package main

import (
	"bytes"
	"strings"
	"testing"
)

func TestHelpNeverPrintsTheDatabaseURL(t *testing.T) {
	t.Setenv("KM0_DATABASE_URL", "postgres://km0:s3cret@db/km0")
	fs := newFlags("x", "test")
	var out bytes.Buffer
	fs.SetOutput(&out)
	v := databaseURLFlag(fs)
	fs.Usage()
	if strings.Contains(out.String(), "s3cret") {
		t.Fatalf("--help leaks the password:\n%s", out.String())
	}
	if err := fs.Parse(nil); err != nil || *v != "postgres://km0:s3cret@db/km0" {
		t.Fatalf("environment fallback lost: %q %v", *v, err)
	}
}
