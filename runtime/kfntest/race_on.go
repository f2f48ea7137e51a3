//go:build race

package kfntest

// raceEnabled makes BuildBinary build with -race when the tests do.
const raceEnabled = true
