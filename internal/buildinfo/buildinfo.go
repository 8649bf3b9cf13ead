// Package buildinfo reads what the Go toolchain stamped into the running
// binary: the module's version, the VCS commit it was built from and the Go
// version. `km0 version` prints it and every service's /salut shows it.
package buildinfo

import (
	"cmp"
	"fmt"
	"runtime"
	"runtime/debug"
)

// version and commit, when set at link time (go build -ldflags "-X
// github.com/km0/km0/internal/buildinfo.version=v0.3.1 -X
// github.com/km0/km0/internal/buildinfo.commit=<sha>", as deploy/Dockerfile
// does: a build context without .git, or a git worktree, gets no VCS stamp
// from the toolchain), replace what the toolchain stamped.
var version, commit string

// Unknown stands for a field the binary does not carry (a test binary, or
// a build outside a VCS checkout or with -buildvcs=false).
const Unknown = "unknown"

// Info is the build of the running binary.
type Info struct {
	Module    string // main module path, e.g. github.com/km0/km0
	Version   string // module version, e.g. v0.3.1 or a pseudo-version; "(devel)" when untagged
	Commit    string // vcs.revision, Unknown when not stamped
	Time      string // vcs.time (RFC 3339), Unknown when not stamped
	Modified  bool   // the working tree had uncommitted changes (vcs.modified)
	GoVersion string // e.g. go1.25.0
}

// Read returns the running binary's Info. It never fails: fields the binary
// does not carry are Unknown.
func Read() (in Info) {
	in = Info{Module: Unknown, Version: Unknown, Commit: Unknown, Time: Unknown, GoVersion: runtime.Version()}
	defer func() {
		in.Version = cmp.Or(version, in.Version)
		in.Commit = cmp.Or(commit, in.Commit)
	}()
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return in
	}
	in.Module = cmp.Or(bi.Main.Path, Unknown)
	in.Version = cmp.Or(bi.Main.Version, Unknown)
	in.GoVersion = cmp.Or(bi.GoVersion, in.GoVersion)
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			in.Commit = s.Value
		case "vcs.time":
			in.Time = s.Value
		case "vcs.modified":
			in.Modified = s.Value == "true"
		}
	}
	return in
}

// Short is the version and the commit's first 12 characters, with
// "+dirty" when the tree was modified, e.g. "v0.3.1 (1a2b3c4d5e6f)".
func (in Info) Short() string {
	c := in.Commit
	if len(c) > 12 {
		c = c[:12]
	}
	if in.Modified {
		c += "+dirty"
	}
	return fmt.Sprintf("%s (%s)", in.Version, c)
}
