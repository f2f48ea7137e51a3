package main

import (
	"context"
	"fmt"
	"io"

	"github.com/kfn-dev/kfn/internal/buildinfo"
	"github.com/kfn-dev/kfn/internal/schema"
)

// runVersion prints the version of kfn this binary was built from, its
// commit and build time (stamped by a release or image build, else what the
// Go toolchain recorded from the checkout), the Go version and the schema
// version it is built for. kfn --version is the same.
func runVersion(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("version", help{
		usage: []string{"kfn version", "kfn --version"},
		text: `
Prints the kfn version this binary was built from, its commit and build
time (a release or image build stamps them; a go build from a checkout
reports the module version and the commit and its time that Go recorded),
the Go version, and the schema version it is built for (see Upgrades in the
README). A function binary's --version prints the same lines for itself.`,
		examples: "kfn version",
	}, stderr)
	if err := parse(fs, args); err != nil {
		return err
	}
	if _, err := io.WriteString(stdout, buildinfo.Read().Text("kfn")); err != nil {
		return err
	}
	_, err := fmt.Fprintf(stdout, "schema   %d (workers built for schema %d or later run against it)\n", schema.Latest(), schema.OldestCompatible())
	return err
}
