package docscheck

import (
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode"
)

// root is the repository's root, seen from this package's folder.
const root = "../.."

// shellLangs are the fence tags of shell blocks.
var shellLangs = []string{"sh", "bash", "shell", "zsh", "console"}

var (
	fenceRE  = regexp.MustCompile("^\\s*(```+|~~~+)\\s*([A-Za-z0-9_+-]*)")
	runByRE  = regexp.MustCompile(`^\s*<!--\s*run by:\s*(.+?)\s*-->\s*$`)
	notRunRE = regexp.MustCompile(`^\s*<!--\s*not run:\s*(.+?)\s*-->\s*$`)
	linkRE   = regexp.MustCompile(`\]\(([^)\s]+)(?:\s+"[^"]*")?\)`)
	codeRE   = regexp.MustCompile("`[^`]*`")
)

// block is one fenced block of a page.
type block struct {
	page   string // relative to root
	line   int    // of the opening fence, 1-based
	lang   string
	marker string // the line before the opening fence
	body   []string
}

// shell reports whether b is a shell block.
func (b block) shell() bool {
	if slices.Contains(shellLangs, b.lang) {
		return true
	}
	if b.lang != "" {
		return false
	}
	for _, l := range b.body {
		if strings.HasPrefix(strings.TrimSpace(l), "$ ") {
			return true
		}
	}
	return false
}

