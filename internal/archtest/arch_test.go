package archtest

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
)

const module = "github.com/km0/km0"

// pkg is what `go list -json` says of one package.
type pkg struct {
	ImportPath string
	Imports    []string
	Deps       []string
}

// rel is path relative to the module, "" for a path outside it.
func rel(path string) string {
	if path == module {
		return "."
	}
	if r, ok := strings.CutPrefix(path, module+"/"); ok {
		return r
	}
	return ""
}

func isBroker(path string) bool {
	for _, p := range brokerModules {
		if strings.HasPrefix(path, p) {
			return true
		}
	}
	return false
}

// list returns the module's packages, keyed by their path relative to the
// module, with their non-test imports and dependencies.
func list(t *testing.T, root string) map[string]pkg {
	t.Helper()
	pkgs := map[string]pkg{}
	for _, p := range goList[pkg](t, root, "ImportPath,Imports,Deps", "./...") {
		pkgs[rel(p.ImportPath)] = p
	}
	return pkgs
}

// goList runs `go list -json=fields args...` from the module root and
// decodes each package into a T.
func goList[T any](t *testing.T, root, fields string, args ...string) []T {
	t.Helper()
	cmd := exec.Command("go", append([]string{"list", "-json=" + fields}, args...)...)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "GOWORK=off")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, stderr.String())
	}
	var pkgs []T
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p T
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		pkgs = append(pkgs, p)
	}
	return pkgs
}

// violations returns every breach of the map, as "pkg: rule" strings with
// the rule as Exception.Rule spells it, and a detail for each.
func violations(t *testing.T, pkgs map[string]pkg) map[string]string {
	t.Helper()
	out := map[string]string{}
	for name, p := range pkgs {
		layer, ok := layers[name]
		if !ok {
			t.Errorf("package %s is not in the package map: give it a layer in internal/archtest/rules.go and a row in docs/design/packages.md", name)
			continue
		}
		for _, imp := range p.Imports {
			if r := rel(imp); r != "" {
				to, ok := layers[r]
				if ok && !slices.Contains(mayImport[layer], to) {
					out[name+": import "+r] = fmt.Sprintf("%s (%s) imports %s (%s)", name, layer, r, to)
				}
			}
			if strings.HasPrefix(imp, embeddedBroker) && layer != TestKit && name != embedPackage {
				out[name+": embedded"] = fmt.Sprintf("%s (%s) imports the embedded broker %s: only %s and the test kits may", name, layer, imp, embedPackage)
			}
		}
		if layer != TestKit && layer != Appl && name != embedPackage {
			for _, d := range p.Deps {
				if strings.HasPrefix(d, embeddedBroker) {
					out[name+": embedded"] = fmt.Sprintf("%s (%s) links the embedded broker %s: only %s and the test kits may", name, layer, d, embedPackage)
					break
				}
			}
		}
		if brokerFree[layer] {
			var brokers []string
			for _, d := range p.Deps {
				if isBroker(d) {
					brokers = append(brokers, d)
				}
			}
			if len(brokers) > 0 {
				out[name+": broker"] = fmt.Sprintf("%s (%s) links %d broker client packages: %s", name, layer, len(brokers), strings.Join(brokers, ", "))
			}
		}
	}
	return out
}

// TestPackageMap enforces docs/design/packages.md: every package has a
// layer; a layer imports only the layers below it (and its own); contract,
// base and patterns link no broker client; only kafkaembed and the test
// kits import the embedded broker, and no other library package links it. Today's violations are listed in exceptions, each with
// the change that removes it; an exception that no longer occurs must be
// deleted, so what it held is enforced from then on.
func TestPackageMap(t *testing.T) {
	t.Parallel()
	root := root(t)
	pkgs := list(t, root)
	found := violations(t, pkgs)
	known := map[string]bool{}
	for _, e := range exceptions {
		key := e.Pkg + ": " + e.Rule
		known[key] = true
		if _, ok := found[key]; !ok {
			t.Errorf("exception %q (%s) no longer occurs: delete it from internal/archtest/rules.go and docs/design/packages.md", key, e.Target)
		}
	}
	keys := make([]string, 0, len(found))
	for k := range found {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if !known[k] {
			t.Errorf("%s: against the package map (docs/design/packages.md)", found[k])
		}
	}
	t.Logf("%d packages, %d known exceptions", len(pkgs), len(exceptions))
}

// TestLayoutMetrics logs issue 22's measures of the layout. It fails only
// when a measure cannot be taken.
func TestLayoutMetrics(t *testing.T) {
	t.Parallel()
	root := root(t)
	pkgs := list(t, root)
	for _, name := range []string{"consumer", "dlq", "lag", "relay", "outbox", "inbox"} {
		p, ok := pkgs[name]
		if !ok {
			t.Fatalf("package %s not found", name)
		}
		n := 0
		for _, d := range p.Deps {
			if isBroker(d) {
				n++
			}
		}
		t.Logf("broker client packages in the deps of %-8s %d", name+":", n)
	}
	kfake := 0
	for _, d := range pkgs["transport/kafka"].Deps {
		if strings.HasPrefix(d, embeddedBroker) {
			kfake++
		}
	}
	t.Logf("kfake packages in the deps of transport/kafka: %d", kfake)

	public := 0
	for name := range pkgs {
		if !slices.Contains(strings.Split(name, "/"), "internal") {
			public++
		}
	}
	t.Logf("public packages: %d of %d", public, len(pkgs))

	// A declaration `Name = contract.HeaderX` (in a const or var block or
	// alone), not a comparison.
	alias := regexp.MustCompile(`(?m)^\s*(?:const\s+|var\s+)?\w+(?:\s+[\w.]+)?\s*=\s*contract\.Header\w*\s*(?://.*)?$`)
	aliases, aliasFiles := 0, 0
	cmdAll, cmdProd := 0, 0
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		r, _ := filepath.Rel(root, path)
		if d.IsDir() {
			if r == "third_party" || strings.HasPrefix(d.Name(), ".") && r != "." {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") {
			return nil
		}
		test := strings.HasSuffix(path, "_test.go")
		if !test {
			data, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			if n := len(alias.FindAll(data, -1)); n > 0 {
				aliases += n
				aliasFiles++
			}
		}
		if filepath.Dir(r) == filepath.Join("cmd", "km0") {
			n, err := lines(path)
			if err != nil {
				return err
			}
			cmdAll += n
			if !test {
				cmdProd += n
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("`= contract.Header…` aliases outside tests: %d in %d files", aliases, aliasFiles)
	t.Logf("cmd/km0 lines: %d without tests, %d with them", cmdProd, cmdAll)
}

func lines(path string) (int, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	n := 0
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		n++
	}
	return n, sc.Err()
}

// root is the module's root directory.
func root(t *testing.T) string {
	t.Helper()
	r, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(r, "go.mod")); err != nil {
		t.Fatalf("module root not found from %s: %v", r, err)
	}
	return r
}
