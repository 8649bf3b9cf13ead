package archtest

import (
	"go/ast"
	"go/parser"
	"go/token"
	"maps"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// maxUnusedExported is the most exported names of the public packages that
// no other package and no example may leave unused (TestUnusedExportedNames):
// 29 when it was set, rounded up a bit; the target is fewer than 100.
// The list may only shrink: when a change lowers the count, lower this
// constant with it; never raise it (a new name is used by another package or
// shown in an example, or it is not exported).
const maxUnusedExported = 35

// srcPkg is what `go list -json` says of one package's files.
type srcPkg struct {
	ImportPath   string
	Name         string
	Dir          string
	GoFiles      []string
	CgoFiles     []string
	TestGoFiles  []string
	XTestGoFiles []string
	Imports      []string
	TestImports  []string
	XTestImports []string
}

// listSources runs `go list -json` on args from the module root.
func listSources(t *testing.T, root string, args ...string) []srcPkg {
	t.Helper()
	return goList[srcPkg](t, root, "ImportPath,Name,Dir,GoFiles,CgoFiles,TestGoFiles,XTestGoFiles,Imports,TestImports,XTestImports", append([]string{"-e"}, args...)...)
}

// isPublic says whether a package (relative to the module) is part of the
// library: no internal element, not a command.
func isPublic(name string) bool {
	return name != "" && name != "cmd" && !strings.HasPrefix(name, "cmd/") &&
		!slices.Contains(strings.Split(name, "/"), "internal")
}

// exported lists the exported package-level names and the exported methods
// of exported types that a package's non-test files define, as "Name" and
// "Type.Method".
func exported(files []*ast.File) []string {
	var names []string
	for _, f := range files {
		for _, d := range f.Decls {
			switch d := d.(type) {
			case *ast.FuncDecl:
				if !d.Name.IsExported() {
					continue
				}
				if d.Recv == nil {
					names = append(names, d.Name.Name)
				} else if typ := recvType(d.Recv); ast.IsExported(typ) {
					names = append(names, typ+"."+d.Name.Name)
				}
			case *ast.GenDecl:
				for _, s := range d.Specs {
					switch s := s.(type) {
					case *ast.TypeSpec:
						if s.Name.IsExported() {
							names = append(names, s.Name.Name)
						}
					case *ast.ValueSpec:
						for _, n := range s.Names {
							if n.IsExported() {
								names = append(names, n.Name)
							}
						}
					}
				}
			}
		}
	}
	return names
}

// recvType is the name of a method's receiver type: T of T, *T, T[P], *T[P].
func recvType(recv *ast.FieldList) string {
	if len(recv.List) == 0 {
		return ""
	}
	x := recv.List[0].Type
	for {
		switch e := x.(type) {
		case *ast.StarExpr:
			x = e.X
		case *ast.ParenExpr:
			x = e.X
		case *ast.IndexExpr:
			x = e.X
		case *ast.IndexListExpr:
			x = e.X
		case *ast.Ident:
			return e.Name
		default:
			return ""
		}
	}
}

// useSet is what a body of code refers to: qualified names as
// "importpath.Name", and the spelling of every selector (x.Name).
type useSet struct {
	qualified map[string]bool
	selectors map[string]bool
}

func newUseSet() useSet {
	return useSet{qualified: map[string]bool{}, selectors: map[string]bool{}}
}

// collect adds to u what the nodes refer to. imports maps the file's import
// names to import paths; dot holds the paths the file imports with ".".
func (u useSet) collect(imports map[string]string, dot []string, nodes ...ast.Node) {
	for _, n := range nodes {
		ast.Inspect(n, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.SelectorExpr:
				u.selectors[n.Sel.Name] = true
				if x, ok := n.X.(*ast.Ident); ok {
					if path, ok := imports[x.Name]; ok {
						u.qualified[path+"."+n.Sel.Name] = true
						return false
					}
				}
			case *ast.Ident:
				if n.IsExported() {
					for _, path := range dot {
						u.qualified[path+"."+n.Name] = true
					}
				}
			}
			return true
		})
	}
}

