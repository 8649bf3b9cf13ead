package doctest

import (
	"bytes"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
)

// NoCompile is the info string of a Go block that is not meant to compile
// (pseudo-code, an elided struct): ```go nocompile. Every other ```go block
// of README.md and docs/**/*.md is compiled by TestDocSnippetsCompile.
const NoCompile = "nocompile"

// imports maps the package names a snippet may use to their import paths;
// a snippet gets the imports of the names it uses.
var imports = map[string]string{
	"context":      "context",
	"errors":       "errors",
	"fmt":          "fmt",
	"os":           "os",
	"time":         "time",
	"slog":         "log/slog",
	"pgx":          "github.com/jackc/pgx/v5",
	"pgxpool":      "github.com/jackc/pgx/v5/pgxpool",
	"prometheus":   "github.com/prometheus/client_golang/prometheus",
	"kgo":          "github.com/twmb/franz-go/pkg/kgo",
	"otel":         "go.opentelemetry.io/otel",
	"sdktrace":     "go.opentelemetry.io/otel/sdk/trace",
	"propagation":  "go.opentelemetry.io/otel/propagation",
	"contract":     "github.com/km0/km0/contract",
	"envelope":     "github.com/km0/km0/envelope",
	"outcome":      "github.com/km0/km0/outcome",
	"migrate":      "github.com/km0/km0/migrate",
	"outbox":       "github.com/km0/km0/outbox",
	"relay":        "github.com/km0/km0/relay",
	"cdc":          "github.com/km0/km0/relay/cdc",
	"inbox":        "github.com/km0/km0/inbox",
	"consumer":     "github.com/km0/km0/consumer",
	"keyorder":     "github.com/km0/km0/keyorder",
	"dlq":          "github.com/km0/km0/dlq",
	"kafkadlq":     "github.com/km0/km0/dlq/kafkadlq",
	"amqpdlq":      "github.com/km0/km0/dlq/amqpdlq",
	"lag":          "github.com/km0/km0/lag",
	"schema":       "github.com/km0/km0/schema",
	"tracing":      "github.com/km0/km0/tracing",
	"requestreply": "github.com/km0/km0/requestreply",
	"amqprr":       "github.com/km0/km0/requestreply/amqprr",
	"kafkarr":      "github.com/km0/km0/requestreply/kafkarr",
	"transport":    "github.com/km0/km0/transport",
	"kafka":        "github.com/km0/km0/transport/kafka",
	"amqp":         "github.com/km0/km0/transport/amqp",
	"kafkalag":     "github.com/km0/km0/transport/kafka/kafkalag",
	"amqplag":      "github.com/km0/km0/transport/amqp/amqplag",
}

// givens are the names a fragment may use without declaring them, as the
// surrounding prose introduces them: each becomes a parameter of the
// snippet's function when the fragment mentions it.
var givens = []struct{ name, typ string }{
	{"ctx", "context.Context"},
	{"pool", "*pgxpool.Pool"},
	{"tx", "pgx.Tx"},
	{"reg", "*schema.Registry"},
	{"ob", "*outbox.Outbox"},
	{"env", "*envelope.Envelope"},
	{"m", "*consumer.Message"},
	{"cl", "*kgo.Client"},
	{"conn", "*amqp.Conn"},
	{"b", "[]string"},
	{"id", "string"},
	{"dades", "[]byte"},
	{"p", "[]byte"},
	{"order", "[]byte"},
	{"body", "[]byte"},
	{"handle", "consumer.Handler"},
	{"h", "requestreply.Handler"},
	{"applyEffect", "func(context.Context, pgx.Tx, ...any) error"},
	{"events", "[]*outbox.Event"},
	{"exporter", "sdktrace.SpanExporter"},
	{"consumerConfig", "consumer.Config"},
	{"relayConfig", "relay.Config"},
	{"isRefusal", "func(error) bool"},
}

type block struct {
	file string // relative to the repository root
	line int    // of the first line of code
	info string // the info string after ```go
	code string
}

