package main

import (
	"errors"
	"flag"
	"fmt"

	"github.com/kfn-dev/kfn/internal/settings"
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

// flagErrorLine is the flag package's error as kfn says it, on one line
// (settings.FlagErrorLine, which the function binaries share).
func flagErrorLine(fs *flag.FlagSet, err error) string { return settings.FlagErrorLine(fs, err) }