// importNames maps a file's import names to their paths, and lists the paths
// it imports with ".". names gives the package name of an import path
// imported without a name (only the module's packages matter).
func importNames(f *ast.File, names map[string]string) (map[string]string, []string) {
	imports := map[string]string{}
	var dot []string
	for _, s := range f.Imports {
		path, err := strconv.Unquote(s.Path.Value)
		if err != nil {
			continue
		}
		name := names[path]
		if s.Name != nil {
			name = s.Name.Name
		}
		switch name {
		case "", "_":
		case ".":
			dot = append(dot, path)
		default:
			imports[name] = path
		}
	}
	return imports, dot
}

// exampleCode returns the Example functions of an external test package's
// files and the top-level declarations they reach (helpers, types, vars),
// by the names they mention.
func exampleCode(files []*ast.File) []ast.Node {
	decls := map[string][]ast.Node{} // top-level name (or receiver type name) -> declarations
	var roots []ast.Node
	for _, f := range files {
		for _, d := range f.Decls {
			switch d := d.(type) {
			case *ast.FuncDecl:
				if d.Recv != nil {
					typ := recvType(d.Recv)
					decls[typ] = append(decls[typ], d)
				} else if strings.HasPrefix(d.Name.Name, "Example") {
					roots = append(roots, d)
				} else {
					decls[d.Name.Name] = append(decls[d.Name.Name], d)
				}
			case *ast.GenDecl:
				for _, s := range d.Specs {
					switch s := s.(type) {
					case *ast.TypeSpec:
						decls[s.Name.Name] = append(decls[s.Name.Name], s)
					case *ast.ValueSpec:
						for _, n := range s.Names {
							decls[n.Name] = append(decls[n.Name], s)
						}
					}
				}
			}
		}
	}
	reached := slices.Clone(roots)
	seen := map[string]bool{}
	for i := 0; i < len(reached); i++ {
		ast.Inspect(reached[i], func(n ast.Node) bool {
			if id, ok := n.(*ast.Ident); ok && !seen[id.Name] {
				if ds, ok := decls[id.Name]; ok {
					seen[id.Name] = true
					reached = append(reached, ds...)
				}
			}
			return true
		})
	}
	return reached
}

// interfaceMethods adds the method names every interface type of the files
// declares.
func interfaceMethods(files []*ast.File, into map[string]bool) {
	for _, f := range files {
		ast.Inspect(f, func(n ast.Node) bool {
			if it, ok := n.(*ast.InterfaceType); ok {
				for _, m := range it.Methods.List {
					if _, ok := m.Type.(*ast.FuncType); ok {
						for _, name := range m.Names {
							into[name.Name] = true
						}
					}
				}
			}
			return true
		})
	}
}

func parseFiles(t *testing.T, fset *token.FileSet, dir string, names ...[]string) []*ast.File {
	t.Helper()
	var files []*ast.File
	for _, list := range names {
		for _, name := range list {
			f, err := parser.ParseFile(fset, filepath.Join(dir, name), nil, parser.SkipObjectResolution)
			if err != nil {
				t.Fatal(err)
			}
			files = append(files, f)
		}
	}
	return files
}