var fence = regexp.MustCompile("^```go(.*)$")

// blocks returns the ```go blocks of the markdown file rel under root.
func blocks(t *testing.T, root, rel string) []block {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(root, rel))
	if err != nil {
		t.Fatal(err)
	}
	var out []block
	var cur *block
	for i, l := range strings.Split(string(data), "\n") {
		switch {
		case cur == nil:
			if m := fence.FindStringSubmatch(strings.TrimRight(l, " \r")); m != nil {
				cur = &block{file: rel, line: i + 2, info: strings.TrimSpace(m[1])}
			}
		case strings.HasPrefix(strings.TrimSpace(l), "```"):
			out = append(out, *cur)
			cur = nil
		default:
			cur.code += l + "\n"
		}
	}
	if cur != nil {
		t.Fatalf("%s:%d: ```go block never closed", rel, cur.line-1)
	}
	return out
}

// docFiles returns README.md and every .md under docs/, relative to root.
func docFiles(t *testing.T, root string) []string {
	t.Helper()
	files := []string{"README.md"}
	err := filepath.WalkDir(filepath.Join(root, "docs"), func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(path, ".md") {
			rel, _ := filepath.Rel(root, path)
			files = append(files, filepath.ToSlash(rel))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(files)
	return files
}

// source turns a block into the Go file of package pkg: a block with its own
// package clause is taken as it is; one of declarations gets a package clause
// and imports; one of statements becomes the body of a function whose
// parameters are the givens it mentions, inside an inner block (so the
// fragment may redeclare them), followed by `_ = x` for each name it
// declares at its top level (a doc need not use every result).
func source(b block, pkg string) (string, error) {
	lineDir := fmt.Sprintf("//line %s:%d\n", b.file, b.line)
	if strings.HasPrefix(strings.TrimSpace(b.code), "package ") {
		return lineDir + b.code, nil
	}
	fset := token.NewFileSet()
	var body string
	if _, err := parser.ParseFile(fset, "", "package p\n"+b.code, parser.SkipObjectResolution); err == nil {
		body = lineDir + b.code
	} else {
		f, err := parser.ParseFile(fset, "", "package p\nfunc f() {\n"+b.code+"\n}\n", parser.SkipObjectResolution)
		if err != nil {
			return "", fmt.Errorf("%s:%d: neither declarations nor statements: %v", b.file, b.line, err)
		}
		mentioned := idents(f)
		var params []string
		for _, g := range givens {
			if mentioned[g.name] {
				params = append(params, g.name+" "+g.typ)
			}
		}
		var uses []string
		for _, n := range declared(f.Decls[0].(*ast.FuncDecl).Body.List) {
			uses = append(uses, "_ = "+n)
		}
		body = fmt.Sprintf("func Snippet(%s) {\n\t{\n%s%s\n//line %s:%d\n\t\t%s\n\t}\n}\n",
			strings.Join(params, ", "), lineDir, b.code, b.file, b.line, strings.Join(uses, "; "))
	}
	// The imports: the known package names used as a qualifier and not
	// declared by the snippet.
	f, err := parser.ParseFile(fset, "", "package p\n"+body, parser.SkipObjectResolution)
	if err != nil {
		return "", fmt.Errorf("%s:%d: %v", b.file, b.line, err)
	}
	local := map[string]bool{}
	ast.Inspect(f, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.AssignStmt:
			if n.Tok == token.DEFINE {
				for _, l := range n.Lhs {
					if id, ok := l.(*ast.Ident); ok {
						local[id.Name] = true
					}
				}
			}
		case *ast.ValueSpec:
			for _, id := range n.Names {
				local[id.Name] = true
			}
		}
		return true
	})
	used := map[string]bool{}
	ast.Inspect(f, func(n ast.Node) bool {
		if s, ok := n.(*ast.SelectorExpr); ok {
			if id, ok := s.X.(*ast.Ident); ok && imports[id.Name] != "" && !local[id.Name] {
				used[id.Name] = true
			}
		}
		return true
	})
	var imp []string
	for n := range used {
		imp = append(imp, fmt.Sprintf("\t%s %q\n", n, imports[n]))
	}
	sort.Strings(imp)
	head := "package " + pkg + "\n"
	if len(imp) > 0 {
		head += "\nimport (\n" + strings.Join(imp, "") + ")\n"
	}
	return head + "\n" + body, nil
}

