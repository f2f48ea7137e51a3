package main

import (
	"errors"
	"flag"
	"fmt"
	"regexp"
	"strings"
	"time"
)

// parsePositional parses args like parse, but also takes positional
// arguments anywhere among the flags (`kfn tail orders.accepted --json`):
// between min and max of them, named by what in errors.
func parsePositional(fs *flagSet, args []string, min, max int, what string) ([]string, error) {
	var positional []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, &helpRequest{help: fs.help, fs: fs.FlagSet}
			}
			return nil, &usageError{msg: flagErrorLine(fs.FlagSet, err)}
		}
		if fs.NArg() == 0 {
			break
		}
		positional = append(positional, fs.Arg(0))
		args = fs.Args()[1:]
	}
	switch {
	case len(positional) < min:
		return nil, &usageError{msg: fmt.Sprintf("missing %s", what)}
	case len(positional) > max:
		return nil, &usageError{msg: fmt.Sprintf("unexpected argument %q (takes %s)", positional[max], what)}
	}
	if err := settingErrors(fs); err != nil {
		return nil, err
	}
	return positional, nil
}

// flagErrorLine is the flag package's error as kfn says it, on one line:
// "invalid value "x" for flag -limit: parse error" becomes
// `--limit "x": not a valid value (parse error)`, and "flag provided but
// not defined: -x" becomes "unknown flag --x".
func flagErrorLine(fs *flag.FlagSet, err error) string {
	msg := strings.ReplaceAll(err.Error(), "\n", "; ")
	if m := invalidFlagValue.FindStringSubmatch(msg); m != nil {
		reason := m[3]
		if f := fs.Lookup(m[2]); f != nil && (reason == "parse error" || reason == "value out of range") {
			reason = "not " + wantedValue(f.Value)
		}
		return fmt.Sprintf("--%s %s: %s", m[2], m[1], reason)
	}
	if name, ok := strings.CutPrefix(msg, "flag provided but not defined: -"); ok {
		return "unknown flag --" + name
	}
	return msg
}

// wantedValue says what value a flag of the flag package's types takes.
func wantedValue(v flag.Value) string {
	g, ok := v.(flag.Getter)
	if !ok {
		return "a valid value"
	}
	switch g.Get().(type) {
	case bool:
		return "true or false"
	case int, int64:
		return "an integer"
	case uint, uint64:
		return "an integer of 0 or more"
	case float64:
		return "a number"
	case time.Duration:
		return "a duration (90s, 5m, 2h)"
	}
	return "a valid value"
}

// invalidFlagValue matches the flag package's error for a value its flag
// refuses (a boolean flag's says "invalid boolean value").
var invalidFlagValue = regexp.MustCompile(`^invalid (?:boolean )?value ("(?:[^"\\]|\\.)*") for (?:flag )?-(\S+): (.*)$`)
