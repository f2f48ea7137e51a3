// Package settings declares each setting of kfn's workers and of the kfn
// command once: its flag, its environment variable, its default, its line of
// usage and its check (see declared.go). runtime.Config.Bind and the kfn
// subcommands bind the settings they use to their flag sets, so a setting is
// spelled, documented and checked the same way wherever it appears.
//
// A bound setting takes its flag if given, else its environment variable if
// set to something other than the empty string, else its default. A given
// value (flag or variable) that does not parse or fails the setting's check
// is an *Error naming the flag and the variable; it is never replaced by the
// default, and an explicit zero is checked like any other value.
package settings

import (
	"flag"
	"fmt"
	"os"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/kfn-dev/kfn/internal/redact"
)

// Setting is one setting. T is string, []string (given as a comma-separated
// list), int, bool or time.Duration.
type Setting[T any] struct {
	Flag   string // the flag, without dashes: "batch-size"
	Env    string // its environment variable: "KFN_BATCH_SIZE"
	OldEnv string // a former name of the variable, read when Env is not set
	Usage  string // what it is, for -h; the variable and the default are added

	// Default is the value when neither the flag nor the variable is given.
	// DefaultText is what -h shows instead, for a default worked out at run
	// time ("host-pid"); Default is then the zero value.
	Default     T
	DefaultText string

	// Check rejects a value that cannot be used, with a message that
	// follows the flag and the variable ("must be at least 1"). It sees
	// every given value, zero included; nil accepts anything.
	Check func(T) error

	// Secret marks a password or a token, or a URL that may hold one: its
	// value may instead be read from the file named by the variable Env +
	// "_FILE" (DATABASE_URL_FILE), once, when the setting is bound; giving
	// both variables is an error, and so is a file that cannot be read.
	Secret bool

	// ZeroAs, unless zero itself, is stored for a given zero that Check
	// accepts: for a field whose own zero means "the default", such as
	// runtime.Config.BatchWait, where 0 ("no wait") is stored as negative.
	ZeroAs T
}

// Error is a setting's value that cannot be used.
type Error struct {
	Flag string // the flag, without dashes
	Env  string // the environment variable
	Msg  string
}

func (e *Error) Error() string {
	return fmt.Sprintf("invalid configuration: --%s (%s): %s", e.Flag, e.Env, e.Msg)
}

// Binder binds settings to a flag set and keeps what is wrong with their
// given values.
type Binder struct {
	fs    *flag.FlagSet
	bound []boundSetting
}

// boundSetting is a value[T] of any T.
type boundSetting interface {
	problems() []*Error
	setting() (flag string, secret bool)
	fromEnv() (env, text string, ok bool)
}

// NewBinder returns a Binder for fs.
func NewBinder(fs *flag.FlagSet) *Binder { return &Binder{fs: fs} }

// Errors returns, once the flag set is parsed, the given values that did not
// parse (from the environment; the flag set reports a bad flag itself) or
// failed their setting's check, in the order the settings were bound.
func (b *Binder) Errors() []*Error {
	var errs []*Error
	for _, v := range b.bound {
		errs = append(errs, v.problems()...)
	}
	return errs
}

// Secret reports whether flag (without dashes) is a bound Secret setting's.
func (b *Binder) Secret(flag string) bool {
	for _, v := range b.bound {
		if name, secret := v.setting(); name == flag {
			return secret
		}
	}
	return false
}

// Environment lists, in binding order, the settings whose value came from
// a variable, as VAR=value: what a command line does not show. A Secret
// setting's value is redacted (redact.Redact), and one read from a file
// shows the file's variable and name.
func (b *Binder) Environment() []string {
	var out []string
	for _, v := range b.bound {
		if env, text, ok := v.fromEnv(); ok {
			out = append(out, env+"="+text)
		}
	}
	return out
}