// idents returns every identifier of f.
func idents(f *ast.File) map[string]bool {
	out := map[string]bool{}
	ast.Inspect(f, func(n ast.Node) bool {
		if id, ok := n.(*ast.Ident); ok {
			out[id.Name] = true
		}
		return true
	})
	return out
}

// declared returns the names the statements declare at their own level.
func declared(stmts []ast.Stmt) []string {
	seen := map[string]bool{}
	var out []string
	add := func(id *ast.Ident) {
		if id.Name != "_" && !seen[id.Name] {
			seen[id.Name] = true
			out = append(out, id.Name)
		}
	}
	for _, s := range stmts {
		switch s := s.(type) {
		case *ast.AssignStmt:
			if s.Tok == token.DEFINE {
				for _, l := range s.Lhs {
					if id, ok := l.(*ast.Ident); ok {
						add(id)
					}
				}
			}
		case *ast.DeclStmt:
			if g, ok := s.Decl.(*ast.GenDecl); ok && g.Tok == token.VAR {
				for _, sp := range g.Specs {
					for _, id := range sp.(*ast.ValueSpec).Names {
						add(id)
					}
				}
			}
		}
	}
	return out
}

// TestDocSnippetsCompile compiles every ```go block of README.md and
// docs/**/*.md (except ```go nocompile) with one `go build` of a temporary
// module that uses this repository through a replace directive. An error is
// reported at the block's line in the markdown file.
func TestDocSnippetsCompile(t *testing.T) {
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	gomod, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	gosum, err := os.ReadFile(filepath.Join(root, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	// The repository's requirements and replacements, its relative
	// replacement directories made absolute.
	mod := strings.Replace(string(gomod), "module github.com/km0/km0", "module km0doctest", 1)
	mod = strings.ReplaceAll(mod, "=> ./", "=> "+root+"/")
	mod = strings.ReplaceAll(mod, "=> ../", "=> "+filepath.Dir(root)+"/") +
		"\nrequire github.com/km0/km0 v0.0.0-00010101000000-000000000000\n\nreplace github.com/km0/km0 => " + root + "\n"
	for name, data := range map[string][]byte{"go.mod": []byte(mod), "go.sum": gosum} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	compiled, skipped := 0, 0
	perFile := map[string]int{}
	for _, rel := range docFiles(t, root) {
		for _, b := range blocks(t, root, rel) {
			if b.info == NoCompile {
				skipped++
				continue
			}
			if b.info != "" {
				t.Errorf("%s:%d: ```go %s: unknown info string, want none or %q", b.file, b.line-1, b.info, NoCompile)
				continue
			}
			compiled++
			perFile[rel]++
			pkg := fmt.Sprintf("s%03d", compiled)
			src, err := source(b, pkg)
			if err != nil {
				t.Error(err)
				continue
			}
			if err := os.MkdirAll(filepath.Join(dir, pkg), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, pkg, "snippet.go"), []byte(src), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	if compiled == 0 {
		t.Fatal("no ```go block found in README.md and docs/")
	}
	cmd := exec.Command("go", "build", "./...")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=mod", "GOPROXY=off")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		t.Fatalf("the doc snippets do not compile (%v):\n%s", err, out.String())
	}
	files := make([]string, 0, len(perFile))
	for f, n := range perFile {
		files = append(files, fmt.Sprintf("%s %d", f, n))
	}
	sort.Strings(files)
	t.Logf("compiled %d ```go blocks (%s); %d marked %s", compiled, strings.Join(files, ", "), skipped, NoCompile)
}