// TestUnusedExportedNames measures the library's API surface
// (docs/design/packages.md, "The API surface"): the exported names of the
// public packages that no other package of the module and no example uses.
// It is a syntactic approximation, without type checking:
//
//   - The names are the exported package-level funcs, types, vars and consts
//     of a public package's non-test files, and the exported methods of its
//     exported types. Definitions in _test.go files are not API.
//   - A package-level name P.Name is used when a file of another package of
//     the module (its tests included, and cmd/ and internal/) writes
//     alias.Name, alias being that file's import name of P (or mentions Name
//     when it imports P with "."). P's own external tests (package p_test)
//     do not count, except its Example functions and the declarations of
//     p_test they reach.
//   - A method T.M is used when another package (or one of P's examples)
//     selects any x.M, whatever x's type, or when an interface type in a
//     non-test file of the module or of a package the module imports
//     directly declares a method M (T may satisfy it); Error counts as used
//     (the predeclared error interface).
//
// Struct fields and the methods of unexported types are not counted. The
// approximation errs toward used for methods (any selector of the same
// spelling) and for shadowed names (a local spelled like an import name
// counts as the package), and toward unused for a name a caller reaches
// without writing it (a type only inferred from a call's result).
func TestUnusedExportedNames(t *testing.T) {
	t.Parallel()
	root := root(t)
	pkgs := listSources(t, root, "./...")
	fset := token.NewFileSet()

	names := map[string]string{} // import path -> package name
	external := map[string]bool{}
	for _, p := range pkgs {
		names[p.ImportPath] = p.Name
	}
	for _, p := range pkgs {
		for _, imps := range [][]string{p.Imports, p.TestImports, p.XTestImports} {
			for _, imp := range imps {
				if _, ok := names[imp]; !ok && imp != "C" {
					external[imp] = true
				}
			}
		}
	}

	defs := map[string][]string{}            // public package -> its exported names
	uses := map[string]useSet{}              // package -> what its files use (external tests included)
	examples := map[string]useSet{}          // package -> what its examples use
	ifaces := map[string]bool{"Error": true} // method names interfaces declare
	for _, p := range pkgs {
		r := rel(p.ImportPath)
		prod := parseFiles(t, fset, p.Dir, p.GoFiles, p.CgoFiles)
		tests := parseFiles(t, fset, p.Dir, p.TestGoFiles)
		xtests := parseFiles(t, fset, p.Dir, p.XTestGoFiles)
		if isPublic(r) {
			defs[p.ImportPath] = exported(prod)
		}
		interfaceMethods(prod, ifaces)
		u := newUseSet()
		for _, f := range slices.Concat(prod, tests, xtests) {
			imports, dot := importNames(f, names)
			u.collect(imports, dot, f)
		}
		uses[p.ImportPath] = u
		ex := newUseSet()
		nodes := exampleCode(xtests)
		for _, f := range xtests {
			imports, dot := importNames(f, names)
			var in []ast.Node
			for _, n := range nodes {
				if n.Pos() >= f.Pos() && n.End() <= f.End() {
					in = append(in, n)
				}
			}
			ex.collect(imports, dot, in...)
		}
		examples[p.ImportPath] = ex
	}

	// The interfaces of the packages the module imports: a method of the
	// same name may satisfy one of them (String, MarshalJSON, Collect, ...).
	if len(external) > 0 {
		for _, p := range listSources(t, root, slices.Sorted(maps.Keys(external))...) {
			interfaceMethods(parseFiles(t, fset, p.Dir, p.GoFiles, p.CgoFiles), ifaces)
		}
	}

	var unused []string
	for _, path := range slices.Sorted(maps.Keys(defs)) {
		for _, name := range defs[path] {
			used := false
			if _, method, ok := strings.Cut(name, "."); ok {
				used = ifaces[method] || examples[path].selectors[method]
				for other, u := range uses {
					if used {
						break
					}
					used = other != path && u.selectors[method]
				}
			} else {
				key := path + "." + name
				used = examples[path].qualified[key]
				for other, u := range uses {
					if used {
						break
					}
					used = other != path && u.qualified[key]
				}
			}
			if !used {
				unused = append(unused, rel(path)+"."+name)
			}
		}
	}
	slices.Sort(unused)
	total := 0
	for _, d := range defs {
		total += len(d)
	}
	t.Logf("exported names of the %d public packages: %d; unused by other packages and examples: %d (at most %d; the target is < 100)",
		len(defs), total, len(unused), maxUnusedExported)
	for _, n := range unused {
		t.Logf("  %s", n)
	}
	if len(unused) > maxUnusedExported {
		t.Errorf("%d exported names no other package and no example uses, more than %d: unexport a name only its own package uses, delete one nothing uses, show one a user needs in an example", len(unused), maxUnusedExported)
	}
}
