//go:build race

package hybridlimit

// raceEnabled says that the tests run under the race detector, where
// sync.Pool drops a quarter of what is put back, by design: allocation
// counts of a path that pools then measure the drops.
const raceEnabled = true
