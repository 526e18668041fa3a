//go:build !race

package hybridlimit

// raceEnabled says that the tests run under the race detector (race_test.go).
const raceEnabled = false