// Bind registers s as a flag of b's flag set and stores its value in *p: the
// default now, then the environment variable's value if it is set, then the
// flag's when the flag set is parsed. A flag wins over the environment.
func (s Setting[T]) Bind(b *Binder, p *T) {
	v := &value[T]{s: s, p: p}
	envs := s.Env
	if s.Secret {
		envs += ", or a file: " + s.FileEnv()
	}
	b.fs.Var(v, s.Flag, s.Usage+" ["+envs+"]")
	*p = s.Default
	b.bound = append(b.bound, v)
	if s.Secret && os.Getenv(s.FileEnv()) != "" {
		v.from = s.FileEnv()
		text, err := s.readFile()
		if err != nil {
			v.err = err
			return
		}
		if x, err := parse[T](text); err != nil {
			v.err = err
		} else {
			v.store(x)
		}
		return
	}
	for _, env := range []string{s.Env, s.OldEnv} {
		text := ""
		if env != "" {
			text = os.Getenv(env)
		}
		if text == "" {
			continue
		}
		v.from = env
		if x, err := parse[T](text); err != nil {
			v.err = err
		} else {
			v.store(x)
		}
		break
	}
}

// FileEnv is the variable that names a file holding a Secret setting's
// value: Env + "_FILE".
func (s Setting[T]) FileEnv() string { return s.Env + "_FILE" }

// readFile reads a Secret setting's value from the file its FileEnv names,
// without the white space around it (a final newline).
func (s Setting[T]) readFile() (string, error) {
	for _, env := range []string{s.Env, s.OldEnv} {
		if env != "" && os.Getenv(env) != "" {
			return "", fmt.Errorf("both %s and %s are set: give the value one way", env, s.FileEnv())
		}
	}
	path := os.Getenv(s.FileEnv())
	data, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("cannot read the file it names: %v", err)
	}
	text := strings.TrimSpace(string(data))
	if text == "" {
		return "", fmt.Errorf("the file it names, %s, is empty", path)
	}
	return text, nil
}

// Problems returns what s's check finds wrong with v, for a value that did
// not come through Bind (a Go caller's, or a default).
func (s Setting[T]) Problems(v T) []*Error {
	if s.Check == nil {
		return nil
	}
	return s.errors(s.Env, s.Check(v))
}

// errors turns err, which may join several, into Errors naming s and env.
func (s Setting[T]) errors(env string, err error) []*Error {
	if err == nil {
		return nil
	}
	all := []error{err}
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		all = j.Unwrap()
	}
	out := make([]*Error, 0, len(all))
	for _, e := range all {
		out = append(out, &Error{Flag: s.Flag, Env: env, Msg: e.Error()})
	}
	return out
}

// value is a bound setting: the flag.Value of its flag.
type value[T any] struct {
	s    Setting[T]
	p    *T
	from string // where the value came from: "" (the default), "flag" or a variable
	err  error  // the given value did not parse (variable) or failed the check
}

// String is the default until a value is given (so that the flag package
// records the default as the flag's DefValue), then the value.
func (v *value[T]) String() string {
	if v == nil || v.p == nil {
		return ""
	}
	if v.from == "" {
		return v.s.defaultText()
	}
	return format(*v.p)
}

func (v *value[T]) Set(text string) error {
	x, err := parse[T](text)
	if err != nil {
		return err // the flag set reports it, naming the flag
	}
	v.from = "flag"
	v.store(x)
	return nil
}

func (v *value[T]) Get() any { return *v.p }

func (v *value[T]) setting() (string, bool) { return v.s.Flag, v.s.Secret }

func (v *value[T]) fromEnv() (string, string, bool) {
	switch {
	case v.from == "" || v.from == "flag":
		return "", "", false
	case v.s.Secret && v.from == v.s.FileEnv():
		return v.from, os.Getenv(v.from), true
	case v.s.Secret:
		return v.from, redact.Redact(os.Getenv(v.from)), true
	}
	return v.from, os.Getenv(v.from), true
}

// IsBoolFlag lets a bool setting's flag be given without a value.
func (v *value[T]) IsBoolFlag() bool {
	_, ok := any(*new(T)).(bool)
	return ok
}

// store checks x and stores it; a value that fails the check is kept out.
func (v *value[T]) store(x T) {
	v.err = nil
	if v.s.Check != nil {
		if err := v.s.Check(x); err != nil {
			v.err = err
			return
		}
	}
	if isZero(x) && !isZero(v.s.ZeroAs) {
		x = v.s.ZeroAs
	}
	*v.p = x
}

func (v *value[T]) problems() []*Error {
	env := v.s.Env
	if v.from != "" && (v.from == v.s.OldEnv || v.s.Secret && v.from == v.s.FileEnv()) {
		env = v.from
	}
	return v.s.errors(env, v.err)
}

