package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/schemacheck"
)

const cliV1 = `{"type":"object","required":["id"],"properties":{"id":{"type":"string"},"nota":{"type":"string"}}}`

// gitFixture is a throwaway git repository in t.TempDir().
type gitFixture struct {
	t   *testing.T
	dir string
}

func newGitFixture(t *testing.T) *gitFixture {
	t.Helper()
	if _, err := exec.LookPath("git"); err != nil {
		t.Fatalf("git is required by km0 schema check and was not found: %v", err)
	}
	g := &gitFixture{t: t, dir: t.TempDir()}
	g.git("init", "-q", "-b", "main")
	g.git("config", "user.email", "test@km0.invalid")
	g.git("config", "user.name", "km0 test")
	g.git("config", "commit.gpgsign", "false")
	return g
}

func (g *gitFixture) git(args ...string) string {
	g.t.Helper()
	out, err := exec.Command("git", append([]string{"-C", g.dir}, args...)...).CombinedOutput()
	if err != nil {
		g.t.Fatalf("git %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return strings.TrimSpace(string(out))
}

func (g *gitFixture) write(path, content string) {
	g.t.Helper()
	p := filepath.Join(g.dir, filepath.FromSlash(path))
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		g.t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		g.t.Fatal(err)
	}
}

func (g *gitFixture) remove(path string) {
	g.t.Helper()
	if err := os.Remove(filepath.Join(g.dir, filepath.FromSlash(path))); err != nil {
		g.t.Fatal(err)
	}
}

func (g *gitFixture) commit(msg string) string {
	g.t.Helper()
	g.git("add", "-A")
	g.git("commit", "-q", "-m", msg)
	return g.git("rev-parse", "HEAD")
}

// check runs km0 schema check in the fixture and returns its output and error.
func (g *gitFixture) check(args ...string) (string, error) {
	g.t.Helper()
	var out bytes.Buffer
	err := runSchemaCheck(context.Background(), &out, append([]string{"--repo", g.dir}, args...))
	return out.String(), err
}

func (g *gitFixture) mustPass(args ...string) string {
	g.t.Helper()
	out, err := g.check(args...)
	if err != nil {
		g.t.Fatalf("check %v: %v\n%s", args, err, out)
	}
	return out
}

func (g *gitFixture) mustFail(want string, args ...string) string {
	g.t.Helper()
	out, err := g.check(args...)
	if !errors.Is(err, schemacheck.ErrIncompatible) || !strings.Contains(out, want) {
		g.t.Fatalf("check %v: want a violation %q, got %v\n%s", args, want, err, out)
	}
	return out
}

func TestSchemaCheckAgainstMergeBase(t *testing.T) {
	t.Parallel()
	g := newGitFixture(t)
	g.write("schemas/embed.go", "package schemas\n")
	g.write("schemas/comanda.creada/v1.json", cliV1)
	g.commit("v1")
	g.git("checkout", "-q", "-b", "feature")

	// Allowed: an optional field, committed on the branch.
	g.write("schemas/comanda.creada/v1.json", `{"type":"object","required":["id"],"properties":{"id":{"type":"string"},"nota":{"type":"string"},"mercat":{"type":"string","minLength":1}}}`)
	g.commit("add optional mercat")
	out := g.mustPass()
	if !strings.Contains(out, "1 schema(s) valid and compatible with") {
		t.Fatalf("output: %s", out)
	}

	// Refused in the working tree: removing a field, retyping another.
	g.write("schemas/comanda.creada/v1.json", `{"type":"object","required":["id"],"properties":{"id":{"type":"integer"},"mercat":{"type":"string","minLength":1}}}`)
	out = g.mustFail("comanda.creada v1: nota: remove (field removed)")
	if !strings.Contains(out, "comanda.creada v1: id: retype (type string → integer)") || !strings.Contains(out, "2 violation(s)") {
		t.Fatalf("output: %s", out)
	}

	// Allowed: the breaking change as a new versio, the old file kept.
	g.git("checkout", "-q", "--", "schemas/comanda.creada/v1.json")
	g.write("schemas/comanda.creada/v2.json", `{"type":"object","required":["id"],"properties":{"id":{"type":"integer"}}}`)
	g.mustPass()

	// Refused: deleting the old versio file.
	g.remove("schemas/comanda.creada/v1.json")
	g.mustFail("comanda.creada v1: dades: delete-version")

	// --against an explicit revision (HEAD itself: nothing changed).
	g.git("checkout", "-q", "--", "schemas/comanda.creada/v1.json")
	g.remove("schemas/comanda.creada/v2.json")
	if out := g.mustPass("--against", "HEAD"); !strings.Contains(out, "compatible with HEAD") {
		t.Fatalf("output: %s", out)
	}
	g.write("schemas/comanda.creada/v1.txt", "not a schema")
	g.mustPass()
	g.write("schemas/comanda.creada/latest.json", "{}")
	if _, err := g.check(); err == nil || !strings.Contains(err.Error(), "latest.json: want <tipus>/v<N>.json") {
		t.Fatalf("misnamed schema: %v", err)
	}
}

// A breaking change that already landed is invisible to a comparison with
// HEAD, and caught by --history, which names the commit.
func TestSchemaCheckHistory(t *testing.T) {
	t.Parallel()
	g := newGitFixture(t)
	g.write("schemas/comanda.creada/v1.json", cliV1)
	g.commit("v1")
	g.write("README", "unrelated\n")
	g.commit("unrelated")
	g.write("schemas/comanda.creada/v1.json", `{"type":"object","required":["id","nota"],"properties":{"id":{"type":"string"},"nota":{"type":"string"}}}`)
	bad := g.commit("make nota required")
	g.write("schemas/estoc.actualitzat/v1.json", `{"type":"object"}`)
	g.commit("new tipus")

	g.mustPass("--against", "HEAD")
	out := g.mustFail("commit "+bad[:12]+": comanda.creada v1: nota: require", "--history", "--against", "HEAD")
	if !strings.Contains(out, "3 commit(s) touching schemas/ checked, 1 violation(s)") {
		t.Fatalf("output: %s", out)
	}
}

// With a single commit and no main to compare with, the tree is validated:
// every schema must compile and be a tolerant reader.
func TestSchemaCheckSingleCommitValidatesTheTree(t *testing.T) {
	t.Parallel()
	g := newGitFixture(t)
	g.write("schemas/comanda.creada/v1.json", cliV1)
	g.commit("v1")
	if out := g.mustPass(); !strings.Contains(out, "compatible with nothing (no earlier revision)") {
		t.Fatalf("output: %s", out)
	}
	g.write("schemas/comanda.pagada/v1.json", `{"type":"object","additionalProperties":false}`)
	g.mustFail("comanda.pagada v1: dades: closed")
	g.write("schemas/comanda.pagada/v1.json", `{"type":"objecte"}`)
	g.mustFail("comanda.pagada v1: dades: invalid")
}

func TestSchemaCommandUsage(t *testing.T) {
	t.Parallel()
	if err := runSchema(context.Background(), nil); !errors.Is(err, cli.ErrUsage) {
		t.Fatalf("no subcommand: %v", err)
	}
	if err := runSchema(context.Background(), []string{"lint"}); !errors.Is(err, cli.ErrUsage) {
		t.Fatalf("unknown subcommand: %v", err)
	}
	var out bytes.Buffer
	if err := runSchemaCheck(context.Background(), &out, []string{"--repo", t.TempDir()}); err == nil || !strings.Contains(err.Error(), "git rev-parse") {
		t.Fatalf("outside a repository: %v", err)
	}
}
