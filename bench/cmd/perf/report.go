package main

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/hybridlimit/hybridlimit/bench"
)

// report is everything one run of perf measured.
type report struct {
	cfg               config
	started, finished time.Time
	machine           machine
	loadAfter         string
	raw               string
	results           results
	ceilings          []ceiling
	memory            []bench.Memory
}

// markdown renders the report as docs/performance.md.
func (rep *report) markdown() string {
	var b strings.Builder
	w := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	m := rep.machine

	w("# Performance\n\n")
	w("hybridlimit's remote decisions beside other Redis rate limiters and the floors they share,\n")
	w("measured by [`bench/cmd/perf`](../bench/cmd/perf/main.go). This file is generated: rerun the\n")
	w("command rather than editing it.\n\n")

	w("## How to rerun\n\n")
	w("```\ncd bench && go run ./cmd/perf -out ../docs/performance.md\n```\n\n")
	w("[bench/README.md](../bench/README.md) says what it measures. It needs `redis-server` and\n")
	w("`redis-benchmark` (Debian: `apt-get install -y redis-server redis-tools`), starts its own\n")
	w("redis-server on a free loopback port, and takes about five minutes. Run it on a\n")
	w("quiet machine: the clients and redis-server share the CPU, so anything else running skews the\n")
	w("comparison. Flags: `-count` passes of the Go benchmarks (5), `-remote-n` decisions per Redis\n")
	w("benchmark (20000), `-local-n` per in-memory benchmark (1000000), `-rb-n` requests per\n")
	w("redis-benchmark run (200000), `-rb-runs` runs of each (3, the median kept), `-mem-keys`\n")
	w("(100000), `-bench PATTERN` to run only some Go\n")
	w("benchmarks, `-raw FILE` to keep the raw `go test` output (compare two runs with\n")
	w("`go tool benchstat old.txt new.txt` inside `bench/`), `-skip-redis-benchmark`, `-skip-memory`.\n")
	w("A smoke run that checks the harness in seconds:\n\n")
	w("```\ncd bench && go run ./cmd/perf -count 1 -remote-n 500 -local-n 10000 -rb-n 5000 -rb-runs 1 -mem-keys 1000 -out /tmp/perf.md\n```\n\n")
	w("One benchmark by hand (it starts its own redis-server):\n\n")
	w("```\ncd bench && go test -run '^$' -bench 'BenchmarkRemote/contender=hybridlimit/conc=64/keys=hot' -benchtime 20000x -count 5\n```\n\n")

	w("## This run\n\n")
	w("- Command: `%s`\n", rep.cfg.command)
	w("- Date: %s to %s UTC (%v)\n", rep.started.Format("2006-01-02 15:04:05"),
		rep.finished.Format("15:04:05"), rep.finished.Sub(rep.started).Round(time.Second))
	w("- Machine: `nproc` %s, %s, GOMAXPROCS %d, %s\n", m.nproc, m.cpu, m.gomaxprocs, m.kernel)
	w("- `%s`; `%s`\n", m.goVersion, m.redisVersion)
	w("- Load average (1, 5, 15 min) before: %s; after: %s\n", m.loadBefore, rep.loadAfter)
	if busy(m.loadBefore, m.nproc) || busy(rep.loadAfter, m.nproc) {
		w("\n**The machine was busy during this run (load average above half its CPUs): treat the\nnumbers as noisy.**\n")
	}
	w("\nOne redis-server on loopback, no persistence. Each contender has its own go-redis v9 client\n")
	w("with default options (a pool of 10 connections per GOMAXPROCS). Every figure below is the\n")
	w("median of %d passes; a pass runs the whole grid once, so a slow stretch of the machine hits\n", rep.cfg.count)
	w("every contender rather than one.\n\n")

	w("## Targets\n\n")
	w("| target | measured | ratio | want | result |\n| --- | --- | --- | --- | --- |\n")
	for _, t := range rep.targets() {
		w("| %s | %s | %s | %s | %s |\n", t.name, t.measured, t.ratio, t.want, t.result)
	}
	w("\n")

	w("## What is compared\n\n")
	w("Every contender gets the same limit, a million per second with a burst of a billion: every\n")
	w("decision is allowed, and every one is recorded in Redis (`TestContendersWrite` checks that\n")
	w("each decision changes the key). Not a higher rate: at a billion per second, redis_rate's\n")
	w("increment of 1 ns is below the resolution of its floating-point time (about 60 ns for seconds\n")
	w("since 2017), so its script never writes its key and never limits, and measures a read.\n\n")
	w("- **hybridlimit**: `Limiter.Allow` with `Limit{Rate: 1e6, Burst: 1e9}`, `Timeout` 1 s,\n")
	w("  `Heartbeat` -1 (no heartbeat traffic), the rest default. A decision not made by Redis\n")
	w("  (`Mode` other than `ModeRemote`) fails the run.\n")
	w("- **hybridlimit-lease**: hybridlimit with `Lease: %d` (lease mode, off by default): a script\n", bench.LeaseTokens)
	w("  call takes up to %d tokens more, which the next decisions on the key spend without Redis\n", bench.LeaseTokens)
	w("  (`ModeLease`). For keys hotter than one Redis core can serve; its cost in accuracy is in\n")
	w("  docs/guide.md, \"Hot keys\".\n")
	w("- **script**: go-redis `Script.Run` (EVALSHA, EVAL on NOSCRIPT) of hybridlimit's own\n")
	w("  `lua/tokenbucket.lua`, with the arguments hybridlimit sends (q, p, capacity and cost from\n")
	w("  `remote.NewLimit`) built once per key: the floor for one round trip per decision.\n")
	w("- **redis_rate**: `github.com/go-redis/redis_rate/v10` `Allow` with `Limit{Rate: 1e6, Burst: 1e9,\n")
	w("  Period: time.Second}`: GCRA, one EVALSHA per decision.\n")
	w("- **ulule**: `github.com/ulule/limiter/v3` with its Redis store, 1e6 per second: a fixed-window\n")
	w("  counter, one EVALSHA per decision.\n")
	w("- **xrate**: `golang.org/x/time/rate` alone, one `Limiter` per key found before timing: the floor\n")
	w("  of a decision in memory. hybridlimit's own local path is benchmarked against it in the root\n")
	w("  package (`bench_test.go`).\n\n")
	w("Key patterns: **hot**, every goroutine on one key; **spread**, one key per goroutine. Exactly\n")
	w("1, 16, 64 or 256 goroutines whatever GOMAXPROCS or `-cpu` say (a runner of its own rather than\n")
	w("`b.RunParallel`), sharing the N decisions equally and recording every latency in a slice made\n")
	w("before the timer starts. dec/s is N over wall time; p50 and p99 are over all N latencies;\n")
	w("allocations and bytes per decision come from `testing`'s ReportAllocs (the whole process,\n")
	w("background goroutines included); client CPU is the process's user and system time over N\n")
	w("(redis-server not included).\n\n")

	remoteNames, localNames := names(true), names(false)
	all := append(append([]string{}, remoteNames...), localNames...)
	w("## Decisions per second\n\n")
	rep.grid(w, all, func(id benchID) string {
		v, ok := rep.results.median(id, "dec/s")
		if !ok {
			return ""
		}
		return thousands(v)
	})
	w("## Latency of one decision, p50 / p99\n\n")
	rep.grid(w, all, func(id benchID) string {
		p50, ok1 := rep.results.median(id, "p50-ns")
		p99, ok2 := rep.results.median(id, "p99-ns")
		if !ok1 || !ok2 {
			return ""
		}
		return dur(p50) + " / " + dur(p99)
	})
	w("## Allocations per decision (bytes)\n\n")
	rep.grid(w, all, func(id benchID) string {
		a, ok1 := rep.results.median(id, "allocs/op")
		by, ok2 := rep.results.median(id, "B/op")
		if !ok1 || !ok2 {
			return ""
		}
		return fmt.Sprintf("%.0f (%.0f B)", a, by)
	})
	w("## redis-server CPU per decision\n\n")
	w("redis-server's user and system CPU time (INFO cpu) per decision: what a decision costs the\n")
	w("server, which bounds how many decisions one Redis can make.\n\n")
	rep.grid(w, remoteNames, func(id benchID) string {
		v, ok := rep.results.median(id, "srv-ns/op")
		if !ok {
			return ""
		}
		return dur(v)
	})
	w("## Client CPU per decision\n\n")
	w("User and system CPU time of the benchmark process per decision: what the client side costs,\n")
	w("whatever the wall-clock numbers say about a shared machine.\n\n")
	rep.grid(w, all, func(id benchID) string {
		v, ok := rep.results.median(id, "cpu-ns/op")
		if !ok {
			return ""
		}
		return dur(v)
	})

	w("## Goroutines started per decision\n\n")
	w("From the runtime's count of goroutines created. hybridlimit's Pipe starts one for each\n")
	w("pipelined batch, so this is about one over its mean batch size; a decision sent alone on a\n")
	w("default client goes to a sender goroutine that the Pipe keeps parked between them.\n\n")
	rep.grid(w, remoteNames, func(id benchID) string {
		v, ok := rep.results.median(id, "goroutines/op")
		if !ok {
			return ""
		}
		return fmt.Sprintf("%.3g", v)
	})

	if len(rep.ceilings) > 0 {
		w("## redis-benchmark: the server's ceiling for each script\n\n")
		w("`redis-benchmark -n %d -c %d` running EVALSHA of the script directly, after loading it; spread\n", rep.cfg.rbN, rep.cfg.rbConns)
		w("means 64 keys (`-r 64`). No Go client involved: this is what redis-server itself does with\n")
		w("each script on this machine, unpipelined and 16 commands deep. Each row is the run with the\n")
		w("median requests/s of %d, the runs of all rows interleaved.\n\n", rep.cfg.rbRuns)
		w("Server CPU is redis-server's user and system time (INFO cpu) per request; µs per call is\n")
		w("INFO commandstats' `usec_per_call` of EVALSHA (wall time inside the script call).\n\n")
		w("| script | keys | pipeline | requests/s | p50 | p99 | server CPU per request | µs per call |\n")
		w("| --- | --- | --- | --- | --- | --- | --- | --- |\n")
		for _, c := range rep.ceilings {
			w("| %s | %s | %d | %s | %.3f ms | %.3f ms | %s | %.2f |\n", c.script, c.keys, c.pipeline,
				thousands(c.rps), c.p50, c.p99, dur(c.srvCPU), c.usec)
		}
		w("\n```\n")
		for _, c := range rep.ceilings {
			w("redis-benchmark %s\n", strings.Join(c.args, " "))
		}
		w("```\n\n")
	}

	if len(rep.memory) > 0 {
		w("## Memory per key\n\n")
		w("Each limiter decides once on each of %d keys named `rate:mem:<i>` (hybridlimit with\n", rep.memory[0].Keys)
		w("`Prefix: \"rate:\"`, so that the names are redis_rate's), with a limit of %s. The\n", bench.MemoryLimitText)
		w("growth is INFO's `used_memory` after less before, with no other client connected; it\n")
		w("includes the keyspace and expires tables. MEMORY USAGE is of `rate:mem:0`, `SAMPLES 0`.\n\n")
		w("| limiter | value of `rate:mem:0` | encoding | MEMORY USAGE | used_memory growth per key | TTL |\n")
		w("| --- | --- | --- | --- | --- | --- |\n")
		for _, mem := range rep.memory {
			w("| %s | `%s` (%d bytes) | %s | %d B | %.1f B | %.0f s |\n", mem.Contender, printable(mem.Value), len(mem.Value),
				mem.Encoding, mem.Usage, mem.PerKey(), mem.TTL)
		}
		w("\n")
	}

	w("## Raw output, first pass\n\n")
	w("hybridlimit's and redis_rate's `go test` lines at 1, 64 and 256 goroutines, as the first of\n")
	w("the %d passes printed them. `-raw FILE` keeps every pass, and\n", rep.cfg.count)
	w("`go tool benchstat -filter .name:Remote %s FILE` compares them with confidence intervals.\n\n",
		strings.Join(quote(benchstatArgs), " "))
	w("```\n%s```\n", excerpt(rep.raw))
	return b.String()
}

