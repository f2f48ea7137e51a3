package main

import (
	"bytes"
	"fmt"
	"regexp"
	"strings"

	"github.com/kfn-dev/kfn/internal/process"
	"github.com/kfn-dev/kfn/runtime"
)

// page is one -h page of kfn, read back into the sections cmd/kfn's help
// prints: usage lines, text, subcommands, examples, flags.
type page struct {
	path     []string // the command's words after kfn: ["dlq", "park"]
	summary  string   // the line its parent's commands section gives it
	usage    []string
	text     []string // paragraphs, lines kept
	commands []entry
	examples []string
	flags    []flagDoc
	children []*page
}

// entry is a line of a commands section.
type entry struct{ name, summary string }

// flagDoc is a flag as settings.PrintDefaults prints it.
type flagDoc struct {
	name, typ, usage string
	env              string // the bracketed variables of a shared setting: "DATABASE_URL, or a file: DATABASE_URL_FILE"
	def              string // the default as -h shows it; "" for none
}

// name is the page's command line prefix: "kfn dlq park".
func (p *page) name() string { return strings.Join(append([]string{"kfn"}, p.path...), " ") }

// readCommands reads kfn's own -h and, through its commands sections, the
// -h of every command and subcommand.
func readCommands(help func(args ...string) (string, error)) (*page, error) {
	var read func(path []string, summary string) (*page, error)
	read = func(path []string, summary string) (*page, error) {
		text, err := help(path...)
		if err != nil {
			return nil, err
		}
		p, err := parsePage(text)
		if err != nil {
			return nil, fmt.Errorf("kfn %s -h: %w", strings.Join(path, " "), err)
		}
		p.path, p.summary = path, summary
		for _, c := range p.commands {
			child, err := read(append(append([]string(nil), path...), c.name), c.summary)
			if err != nil {
				return nil, err
			}
			p.children = append(p.children, child)
		}
		return p, nil
	}
	return read(nil, "")
}

// parsePage reads the sections of a -h page (see cmd/kfn's help).
func parsePage(text string) (*page, error) {
	lines := strings.Split(strings.TrimRight(text, "\n"), "\n")
	if len(lines) == 0 || !strings.HasPrefix(lines[0], "usage: ") {
		return nil, fmt.Errorf("does not start with a usage line:\n%s", text)
	}
	p := &page{usage: []string{strings.TrimPrefix(lines[0], "usage: ")}}
	i := 1
	for ; i < len(lines) && strings.HasPrefix(lines[i], "       "); i++ {
		p.usage = append(p.usage, strings.TrimPrefix(lines[i], "       "))
	}
	section, body := "text", []string(nil)
	flush := func() error {
		for len(body) > 0 && body[len(body)-1] == "" {
			body = body[:len(body)-1]
		}
		switch section {
		case "text":
			p.text = paragraphs(body)
		case "commands":
			for _, l := range body {
				name, summary, ok := strings.Cut(strings.TrimSpace(l), "  ")
				if !ok {
					return fmt.Errorf("commands line %q has no summary", l)
				}
				p.commands = append(p.commands, entry{name, strings.TrimSpace(summary)})
			}
		case "examples":
			for _, l := range body {
				p.examples = append(p.examples, strings.TrimPrefix(l, "  "))
			}
		case "flags":
			p.flags = parseFlags(body)
			for _, l := range body {
				if !flagLine.MatchString(l) && !strings.HasPrefix(l, "    \t") {
					return fmt.Errorf("flags line %q is not as settings.PrintDefaults writes one", l)
				}
			}
		}
		return nil
	}
	for ; i < len(lines); i++ {
		l := lines[i]
		next := ""
		switch {
		case l == "commands:":
			next = "commands"
		case l == "examples:":
			next = "examples"
		case l == "no flags":
			next = "none"
		case strings.HasPrefix(l, "flags (") && strings.HasSuffix(l, "):"):
			next = "flags"
		}
		if next == "" {
			if len(body) > 0 || l != "" {
				body = append(body, l)
			}
			continue
		}
		if err := flush(); err != nil {
			return nil, err
		}
		section, body = next, nil
	}
	return p, flush()
}

// paragraphs splits lines at blank lines.
func paragraphs(lines []string) []string {
	var out []string
	var cur []string
	for _, l := range append(lines, "") {
		if l != "" {
			cur = append(cur, l)
			continue
		}
		if len(cur) > 0 {
			out = append(out, strings.Join(cur, "\n"))
			cur = nil
		}
	}
	return out
}

var (
	flagLine   = regexp.MustCompile(`^  -(\S+)(?: (\S+))?(?:\t(.*))?$`)
	envDefault = regexp.MustCompile(`(?s)^(.*?)(?: \[([^\]]+)\])?(?: \(default (.*)\))?$`)
)

// parseFlags reads the flags settings.PrintDefaults wrote among lines.
func parseFlags(lines []string) []flagDoc {
	var out []flagDoc
	var usage []string
	done := func() {
		if len(out) == 0 {
			return
		}
		m := envDefault.FindStringSubmatch(strings.Join(usage, "\n"))
		f := &out[len(out)-1]
		f.usage, f.env, f.def = m[1], m[2], m[3]
		usage = nil
	}
	for _, l := range lines {
		if m := flagLine.FindStringSubmatch(l); m != nil {
			done()
			out = append(out, flagDoc{name: m[1], typ: m[2]})
			if m[3] != "" {
				usage = append(usage, m[3])
			}
			continue
		}
		if rest, ok := strings.CutPrefix(l, "    \t"); ok && len(out) > 0 {
			usage = append(usage, rest)
		}
	}
	done()
	return out
}

// functionFlags returns the flags of a function's binary (worker.Start)
// and of its migrate mode, by the name the configuration reference gives
// each, from the -h they print.
func functionFlags() (map[string][]flagDoc, error) {
	out := map[string][]flagDoc{}
	for name, args := range map[string][]string{
		"FUNCTION":         {"-h"},
		"FUNCTION migrate": {"migrate", "-h"},
	} {
		var help, stderr bytes.Buffer
		if code := process.Main(runtime.Function{Name: "function"}, args, &help, &stderr); code != 0 {
			return nil, fmt.Errorf("a function binary's %v: exit %d\n%s", args, code, stderr.String())
		}
		out[name] = parseFlags(strings.Split(help.String(), "\n"))
	}
	return out, nil
}
