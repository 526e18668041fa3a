package main

import (
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/hybridlimit/hybridlimit/bench"
)

// benchID names one benchmark of the grid.
type benchID struct {
	contender string
	conc      int
	keys      bench.Pattern
}

// results holds every value measured, by benchmark and unit, one per pass.
type results map[benchID]map[string][]float64

var benchLine = regexp.MustCompile(`^Benchmark(?:Remote|Local)/contender=([^/\s]+)/conc=(\d+)/keys=([a-z]+)(?:-\d+)?\s+(\d+)\s+(.*)$`)

// parseBench reads go test -bench output.
func parseBench(raw string) results {
	res := results{}
	for _, line := range strings.Split(raw, "\n") {
		m := benchLine.FindStringSubmatch(strings.TrimSpace(line))
		if m == nil {
			continue
		}
		conc, _ := strconv.Atoi(m[2])
		id := benchID{contender: m[1], conc: conc, keys: bench.Pattern(m[3])}
		if res[id] == nil {
			res[id] = map[string][]float64{}
		}
		f := strings.Fields(m[5])
		for i := 0; i+1 < len(f); i += 2 {
			v, err := strconv.ParseFloat(f[i], 64)
			if err != nil {
				continue
			}
			res[id][f[i+1]] = append(res[id][f[i+1]], v)
		}
	}
	return res
}

// median returns the median of id's values in unit; ok is false if there
// are none.
func (r results) median(id benchID, unit string) (v float64, ok bool) {
	vals := slices.Clone(r[id][unit])
	if len(vals) == 0 {
		return 0, false
	}
	slices.Sort(vals)
	n := len(vals)
	if n%2 == 1 {
		return vals[n/2], true
	}
	return (vals[n/2-1] + vals[n/2]) / 2, true
}

// passes returns how many values id has in unit.
func (r results) passes(id benchID, unit string) int { return len(r[id][unit]) }