// excerpt returns the first line of each of hybridlimit's and redis_rate's
// remote benchmarks at 1, 64 and 256 goroutines: one screen of the raw
// output, where the whole of it would take pages.
func excerpt(raw string) string {
	var b strings.Builder
	seen := map[string]bool{}
	for _, line := range strings.Split(raw, "\n") {
		name, _, _ := strings.Cut(line, "\t")
		name = strings.TrimSpace(name)
		if seen[name] {
			continue
		}
		for _, c := range []string{"hybridlimit", "hybridlimit-ctx", "redis_rate"} {
			for _, conc := range []string{"1", "64", "256"} {
				if strings.HasPrefix(name, "BenchmarkRemote/contender="+c+"/conc="+conc+"/") {
					seen[name] = true
					b.WriteString(line + "\n")
				}
			}
		}
	}
	return b.String()
}

// quote quotes the arguments that hold spaces, for a shell.
// printable returns v as it is if it is printable ASCII, else quoted with
// every other byte as \xNN (hybridlimit's bucket is 22 binary bytes).
func printable(v string) string {
	plain := func(c byte) bool { return c >= 0x20 && c <= 0x7e && c != '`' && c != '|' && c != '"' && c != '\\' }
	quote := false
	for i := 0; i < len(v); i++ {
		quote = quote || !plain(v[i])
	}
	if !quote {
		return v
	}
	var b strings.Builder
	b.WriteByte('"')
	for i := 0; i < len(v); i++ {
		if plain(v[i]) {
			b.WriteByte(v[i])
		} else {
			fmt.Fprintf(&b, "\\x%02x", v[i])
		}
	}
	b.WriteByte('"')
	return b.String()
}

