// Package docscheck owns the tests that keep kfn's user docs honest:
// README.md and every page under docs/ except docs/reference/, which
// go generate writes from the code.
//
// Every shell block (a fence tagged sh, bash, shell, zsh or console, or an
// untagged fence with a line that starts with "$ ") must have, on the line
// right before its opening fence, one of two markers:
//
//	<!-- run by: TestName -->          a Go test in this repository runs these commands
//	<!-- run by: .ci/run -->           CI's script runs them: each command line of the block is in that file
//	<!-- not run: the reason -->       nothing runs them, and why (a real cluster, a cloud account, …)
//
// "run by" may name several runners, separated by commas. A test name must
// be a func TestName( in a *_test.go file of the repository. Every relative
// link in those pages must name a file that exists, and a link to a heading
// (page.md#anchor) a heading of that page.
package docscheck
