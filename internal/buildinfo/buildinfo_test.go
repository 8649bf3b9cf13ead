package buildinfo

import (
	"runtime"
	"testing"
)

// Link-time values win over the toolchain's stamps; Short cuts the commit
// to 12 characters and marks a modified tree; fields never come back empty.
func TestReadPrefersLinkTimeValuesAndShortMarksAModifiedTree(t *testing.T) {
	in := Read()
	if in.Module == "" || in.Version == "" || in.Commit == "" || in.GoVersion != runtime.Version() {
		t.Fatalf("Read() = %+v: want every field set and Go %s", in, runtime.Version())
	}
	version, commit = "v1.2.3", "0123456789abcdef0123"
	defer func() { version, commit = "", "" }()
	in = Read()
	if in.Version != "v1.2.3" || in.Commit != "0123456789abcdef0123" {
		t.Fatalf("Read() = %+v, want the link-time version and commit", in)
	}
	if got := in.Short(); got != "v1.2.3 (0123456789ab)" {
		t.Fatalf("Short() = %q", got)
	}
	in.Modified = true
	if got := in.Short(); got != "v1.2.3 (0123456789ab+dirty)" {
		t.Fatalf("Short() of a modified tree = %q", got)
	}
}