func quote(args []string) []string {
	q := make([]string, len(args))
	for i, a := range args {
		q[i] = a
		if strings.ContainsAny(a, " ()") {
			q[i] = "'" + a + "'"
		}
	}
	return q
}

// names returns the contenders, remote or local, in report order.
func names(remote bool) []string {
	var s []string
	for _, c := range bench.Contenders {
		if c.Remote == remote {
			s = append(s, c.Name)
		}
	}
	return s
}

// grid writes a table with a row per concurrency and key pattern and a
// column per contender.
func (rep *report) grid(w func(string, ...any), contenders []string, cell func(benchID) string) {
	w("| goroutines | keys |")
	for _, c := range contenders {
		w(" %s |", c)
	}
	w("\n| --- | --- |")
	for range contenders {
		w(" --- |")
	}
	w("\n")
	for _, conc := range bench.Concurrencies {
		for _, p := range bench.Patterns {
			w("| %d | %s |", conc, p)
			for _, c := range contenders {
				w(" %s |", cell(benchID{contender: c, conc: conc, keys: p}))
			}
			w("\n")
		}
	}
	w("\n")
}

// target is one row of the targets table.
type target struct {
	name, measured, ratio, want, result string
}

// targets computes the targets from the medians.
func (rep *report) targets() []target {
	var ts []target
	med := func(c string, conc int, p bench.Pattern, unit string) (float64, bool) {
		return rep.results.median(benchID{contender: c, conc: conc, keys: p}, unit)
	}
	na := func(name, want string) target { return target{name, "n/a", "n/a", want, "n/a"} }
	judge := func(ok bool) string {
		if ok {
			return "PASS"
		}
		return "**MISS**"
	}

	for _, c := range []string{"hybridlimit", "hybridlimit-ctx"} {
		for _, p := range bench.Patterns {
			name := fmt.Sprintf("1 goroutine: %s ≥ 1.0 × redis_rate decisions/s, %s", c, p)
			h, ok1 := med(c, 1, p, "dec/s")
			r, ok2 := med("redis_rate", 1, p, "dec/s")
			if !ok1 || !ok2 {
				ts = append(ts, na(name, "≥ 1.00"))
			} else {
				ts = append(ts, target{name, thousands(h) + " vs " + thousands(r) + " dec/s",
					fmt.Sprintf("%.2f", h/r), "≥ 1.00", judge(h/r >= 1)})
			}
			name = fmt.Sprintf("1 goroutine: %s p50 within 5 µs of redis_rate's, %s", c, p)
			h, ok1 = med(c, 1, p, "p50-ns")
			r, ok2 = med("redis_rate", 1, p, "p50-ns")
			if !ok1 || !ok2 {
				ts = append(ts, na(name, "≤ +5 µs"))
			} else {
				d := h - r
				ts = append(ts, target{name, dur(h) + " vs " + dur(r), signedDur(d), "≤ +5 µs", judge(d <= 5000)})
			}
		}
	}
	for _, conc := range []int{64, 256} {
		want := map[int]float64{64: 2.2, 256: 2.5}[conc]
		for _, p := range bench.Patterns {
			name := fmt.Sprintf("hybridlimit ≥ %.1f × redis_rate decisions/s, %d goroutines, %s", want, conc, p)
			h, ok1 := med("hybridlimit", conc, p, "dec/s")
			r, ok2 := med("redis_rate", conc, p, "dec/s")
			if !ok1 || !ok2 {
				ts = append(ts, na(name, fmt.Sprintf("≥ %.2f", want)))
				continue
			}
			ts = append(ts, target{name, thousands(h) + " vs " + thousands(r) + " dec/s",
				fmt.Sprintf("%.2f", h/r), fmt.Sprintf("≥ %.2f", want), judge(h/r >= want)})
		}
	}
	for _, conc := range []int{64, 256} {
		for _, p := range bench.Patterns {
			name := fmt.Sprintf("hybridlimit ≥ 90%% of its script's -P 16 ceiling, %d goroutines, %s", conc, p)
			h, ok1 := med("hybridlimit", conc, p, "dec/s")
			c, ok2 := rep.ceiling("hybridlimit", p, 16)
			if !ok1 || !ok2 {
				ts = append(ts, na(name, "≥ 0.90"))
				continue
			}
			ts = append(ts, target{name, thousands(h) + " dec/s vs " + thousands(c) + " requests/s",
				fmt.Sprintf("%.2f", h/c), "≥ 0.90", judge(h/c >= 0.9)})
		}
	}
	for _, c := range []string{"hybridlimit", "hybridlimit-ctx"} {
		for _, p := range bench.Patterns {
			name := fmt.Sprintf("1 goroutine: %s p50 latency within 5%% of bare Script.Run, %s", c, p)
			h, ok1 := med(c, 1, p, "p50-ns")
			s, ok2 := med("script", 1, p, "p50-ns")
			if !ok1 || !ok2 {
				ts = append(ts, na(name, "≤ 1.05"))
			} else {
				ts = append(ts, target{name, dur(h) + " vs " + dur(s), fmt.Sprintf("%.2f", h/s), "≤ 1.05", judge(h/s <= 1.05)})
			}
			name = fmt.Sprintf("1 goroutine: %s mean latency beside bare Script.Run, %s", c, p)
			h, ok1 = med(c, 1, p, "ns/op")
			s, ok2 = med("script", 1, p, "ns/op")
			if ok1 && ok2 {
				ts = append(ts, target{name, dur(h) + " vs " + dur(s), fmt.Sprintf("%.2f", h/s), "(for information)", ""})
			}
		}
	}
	worst, worstAt, have := math.Inf(-1), "", false
	for _, conc := range bench.Concurrencies {
		for _, p := range bench.Patterns {
			h, ok1 := med("hybridlimit", conc, p, "allocs/op")
			s, ok2 := med("script", conc, p, "allocs/op")
			if !ok1 || !ok2 {
				continue
			}
			have = true
			if conc == 1 {
				name := fmt.Sprintf("hybridlimit ≤ 2 allocations per decision over bare Script.Run, 1 goroutine, %s", p)
				ts = append(ts, target{name, fmt.Sprintf("%.0f vs %.0f", h, s), fmt.Sprintf("+%.0f", h-s), "≤ +2", judge(h-s <= 2)})
			}
			if h-s > worst {
				worst, worstAt = h-s, fmt.Sprintf("%.0f vs %.0f at %d goroutines, %s", h, s, conc, p)
			}
		}
	}
	if have {
		ts = append(ts, target{"hybridlimit ≤ 2 allocations per decision over bare Script.Run, worst of the grid",
			worstAt, fmt.Sprintf("+%.0f", worst), "≤ +2", judge(worst <= 2)})
	}
	for _, p := range bench.Patterns {
		name := fmt.Sprintf("hybridlimit's script -P 16 ceiling ≥ redis_rate's, %s", p)
		h, ok1 := rep.ceiling("hybridlimit", p, 16)
		r, ok2 := rep.ceiling("redis_rate", p, 16)
		if !ok1 || !ok2 {
			ts = append(ts, na(name, "≥ 1.00"))
			continue
		}
		ts = append(ts, target{name, thousands(h) + " vs " + thousands(r) + " requests/s",
			fmt.Sprintf("%.2f", h/r), "≥ 1.00", judge(h/r >= 1)})
	}
	// Hot keys: where the default path stops, beside lease mode and the
	// script's own ceiling on one key.
	if h, ok1 := med("hybridlimit", 256, bench.Hot, "dec/s"); ok1 {
		if c, ok2 := rep.ceiling("hybridlimit", bench.Hot, 16); ok2 {
			ts = append(ts, target{"hot key, 256 goroutines: default path beside the script's -P 16 ceiling on one key",
				thousands(h) + " dec/s vs " + thousands(c) + " requests/s", fmt.Sprintf("%.2f", h/c), "(for information)", ""})
		}
		if l, ok2 := med("hybridlimit-lease", 256, bench.Hot, "dec/s"); ok2 {
			ts = append(ts, target{fmt.Sprintf("hot key, 256 goroutines: lease mode (Lease %d) beside the default path", bench.LeaseTokens),
				thousands(l) + " vs " + thousands(h) + " dec/s", fmt.Sprintf("%.1f", l/h), "(for information)", ""})
		}
	}
	var hm, rm *bench.Memory
	for i := range rep.memory {
		switch rep.memory[i].Contender {
		case "hybridlimit":
			hm = &rep.memory[i]
		case "redis_rate":
			rm = &rep.memory[i]
		}
	}
	if hm == nil || rm == nil {
		ts = append(ts, na("hybridlimit's bytes per key ≤ redis_rate's", "≤ 1.00"))
	} else {
		ts = append(ts, target{"hybridlimit's bytes per key ≤ redis_rate's (MEMORY USAGE)",
			fmt.Sprintf("%d vs %d B", hm.Usage, rm.Usage), fmt.Sprintf("%.2f", float64(hm.Usage)/float64(rm.Usage)),
			"≤ 1.00", judge(hm.Usage <= rm.Usage)})
		// Judged per whole byte: a key's allocations are whole bytes, and
		// a difference of a fraction of a byte per key is a few hundred
		// bytes of the server's own, over the whole run.
		ts = append(ts, target{"hybridlimit's bytes per key ≤ redis_rate's (used_memory growth, whole bytes)",
			fmt.Sprintf("%.1f vs %.1f B (%d vs %d B in all)", hm.PerKey(), rm.PerKey(), hm.Delta, rm.Delta),
			fmt.Sprintf("%.2f", hm.PerKey()/rm.PerKey()),
			"≤ 1.00", judge(math.Round(hm.PerKey()) <= math.Round(rm.PerKey()))})
	}
	return ts
}

