package runtime_test

import (
	"bytes"
	"errors"
	"os/exec"
	"strings"
	"testing"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// A function binary speaks the kfn CLI's grammar: -h and --help print the
// usage on stdout and exit 0; a bad flag, a bad value or a stray argument
// is one line on stderr that names it, ending "(see orders -h)", and exit
// 2, before anything connects (no service is given here).
func TestFunctionBinarySpeaksOneGrammar(t *testing.T) {
	orders := kfntest.BuildBinary(t, "github.com/kfn-dev/kfn/functions/orders/cmd/orders")
	for _, tc := range []struct {
		args      []string
		code      int
		firstLine string // of stdout for exit 0, of stderr otherwise
	}{
		{[]string{"-h"}, 0, "Usage of orders (every flag can also be set by the environment variable in brackets):"},
		{[]string{"--help"}, 0, "Usage of orders (every flag can also be set by the environment variable in brackets):"},
		{[]string{"migrate", "-h"}, 0, "Usage: orders migrate --database-url URL"},
		{[]string{"--batch-size", "x"}, 2, `orders: --batch-size "x": "x" is not a whole number (see orders -h)`},
		{[]string{"--batch-wait=soon"}, 2, `orders: --batch-wait "soon": "soon" is not a duration like 500ms or 5s (see orders -h)`},
		{[]string{"--no-relay=maybe"}, 2, `orders: --no-relay "maybe": "maybe" is not a boolean: use true or false (or 1 or 0) (see orders -h)`},
		{[]string{"--batch-size", "0"}, 2, "orders: invalid configuration: --batch-size (KFN_BATCH_SIZE): 0 is out of range 1..10000 (see orders -h)"},
		{[]string{"--log-level", "loud"}, 2, `orders: invalid configuration: --log-level (KFN_LOG_LEVEL): "loud" is not a log level: use debug, info, warn or error (see orders -h)`},
		{[]string{"--no-such-flag"}, 2, "orders: unknown flag --no-such-flag (see orders -h)"},
		{[]string{"stray"}, 2, `orders: unexpected argument "stray": every setting is a --flag (see orders -h)`},
		{[]string{"migrate", "--batch-size", "5"}, 2, "orders migrate: unknown flag --batch-size (see orders migrate -h)"},
	} {
		cmd := exec.Command(orders, tc.args...)
		cmd.Env = []string{"PATH=/usr/bin:/bin"} // no KFN_* variable of the test's
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		code := 0
		if err := cmd.Run(); err != nil {
			var exit *exec.ExitError
			if !errors.As(err, &exit) {
				t.Fatalf("orders %q: %v", tc.args, err)
			}
			code = exit.ExitCode()
		}
		out, quiet := stderr.String(), stdout.String()
		if tc.code == 0 {
			out, quiet = quiet, out
		}
		first, _, _ := strings.Cut(out, "\n")
		if code != tc.code || first != tc.firstLine || quiet != "" {
			t.Errorf("orders %q: exit %d, first line %q, other stream %q; want exit %d and %q, the other stream empty", tc.args, code, first, quiet, tc.code, tc.firstLine)
		}
		if tc.code != 0 && strings.Count(out, "\n") != 1 {
			t.Errorf("orders %q: %d lines on stderr, want one:\n%s", tc.args, strings.Count(out, "\n"), out)
		}
	}
}
