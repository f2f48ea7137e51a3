package settings

import (
	"flag"
	"fmt"
	"io"
	"regexp"
	"strings"
	"time"
)

// FlagErrorLine is a flag set's parse error as kfn's commands and function
// binaries say it, on one line: `invalid value "x" for flag -limit: parse
// error` becomes `--limit "x": not an integer`, and `flag provided but not
// defined: -x` becomes `unknown flag --x`. The caller adds who speaks and
// where help is ("see orders -h").
func FlagErrorLine(fs *flag.FlagSet, err error) string {
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

// QuietParse parses args into fs without the flag package's own output (it
// prints the error and the whole usage): the caller says what went wrong
// in one line (FlagErrorLine), or prints the usage on -h, which comes back
// as flag.ErrHelp.
func QuietParse(fs *flag.FlagSet, args []string) error {
	out, usage := fs.Output(), fs.Usage
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	defer func() { fs.SetOutput(out); fs.Usage = usage }()
	return fs.Parse(args)
}
