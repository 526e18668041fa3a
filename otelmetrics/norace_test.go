//go:build !race

package otelmetrics_test

const raceEnabled = false