// ceiling returns redis-benchmark's requests per second for script.
func (rep *report) ceiling(script string, p bench.Pattern, pipeline int) (float64, bool) {
	for _, c := range rep.ceilings {
		if c.script == script && c.keys == p && c.pipeline == pipeline {
			return c.rps, true
		}
	}
	return 0, false
}

// busy reports whether the 1-minute load average exceeds half the CPUs.
func busy(load, nproc string) bool {
	f := strings.Fields(load)
	n, err := strconv.Atoi(nproc)
	if len(f) == 0 || err != nil {
		return false
	}
	l, err := strconv.ParseFloat(f[0], 64)
	return err == nil && l > float64(n)/2
}

// thousands formats v rounded to an integer, with commas: 41,129.
func thousands(v float64) string {
	s := strconv.FormatInt(int64(math.Round(v)), 10)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	for i, r := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(r)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}

// signedDur is dur with a sign: +3.1 µs, -812 ns.
func signedDur(ns float64) string {
	if ns < 0 {
		return "-" + dur(-ns)
	}
	return "+" + dur(ns)
}

// dur formats nanoseconds with three significant digits: 812 ns, 71.8 µs,
// 4.62 ms.
func dur(ns float64) string {
	unit, div := "ns", 1.0
	switch {
	case ns >= 1e9:
		unit, div = "s", 1e9
	case ns >= 1e6:
		unit, div = "ms", 1e6
	case ns >= 1e3:
		unit, div = "µs", 1e3
	}
	v := ns / div
	switch {
	case v >= 100 || unit == "ns":
		return fmt.Sprintf("%.0f %s", v, unit)
	case v >= 10:
		return fmt.Sprintf("%.1f %s", v, unit)
	}
	return fmt.Sprintf("%.2f %s", v, unit)
}
