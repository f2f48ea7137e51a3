package main

import (
	"fmt"
	"strings"
)

// renderCLI writes docs/reference/cli.md: kfn's commands, then a section
// per command and subcommand with its -h page.
func renderCLI(root *page) []byte {
	var b strings.Builder
	b.WriteString(header("what `kfn CMD -h` prints for each command (cmd/kfn, through cmd/kfn/internal/docgen)"))
	b.WriteString("\n# kfn command reference\n\n")
	b.WriteString("Each section below is what `kfn <command> -h` prints. Every flag marked with a variable can be\n")
	b.WriteString("set from the environment instead; [the configuration reference](configuration.md) lists those settings.\n\n")
	b.WriteString("```text\n" + strings.Join(usageLines(root), "\n") + "\n```\n\n")
	for _, p := range root.text {
		b.WriteString(paragraph(p) + "\n")
	}
	b.WriteString("| Command | What it does |\n|---|---|\n")
	var walk func(p *page)
	walk = func(p *page) {
		for _, c := range p.children {
			fmt.Fprintf(&b, "| [%s](#%s) | %s |\n", c.name(), anchor(c.name()), escape(c.summary))
			walk(c)
		}
	}
	walk(root)
	var sections func(p *page, level int)
	sections = func(p *page, level int) {
		for _, c := range p.children {
			writeCommand(&b, c, level)
			sections(c, level+1)
		}
	}
	sections(root, 2)
	return []byte(b.String())
}

// writeCommand writes p's section, with a heading of the given level.
func writeCommand(b *strings.Builder, p *page, level int) {
	fmt.Fprintf(b, "\n%s %s\n\n", strings.Repeat("#", level), p.name())
	fmt.Fprintf(b, "```text\n%s\n```\n\n", strings.Join(usageLines(p), "\n"))
	for _, para := range p.text {
		b.WriteString(paragraph(para) + "\n")
	}
	if len(p.commands) > 0 {
		b.WriteString("Commands:\n\n")
		for _, c := range p.commands {
			name := p.name() + " " + c.name
			fmt.Fprintf(b, "- [%s](#%s): %s\n", name, anchor(name), escape(c.summary))
		}
		b.WriteString("\n")
	}
	if len(p.examples) > 0 {
		b.WriteString("Examples:\n\n```sh\n" + strings.Join(p.examples, "\n") + "\n```\n\n")
	}
	if len(p.flags) == 0 {
		b.WriteString("No flags.\n")
		return
	}
	b.WriteString("| Flag | Variable | Default | Meaning |\n|---|---|---|---|\n")
	for _, f := range p.flags {
		fmt.Fprintf(b, "| %s | %s | %s | %s |\n", flagCell(f), envCell(f.env), defaultCell(f.def), escape(cell(f.usage)))
	}
}

// usageLines are p's usage lines as -h prints them.
func usageLines(p *page) []string {
	out := make([]string, len(p.usage))
	for i, u := range p.usage {
		prefix := "usage: "
		if i > 0 {
			prefix = "       "
		}
		out[i] = prefix + u
	}
	return out
}

// anchor is the id GitHub gives the heading text h.
func anchor(h string) string {
	return strings.ReplaceAll(strings.ToLower(h), " ", "-")
}

func flagCell(f flagDoc) string {
	if f.typ == "" {
		return code("--" + f.name)
	}
	return code("--"+f.name) + " " + f.typ
}

// envCell shows the bracketed variables of a flag, each as code.
func envCell(env string) string {
	if env == "" {
		return ""
	}
	first, file, ok := strings.Cut(env, ", or a file: ")
	if ok {
		return code(first) + ", or a file: " + code(file)
	}
	return code(env)
}

// defaultCell shows a default: a value as code, words as text ("a
// throwaway cluster started here").
func defaultCell(def string) string {
	switch {
	case def == "":
		return ""
	case strings.Contains(def, " ") && !strings.HasPrefix(def, `"`):
		return escape(def)
	}
	return code(def)
}
