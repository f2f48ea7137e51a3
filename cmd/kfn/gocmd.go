package main

import (
	"context"
	"io"
	"os"
	"os/exec"
)

// goIn runs the go command in dir, outside any workspace (a generated or
// user module is its own), with its output on stdout and stderr.
func goIn(ctx context.Context, dir string, stdout, stderr io.Writer, args ...string) error {
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOWORK=off")
	cmd.Stdout, cmd.Stderr = stdout, stderr
	return cmd.Run()
}
