// Package schemacheck is `km0 schema check`: the event schemas of a git
// working tree compared with a revision, and optionally every commit of the
// branch with its parent, refusing incompatible changes (schema.CompareSets).
package schemacheck

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"

	"github.com/km0/km0/schema"
)

// ErrIncompatible is Check's error when it found a violation (printed).
var ErrIncompatible = errors.New("incompatible schema change")

// Options are what `km0 schema check` compares.
type Options struct {
	// Against is the git revision to compare with. Default: the merge base
	// with main; if that is HEAD or there is no main, HEAD~; with a single
	// commit, the tree is only validated.
	Against string
	// History also checks every commit on the current branch that touched
	// the schemas against its parent.
	History bool
	// Repo is a directory inside the git repository.
	Repo string
	// Dir is the schemas directory, relative to the repository root.
	Dir string
}

// Check compares the event schemas (<tipus>/v<N>.json) of the working tree
// with a git revision (schema.CompareSets), prints each violation and a
// summary line to w, and returns ErrIncompatible if there was one.
func Check(ctx context.Context, w io.Writer, o Options) error {
	g := gitRepo{dir: o.Repo}
	top, err := g.run(ctx, "rev-parse", "--show-toplevel")
	if err != nil {
		return err
	}
	g.dir = strings.TrimSpace(top)
	rel := path.Clean(filepath.ToSlash(o.Dir))
	tree, err := readTree(filepath.Join(g.dir, filepath.FromSlash(rel)))
	if err != nil {
		return err
	}
	n := 0
	if o.History {
		if n, err = g.checkHistory(ctx, w, rel); err != nil {
			return err
		}
	}
	base := o.Against
	if base == "" {
		if base, err = g.defaultBase(ctx); err != nil {
			return err
		}
	}
	old := map[schema.Key][]byte{}
	label := "nothing (no earlier revision)"
	if base != "" {
		if old, err = g.readRev(ctx, base, rel); err != nil {
			return err
		}
		label = base
	}
	vs := schema.CompareSets(old, tree)
	for _, v := range vs {
		fmt.Fprintf(w, "working tree vs %s: %s\n", label, v)
	}
	if n += len(vs); n > 0 {
		fmt.Fprintf(w, "schema check: %d violation(s); an incompatible change needs a new versio file (keep the old one)\n", n)
		return ErrIncompatible
	}
	fmt.Fprintf(w, "schema check: %d schema(s) valid and compatible with %s\n", len(tree), label)
	return nil
}

// readTree reads every <tipus>/v<N>.json under dir. Any other .json file is
// an error: a misnamed schema would otherwise go unchecked.
func readTree(dir string) (map[schema.Key][]byte, error) {
	out := map[schema.Key][]byte{}
	fsys := os.DirFS(dir)
	err := fs.WalkDir(fsys, ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() || !strings.HasSuffix(p, ".json") {
			return nil
		}
		k, ok := schema.ParsePath(p)
		if !ok || strings.Count(p, "/") != 1 {
			return fmt.Errorf("%s: want <tipus>/v<N>.json", filepath.Join(dir, p))
		}
		out[k], err = fs.ReadFile(fsys, p)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("schema check: %w", err)
	}
	return out, nil
}

type gitRepo struct{ dir string }

func (g gitRepo) run(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, "git", append([]string{"-C", g.dir}, args...)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("git %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return stdout.String(), nil
}

func (g gitRepo) ok(ctx context.Context, args ...string) (string, bool) {
	out, err := g.run(ctx, args...)
	return strings.TrimSpace(out), err == nil
}

// defaultBase is the merge base with main (or origin/main); when that is HEAD
// itself or there is no main, HEAD~; with a single commit, "" (validate only).
func (g gitRepo) defaultBase(ctx context.Context) (string, error) {
	head, ok := g.ok(ctx, "rev-parse", "--verify", "-q", "HEAD")
	if !ok {
		return "", nil // no commit yet
	}
	for _, main := range []string{"main", "origin/main"} {
		if mb, ok := g.ok(ctx, "merge-base", "HEAD", main); ok && mb != head {
			return mb, nil
		}
	}
	if parent, ok := g.ok(ctx, "rev-parse", "--verify", "-q", "HEAD~1"); ok {
		return parent, nil
	}
	return "", nil
}

// readRev reads every <tipus>/v<N>.json under dir at rev with git show.
func (g gitRepo) readRev(ctx context.Context, rev, dir string) (map[schema.Key][]byte, error) {
	list, err := g.run(ctx, "ls-tree", "-r", "--name-only", rev, "--", dir+"/")
	if err != nil {
		return nil, err
	}
	out := map[schema.Key][]byte{}
	for _, p := range strings.Fields(list) {
		rest := strings.TrimPrefix(p, dir+"/")
		k, ok := schema.ParsePath(rest)
		if !ok || strings.Count(rest, "/") != 1 {
			continue // not a schema file (e.g. embed.go)
		}
		b, err := g.run(ctx, "show", rev+":"+p)
		if err != nil {
			return nil, err
		}
		out[k] = []byte(b)
	}
	return out, nil
}

// checkHistory compares, for every commit of the current branch (first
// parents) that touched dir, the schemas at the commit with those at its
// parent, and prints each violation with the commit. It returns the count.
func (g gitRepo) checkHistory(ctx context.Context, w io.Writer, dir string) (int, error) {
	revs, err := g.run(ctx, "rev-list", "--reverse", "--first-parent", "HEAD", "--", dir+"/")
	if err != nil {
		return 0, err
	}
	n := 0
	commits := strings.Fields(revs)
	for _, c := range commits {
		old := map[schema.Key][]byte{}
		if parent, ok := g.ok(ctx, "rev-parse", "--verify", "-q", c+"^1"); ok {
			if old, err = g.readRev(ctx, parent, dir); err != nil {
				return 0, err
			}
		}
		cur, err := g.readRev(ctx, c, dir)
		if err != nil {
			return 0, err
		}
		for _, v := range schema.CompareSets(old, cur) {
			fmt.Fprintf(w, "commit %s: %s\n", c[:12], v)
			n++
		}
	}
	fmt.Fprintf(w, "schema check --history: %d commit(s) touching %s/ checked, %d violation(s)\n", len(commits), dir, n)
	return n, nil
}