func (v *value[T]) typeName() string {
	switch any(*new(T)).(type) {
	case string:
		return "string"
	case []string:
		return "list"
	case int:
		return "int"
	case time.Duration:
		return "duration"
	}
	return "" // bool: a flag without a value
}

// shownDefault is the default as -h shows it; "" for none.
func (v *value[T]) shownDefault() string {
	text := v.s.defaultText()
	if _, ok := any(v.s.Default).(string); ok && v.s.DefaultText == "" && text != "" {
		return strconv.Quote(text)
	}
	return text
}

// defaultText is DefaultText, or Default unless it is the zero value.
func (s Setting[T]) defaultText() string {
	if s.DefaultText != "" {
		return s.DefaultText
	}
	if isZero(s.Default) {
		return ""
	}
	return format(s.Default)
}

func isZero[T any](v T) bool { return reflect.ValueOf(&v).Elem().IsZero() }

func parse[T any](text string) (T, error) {
	var v T
	switch p := any(&v).(type) {
	case *string:
		*p = text
	case *[]string:
		*p = splitList(text)
	case *int:
		n, err := strconv.Atoi(strings.TrimSpace(text))
		if err != nil {
			return v, fmt.Errorf("%q is not a whole number", text)
		}
		*p = n
	case *bool:
		b, err := strconv.ParseBool(strings.TrimSpace(text))
		if err != nil {
			return v, fmt.Errorf("%q is not a boolean: use true or false (or 1 or 0)", text)
		}
		*p = b
	case *time.Duration:
		d, err := time.ParseDuration(strings.TrimSpace(text))
		if err != nil {
			return v, fmt.Errorf("%q is not a duration like 500ms or 5s", text)
		}
		*p = d
	default:
		panic(fmt.Sprintf("settings: unsupported type %T", v))
	}
	return v, nil
}

func format[T any](v T) string {
	switch x := any(v).(type) {
	case []string:
		return strings.Join(x, ",")
	case time.Duration:
		return formatDuration(x)
	}
	return fmt.Sprint(v)
}

// formatDuration drops the zero minutes and seconds that time.Duration's
// String adds: 2m rather than 2m0s, 168h rather than 168h0m0s.
func formatDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}

// splitList splits a comma-separated list, dropping blanks around and
// between the commas.
func splitList(s string) []string {
	var out []string
	for _, part := range strings.Split(s, ",") {
		if part = strings.TrimSpace(part); part != "" {
			out = append(out, part)
		}
	}
	return out
}

// PrintDefaults writes the flags of fs the way flag.PrintDefaults does, with
// each bound setting's type and its default shown once, next to its
// environment variable.
func PrintDefaults(fs *flag.FlagSet) {
	fs.VisitAll(func(f *flag.Flag) {
		name, usage := flag.UnquoteUsage(f)
		def := ""
		if s, ok := f.Value.(interface {
			typeName() string
			shownDefault() string
		}); ok {
			name, def = s.typeName(), s.shownDefault()
		} else if !zeroDefault(f) {
			def = f.DefValue
			if name == "string" {
				def = strconv.Quote(def)
			}
		}
		var b strings.Builder
		fmt.Fprintf(&b, "  -%s", f.Name)
		if name != "" {
			b.WriteString(" " + name)
		}
		if b.Len() <= 4 { // a one-letter bool flag: usage on the same line, as flag does
			b.WriteString("\t")
		} else {
			b.WriteString("\n    \t")
		}
		b.WriteString(strings.ReplaceAll(usage, "\n", "\n    \t"))
		if def != "" {
			fmt.Fprintf(&b, " (default %s)", def)
		}
		fmt.Fprintln(fs.Output(), b.String())
	})
}

// zeroDefault reports whether f's default is its type's zero value, which
// the flag package does not print.
func zeroDefault(f *flag.Flag) (zero bool) {
	defer func() {
		if recover() != nil {
			zero = false
		}
	}()
	t := reflect.TypeOf(f.Value)
	var z reflect.Value
	if t.Kind() == reflect.Pointer {
		z = reflect.New(t.Elem())
	} else {
		z = reflect.Zero(t)
	}
	return f.DefValue == z.Interface().(flag.Value).String()
}
