//go:build !race

package kfntest

const raceEnabled = false
