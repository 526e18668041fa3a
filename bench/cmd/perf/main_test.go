package main

import (
	"strings"
	"testing"

	"github.com/hybridlimit/hybridlimit/bench"
)

const sampleBench = `goos: linux
goarch: amd64
pkg: github.com/hybridlimit/hybridlimit/bench
cpu: AMD EPYC
BenchmarkRemote/contender=hybridlimit/conc=64/keys=hot-2    3000   21170 ns/op   900 cpu-ns/op   47238 dec/s   1071260 p50-ns   7209769 p99-ns   1512 B/op   27 allocs/op
BenchmarkRemote/contender=hybridlimit/conc=64/keys=hot-2    3000   21170 ns/op   900 cpu-ns/op   40000 dec/s   1071260 p50-ns   7209769 p99-ns   1512 B/op   27 allocs/op
BenchmarkRemote/contender=hybridlimit/conc=64/keys=hot-2    3000   21170 ns/op   900 cpu-ns/op   50000 dec/s   1071260 p50-ns   7209769 p99-ns   1512 B/op   27 allocs/op
BenchmarkLocal/contender=xrate/conc=1/keys=spread           1000   100 ns/op   90 cpu-ns/op   1e+07 dec/s   80 p50-ns   200 p99-ns   0 B/op   0 allocs/op
PASS
`

func TestParseBench(t *testing.T) {
	res := parseBench(sampleBench)
	id := benchID{contender: "hybridlimit", conc: 64, keys: bench.Hot}
	if got, ok := res.median(id, "dec/s"); !ok || got != 47238 {
		t.Errorf("median(%v, dec/s) = %v, %v; want 47238, true", id, got, ok)
	}
	if got := res.passes(id, "allocs/op"); got != 3 {
		t.Errorf("passes(%v, allocs/op) = %d; want 3", id, got)
	}
	local := benchID{contender: "xrate", conc: 1, keys: bench.Spread}
	if got, ok := res.median(local, "dec/s"); !ok || got != 1e7 {
		t.Errorf("median(%v, dec/s) = %v, %v; want 1e7, true", local, got, ok)
	}
	if _, ok := res.median(benchID{contender: "script", conc: 1, keys: bench.Hot}, "dec/s"); ok {
		t.Errorf("median of a missing benchmark: ok; want not ok")
	}
}

func TestParseCSV(t *testing.T) {
	out := `"test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms"
"EVALSHA 4196 1 rb:__rand_int__ 1000 1 1000000000 1","13071.90","0.430","0.040","0.159","0.311","0.399","102.975"
`
	rps, p50, p99, err := parseCSV([]byte(out))
	if err != nil || rps != 13071.90 || p50 != 0.159 || p99 != 0.399 {
		t.Errorf("parseCSV = %v, %v, %v, %v; want 13071.9, 0.159, 0.399, nil", rps, p50, p99, err)
	}
	if _, _, _, err := parseCSV([]byte("garbage")); err == nil {
		t.Errorf("parseCSV(garbage): nil error")
	}
}

func TestFormat(t *testing.T) {
	for _, tc := range []struct {
		got, want string
	}{
		{thousands(41129.4), "41,129"},
		{thousands(999), "999"},
		{thousands(1234567), "1,234,567"},
		{dur(812), "812 ns"},
		{dur(71777), "71.8 µs"},
		{dur(4615900), "4.62 ms"},
		{dur(212680771), "213 ms"},
	} {
		if tc.got != tc.want {
			t.Errorf("got %q; want %q", tc.got, tc.want)
		}
	}
}

// TestMarkdown renders a report from the sample: every section is there
// and the targets that lack data say n/a rather than failing.
func TestMarkdown(t *testing.T) {
	rep := &report{cfg: config{count: 3, command: "cd bench && go run ./cmd/perf"}, raw: sampleBench,
		results:  parseBench(sampleBench),
		ceilings: []ceiling{{script: "hybridlimit", keys: bench.Hot, pipeline: 16, rps: 50000}},
		memory: []bench.Memory{
			{Contender: "hybridlimit", Keys: 10, Delta: 1000, Usage: 80, Encoding: "embstr", Value: "1 2 3"},
			{Contender: "redis_rate", Keys: 10, Delta: 900, Usage: 72, Encoding: "embstr", Value: "1.5"},
		}}
	md := rep.markdown()
	for _, want := range []string{
		"## How to rerun", "## Targets", "47,238 dec/s vs 50,000 requests/s", "0.94", "**MISS**",
		"| 64 | hot | 47,238 |", "## Memory per key", "## Raw output, first pass", "n/a",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("markdown lacks %q:\n%s", want, md)
		}
	}
}

// TestPrintable: a binary value is shown escaped, a text one as it is.
func TestPrintable(t *testing.T) {
	for in, want := range map[string]string{
		"312785568.62374401": "312785568.62374401",
		"\x01\x00\xd4nS":     `"\x01\x00\xd4nS"`,
		"a|b":                `"a\x7cb"`,
		"\x06aw\xdf\xbb":     `"\x06aw\xdf\xbb"`,
	} {
		if got := printable(in); got != want {
			t.Errorf("printable(%q) = %s; want %s", in, got, want)
		}
	}
}
