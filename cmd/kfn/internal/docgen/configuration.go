package main

import (
	"fmt"
	"strings"

	"github.com/kfn-dev/kfn/internal/settings"
)

// renderConfiguration writes docs/reference/configuration.md: every
// setting of settings.Table, by group, and where each applies: the
// function binaries (workers) and the kfn commands whose -h lists it.
func renderConfiguration(root *page, functions map[string][]flagDoc) []byte {
	var b strings.Builder
	b.WriteString(header("the settings table (internal/settings: Table, Variables) and the -h of kfn's commands and of a function binary (through cmd/kfn/internal/docgen)"))
	b.WriteString("\n# Configuration reference\n\n")
	b.WriteString("A setting takes its flag if given, else its environment variable if set to something other than\n")
	b.WriteString("the empty string, else its default. A value that does not parse or cannot be used is an error\n")
	b.WriteString("naming the flag and the variable; it is never replaced by the default. A variable ending in\n")
	b.WriteString("`_FILE` names a file that holds a secret setting's value. \"Used by\" says which programs take the\n")
	b.WriteString("setting: `FUNCTION` is a function's binary (a main package calling `worker.Start`), `FUNCTION migrate`\n")
	b.WriteString("its migrate mode, and the others are kfn's commands ([the CLI reference](cli.md)).\n")
	for _, g := range settings.Table {
		fmt.Fprintf(&b, "\n## %s\n\n", g.Name)
		b.WriteString("| Flag | Variable | Default | Meaning | Used by |\n|---|---|---|---|---|\n")
		for _, s := range g.Settings {
			d := s.Describe()
			flag := code("--" + d.Flag)
			if d.Type != "" {
				flag += " " + d.Type
			}
			fmt.Fprintf(&b, "| %s | %s | %s | %s | %s |\n",
				flag, variables(d), defaultCell(d.Default), escape(cell(d.Usage)), strings.Join(usedBy(d, root, functions), ", "))
		}
	}
	b.WriteString("\n## Variables without a flag\n\n| Variable | Meaning |\n|---|---|\n")
	for _, v := range settings.Variables {
		fmt.Fprintf(&b, "| %s | %s |\n", code(v.Name), escape(v.Usage))
	}
	return []byte(b.String())
}

// variables lists d's variable, its former name and its file's variable.
func variables(d settings.Description) string {
	out := code(d.Env)
	if d.OldEnv != "" {
		out += " (or its former name " + code(d.OldEnv) + ")"
	}
	if d.FileEnv != "" {
		out += ", or a file: " + code(d.FileEnv)
	}
	return out
}

// usedBy names the programs whose -h lists d's flag with d's variable:
// the function binary's modes, then the kfn commands that have no
// subcommands, in the CLI reference's order.
func usedBy(d settings.Description, root *page, functions map[string][]flagDoc) []string {
	takes := func(flags []flagDoc) bool {
		for _, f := range flags {
			if f.name == d.Flag && strings.HasPrefix(f.env, d.Env) {
				return true
			}
		}
		return false
	}
	var out []string
	for _, name := range []string{"FUNCTION", "FUNCTION migrate"} {
		if takes(functions[name]) {
			out = append(out, code(name))
		}
	}
	var walk func(p *page)
	walk = func(p *page) {
		for _, c := range p.children {
			if len(c.children) == 0 && takes(c.flags) {
				out = append(out, fmt.Sprintf("[%s](cli.md#%s)", strings.Join(c.path, " "), anchor(c.name())))
			}
			walk(c)
		}
	}
	walk(root)
	return out
}