// pages returns README.md and docs/**/*.md but docs/reference/, relative
// to root.
func pages(t *testing.T) []string {
	t.Helper()
	out := []string{"README.md"}
	err := filepath.WalkDir(filepath.Join(root, "docs"), func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		rel = filepath.ToSlash(rel)
		if d.IsDir() && rel == "docs/reference" {
			return filepath.SkipDir
		}
		if !d.IsDir() && strings.HasSuffix(rel, ".md") {
			out = append(out, rel)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// scan splits a page into its fenced blocks and its prose lines (the lines
// outside fences, with their line numbers).
func scan(t *testing.T, page string) (blocks []block, prose map[int]string) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(root, page))
	if err != nil {
		t.Fatal(err)
	}
	prose = map[int]string{}
	lines := strings.Split(string(data), "\n")
	var open *block
	var fence string
	for i, l := range lines {
		m := fenceRE.FindStringSubmatch(l)
		switch {
		case open == nil && m != nil:
			open = &block{page: page, line: i + 1, lang: strings.ToLower(m[2])}
			fence = m[1]
			if i > 0 {
				open.marker = lines[i-1]
			}
		case open != nil && m != nil && strings.HasPrefix(strings.TrimSpace(l), fence) && strings.TrimSpace(l) == strings.TrimSpace(m[1]):
			blocks = append(blocks, *open)
			open = nil
		case open != nil:
			open.body = append(open.body, l)
		default:
			prose[i+1] = l
		}
	}
	if open != nil {
		t.Errorf("%s:%d: a fence that is never closed", page, open.line)
	}
	return blocks, prose
}

// testFuncs returns the names of every func TestX( in the repository's
// *_test.go files.
func testFuncs(t *testing.T) map[string]bool {
	t.Helper()
	re := regexp.MustCompile(`(?m)^func (Test[A-Za-z0-9_]*)\(`)
	names := map[string]bool{}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "node_modules") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range re.FindAllSubmatch(data, -1) {
			names[string(m[1])] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return names
}

// commands returns the command lines of a shell block: without a "$ "
// prompt, comments and continuation lines; in a block with prompts, only
// the prompted lines (the rest is output).
func commands(b block) []string {
	prompted := false
	for _, l := range b.body {
		if strings.HasPrefix(strings.TrimSpace(l), "$ ") {
			prompted = true
		}
	}
	var out []string
	cont := false
	for _, l := range b.body {
		l = strings.TrimSpace(l)
		wasCont := cont
		cont = strings.HasSuffix(l, "\\")
		if wasCont || l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		if prompted {
			if !strings.HasPrefix(l, "$ ") {
				continue
			}
			l = strings.TrimPrefix(l, "$ ")
		}
		if i := strings.Index(l, " #"); i >= 0 {
			l = strings.TrimSpace(l[:i])
		}
		out = append(out, strings.TrimSuffix(l, " \\"))
	}
	return out
}

// TestShellBlocksAreRunOrMarkedNotRun checks that every shell block in
// README.md and docs/ says who runs it (a test that exists, or .ci/run,
// which holds each of its commands) or why nothing does.
func TestShellBlocksAreRunOrMarkedNotRun(t *testing.T) {
	tests := testFuncs(t)
	n := 0
	for _, page := range pages(t) {
		blocks, _ := scan(t, page)
		for _, b := range blocks {
			if !b.shell() {
				continue
			}
			n++
			if m := notRunRE.FindStringSubmatch(b.marker); m != nil {
				continue
			}
			m := runByRE.FindStringSubmatch(b.marker)
			if m == nil {
				t.Errorf("%s:%d: a shell block without a marker: put <!-- run by: TestName --> or <!-- not run: why --> on the line before its fence", b.page, b.line)
				continue
			}
			for _, runner := range strings.Split(m[1], ",") {
				runner = strings.TrimSpace(runner)
				switch {
				case strings.HasPrefix(runner, "Test"):
					if !tests[runner] {
						t.Errorf("%s:%d: run by %s, but no *_test.go in the repository has func %s(", b.page, b.line, runner, runner)
					}
				case strings.Contains(runner, "/"):
					script, err := os.ReadFile(filepath.Join(root, runner))
					if err != nil {
						t.Errorf("%s:%d: run by %s: %v", b.page, b.line, runner, err)
						continue
					}
					for _, c := range commands(b) {
						if !strings.Contains(string(script), c) {
							t.Errorf("%s:%d: run by %s, but it has no %q", b.page, b.line, runner, c)
						}
					}
				default:
					t.Errorf("%s:%d: run by %q: name a Go test (TestName) or a script's path (.ci/run)", b.page, b.line, runner)
				}
			}
		}
	}
	if n == 0 {
		t.Fatal("found no shell block at all: is the scan broken?")
	}
	t.Logf("%d shell blocks checked", n)
}

// anchors returns the anchors GitHub makes of a page's headings: lower
// case, punctuation but hyphens and underscores dropped, spaces as hyphens,
// and -1, -2 … after a repeated one.
func anchors(t *testing.T, page string) map[string]bool {
	t.Helper()
	_, prose := scan(t, page)
	seen := map[string]int{}
	out := map[string]bool{}
	lines := slices.Sorted(maps.Keys(prose))
	for _, n := range lines {
		line := prose[n]
		if !strings.HasPrefix(line, "#") {
			continue
		}
		heading := strings.TrimSpace(strings.TrimLeft(line, "#"))
		var b strings.Builder
		for _, r := range strings.ToLower(heading) {
			switch {
			case r == ' ':
				b.WriteRune('-')
			case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
				b.WriteRune(r)
			}
		}
		a := b.String()
		if n := seen[a]; n > 0 {
			out[fmt.Sprintf("%s-%d", a, n)] = true
		} else {
			out[a] = true
		}
		seen[a]++
	}
	return out
}

// TestRelativeLinksResolve checks that every relative link in README.md
// and docs/ (outside code) names a file or folder that exists (the
// generated references under docs/reference/ among them), and that a link
// to a heading (page.md#anchor, #anchor) names a heading of that page.
func TestRelativeLinksResolve(t *testing.T) {
	n := 0
	for _, page := range pages(t) {
		_, prose := scan(t, page)
		for line, text := range prose {
			text = codeRE.ReplaceAllString(text, "")
			for _, m := range linkRE.FindAllStringSubmatch(text, -1) {
				target := m[1]
				if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
					continue
				}
				target, anchor, _ := strings.Cut(target, "#")
				n++
				rel := page
				if target != "" {
					rel = filepath.ToSlash(filepath.Clean(filepath.Join(filepath.Dir(page), target)))
				}
				if strings.HasPrefix(rel, "../") {
					t.Errorf("%s:%d: link %s leaves the repository", page, line, m[1])
					continue
				}
				if _, err := os.Stat(filepath.Join(root, rel)); err != nil {
					t.Errorf("%s:%d: link %s: %s does not exist", page, line, m[1], rel)
					continue
				}
				if anchor != "" && strings.HasSuffix(rel, ".md") && !anchors(t, rel)[anchor] {
					t.Errorf("%s:%d: link %s: %s has no heading #%s", page, line, m[1], rel, anchor)
				}
			}
		}
	}
	if n == 0 {
		t.Fatal("found no relative link at all: is the scan broken?")
	}
	t.Logf("%d relative links checked", n)
}
