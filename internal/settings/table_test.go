package settings

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"strconv"
	"strings"
	"testing"
)

// TestTableListsEverySetting: every Setting declared in this package is in
// Table once, so the configuration reference lists it.
func TestTableListsEverySetting(t *testing.T) {
	declared := map[string]string{} // flag → the variable's name
	fset := token.NewFileSet()
	pkgs, err := parser.ParseDir(fset, ".", func(fi os.FileInfo) bool { return !strings.HasSuffix(fi.Name(), "_test.go") }, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range pkgs["settings"].Files {
		ast.Inspect(f, func(n ast.Node) bool {
			spec, ok := n.(*ast.ValueSpec)
			if !ok {
				return true
			}
			for i, v := range spec.Values {
				lit, ok := v.(*ast.CompositeLit)
				if !ok {
					continue
				}
				if ix, ok := lit.Type.(*ast.IndexExpr); !ok || ix.X.(*ast.Ident).Name != "Setting" {
					continue
				}
				for _, e := range lit.Elts {
					if kv, ok := e.(*ast.KeyValueExpr); ok && kv.Key.(*ast.Ident).Name == "Flag" {
						flag, _ := strconv.Unquote(kv.Value.(*ast.BasicLit).Value)
						declared[flag] = spec.Names[i].Name
					}
				}
			}
			return true
		})
	}
	if len(declared) == 0 {
		t.Fatal("found no declared setting: the test's parsing is broken")
	}
	listed := map[string]int{}
	for _, g := range Table {
		for _, s := range g.Settings {
			listed[s.Describe().Flag]++
		}
	}
	for flag, name := range declared {
		if listed[flag] != 1 {
			t.Errorf("%s (--%s) is listed %d times in Table; want once", name, flag, listed[flag])
		}
	}
	for flag := range listed {
		if _, ok := declared[flag]; !ok {
			t.Errorf("Table lists --%s, which no declared setting has", flag)
		}
	}
}
