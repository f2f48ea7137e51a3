package main

import (
	"flag"
	"fmt"
	"io"
	"sort"
	"strings"

	"github.com/kfn-dev/kfn/internal/settings"
)

// help is what `kfn CMD -h` prints, in one shape for every command (and
// for kfn itself); docs/reference/cli.md is generated from it (see
// cmd/kfn/internal/docgen, which reads these sections back):
//
//	usage: kfn CMD …          one line per form of the command line
//	       kfn CMD …
//
//	What it does, wrapped by hand; paragraphs are separated by a blank
//	line, and indented lines are shown as they are.
//
//	commands:                 its subcommands, if it has any
//	  NAME  summary
//
//	examples:
//	  kfn CMD …
//
//	flags (a variable in brackets sets the flag from the environment):
//	  -flag type
//	    	meaning [VARIABLE] (default …)
type help struct {
	usage    []string           // the forms of the command line, without "usage: "
	text     string             // what the command does
	commands map[string]command // its subcommands, by name
	examples string             // command lines, one a line; "# …" says what one does
}

// print writes h, then the flags of fs unless fs is nil.
func (h help) print(w io.Writer, fs *flag.FlagSet) {
	for i, u := range h.usage {
		prefix := "usage: "
		if i > 0 {
			prefix = strings.Repeat(" ", len(prefix))
		}
		fmt.Fprintln(w, prefix+u)
	}
	if text := strings.Trim(h.text, "\n"); text != "" {
		fmt.Fprintln(w, "\n"+text)
	}
	if len(h.commands) > 0 {
		fmt.Fprintln(w, "\ncommands:")
		printCommands(w, h.commands)
	}
	if examples := strings.Trim(h.examples, "\n"); examples != "" {
		fmt.Fprintln(w, "\nexamples:")
		for _, line := range strings.Split(examples, "\n") {
			fmt.Fprintln(w, strings.TrimRight("  "+line, " "))
		}
	}
	if fs != nil {
		fmt.Fprintln(w)
		printFlags(fs)
	}
}

// printCommands lists commands by name, each with its summary.
func printCommands(w io.Writer, commands map[string]command) {
	names := make([]string, 0, len(commands))
	width := 0
	for n := range commands {
		names = append(names, n)
		width = max(width, len(n))
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "  %-*s  %s\n", width, n, commands[n].summary)
	}
}

// printFlags lists the flags of fs, with the environment variable of each
// shared setting in brackets.
func printFlags(fs *flag.FlagSet) {
	n := 0
	fs.VisitAll(func(*flag.Flag) { n++ })
	if n == 0 {
		fmt.Fprintln(fs.Output(), "no flags")
		return
	}
	fmt.Fprintln(fs.Output(), "flags (a variable in brackets sets the flag from the environment):")
	settings.PrintDefaults(fs)
}
