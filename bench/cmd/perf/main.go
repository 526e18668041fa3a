// Command perf runs hybridlimit's comparison benchmarks and writes
// docs/performance.md: the Go benchmarks of package bench (several passes,
// summarized by their medians), redis-benchmark's ceiling for each limiter's
// script, and what each limiter's keys cost in Redis, all against one
// redis-server that it starts on a free loopback port and stops.
//
// Run it from the bench module, on a quiet machine:
//
//	cd bench && go run ./cmd/perf -out ../docs/performance.md
package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/csv"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/bench"
	"github.com/hybridlimit/hybridlimit/bench/internal/redisserver"
	"github.com/hybridlimit/hybridlimit/lua"
	"github.com/hybridlimit/hybridlimit/remote"
)

// config is what the flags set.
type config struct {
	out      string
	raw      string
	count    int
	remoteN  int
	localN   int
	filter   string
	rbN      int
	rbConns  int
	rbRuns   int
	memKeys  int
	skipRB   bool
	skipMem  bool
	command  string // the command line, for the report
	progress io.Writer
}

func main() {
	var cfg config
	flag.StringVar(&cfg.out, "out", "../docs/performance.md", "write the report to this file")
	flag.StringVar(&cfg.raw, "raw", "", "also write the raw go test output to this file, for benchstat")
	flag.IntVar(&cfg.count, "count", 5, "passes of the Go benchmarks (each pass runs every benchmark once)")
	flag.IntVar(&cfg.remoteN, "remote-n", 20000, "decisions per Redis benchmark run (go test -benchtime Nx)")
	flag.IntVar(&cfg.localN, "local-n", 1000000, "decisions per in-memory benchmark run")
	flag.StringVar(&cfg.filter, "bench", "", "run only the Go benchmarks matching this go test -bench pattern (default: all)")
	flag.IntVar(&cfg.rbN, "rb-n", 200000, "requests per redis-benchmark run")
	flag.IntVar(&cfg.rbConns, "rb-c", 64, "redis-benchmark connections")
	flag.IntVar(&cfg.rbRuns, "rb-runs", 3, "redis-benchmark runs of each configuration (the median is kept)")
	flag.IntVar(&cfg.memKeys, "mem-keys", 100000, "keys written per limiter for the memory measurement")
	flag.BoolVar(&cfg.skipRB, "skip-redis-benchmark", false, "do not run redis-benchmark")
	flag.BoolVar(&cfg.skipMem, "skip-memory", false, "do not measure memory")
	flag.Parse()
	cfg.command = "cd bench && go run ./cmd/perf"
	if len(os.Args) > 1 {
		cfg.command += " " + strings.Join(os.Args[1:], " ")
	}
	cfg.progress = os.Stderr
	log.SetFlags(0)
	log.SetPrefix("perf: ")
	if err := run(context.Background(), cfg); err != nil {
		log.Fatal(err)
	}
}

// run measures everything and writes the report.
func run(ctx context.Context, cfg config) error {
	rep := &report{cfg: cfg, started: time.Now().UTC()}
	rep.machine = describeMachine()
	dir, err := moduleDir()
	if err != nil {
		return err
	}
	tmp, err := os.MkdirTemp("", "hybridlimit-perf-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	testBin := filepath.Join(tmp, "bench.test")
	fmt.Fprintln(cfg.progress, "building the benchmarks")
	build := exec.Command("go", "test", "-c", "-o", testBin, ".")
	build.Dir, build.Stdout, build.Stderr = dir, cfg.progress, cfg.progress
	if err := build.Run(); err != nil {
		return fmt.Errorf("go test -c: %w", err)
	}
	if !cfg.skipRB {
		if _, err := exec.LookPath("redis-benchmark"); err != nil {
			return errors.New("redis-benchmark not found: install it with `apt-get install -y redis-tools`")
		}
	}

	srv, err := redisserver.Start()
	if err != nil {
		return err
	}
	defer srv.Close()
	fmt.Fprintf(cfg.progress, "redis-server on %s\n", srv.Addr())

	if rep.raw, err = runBenchmarks(ctx, cfg, testBin, srv.Addr()); err != nil {
		return err
	}
	rep.results = parseBench(rep.raw)
	if cfg.raw != "" {
		if err := os.WriteFile(cfg.raw, []byte(rep.raw), 0o644); err != nil {
			return err
		}
	}
	if !cfg.skipRB {
		if rep.ceilings, err = runCeilings(ctx, cfg, srv); err != nil {
			return err
		}
	}
	if !cfg.skipMem {
		for _, name := range bench.MemoryContenders {
			fmt.Fprintf(cfg.progress, "memory: %s, %d keys\n", name, cfg.memKeys)
			m, err := bench.MeasureMemory(ctx, srv.Addr(), name, cfg.memKeys)
			if err != nil {
				return err
			}
			rep.memory = append(rep.memory, m)
		}
	}
	rep.finished = time.Now().UTC()
	rep.loadAfter = loadAvg()
	md := rep.markdown()
	// The reading of the numbers is written by hand, in analysis.md beside
	// this command's module, and kept after the generated part.
	if notes, err := os.ReadFile("analysis.md"); err == nil {
		md += "\n" + string(notes)
	}
	if err := os.WriteFile(cfg.out, []byte(md), 0o644); err != nil {
		return err
	}
	fmt.Fprintf(cfg.progress, "wrote %s in %v\n", cfg.out, rep.finished.Sub(rep.started).Round(time.Second))
	return nil
}

// moduleDir returns the directory of the bench module, which must be the
// main module (run perf from inside bench/).
func moduleDir() (string, error) {
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Path}} {{.Dir}}").Output()
	if err != nil {
		return "", fmt.Errorf("go list -m: %w (run perf from the bench directory)", err)
	}
	path, dir, _ := strings.Cut(strings.TrimSpace(string(out)), " ")
	if path != "github.com/hybridlimit/hybridlimit/bench" {
		return "", fmt.Errorf("main module is %s: run perf from the bench directory", path)
	}
	return dir, nil
}

// runBenchmarks runs the test binary cfg.count times, each time the Redis
// benchmarks and then the in-memory ones, so that a slow stretch of the
// machine spreads over every contender instead of hitting one.
func runBenchmarks(ctx context.Context, cfg config, bin, addr string) (string, error) {
	var raw bytes.Buffer
	type group struct{ pattern, n string }
	groups := []group{
		{"^BenchmarkRemote$", strconv.Itoa(cfg.remoteN) + "x"},
		{"^BenchmarkLocal$", strconv.Itoa(cfg.localN) + "x"},
	}
	if cfg.filter != "" {
		groups = []group{{cfg.filter, strconv.Itoa(cfg.remoteN) + "x"}}
	}
	for pass := 1; pass <= cfg.count; pass++ {
		for _, g := range groups {
			fmt.Fprintf(cfg.progress, "pass %d of %d: %s, %s\n", pass, cfg.count, g.pattern, g.n)
			cmd := exec.CommandContext(ctx, bin, "-test.run", "^$", "-test.bench", g.pattern,
				"-test.benchtime", g.n, "-test.count", "1", "-test.timeout", "10m")
			cmd.Env = append(os.Environ(), bench.EnvRedis+"="+addr)
			var out bytes.Buffer
			cmd.Stdout = io.MultiWriter(&out, cfg.progress)
			cmd.Stderr = cfg.progress
			if err := cmd.Run(); err != nil {
				return "", fmt.Errorf("benchmarks, pass %d: %w", pass, err)
			}
			raw.Write(out.Bytes())
		}
	}
	return raw.String(), nil
}

// benchstatArgs are the projections the report suggests for benchstat: a
// column per contender, compared with the first.
var benchstatArgs = []string{"-col", "/contender", "-row", "/conc@num /keys"}

// ceiling is one redis-benchmark run of a limiter's script.
type ceiling struct {
	script   string // "hybridlimit" or "redis_rate"
	keys     bench.Pattern
	pipeline int
	args     []string // redis-benchmark's arguments
	rps      float64
	p50, p99 float64 // milliseconds
	srvCPU   float64 // redis-server CPU time per request, nanoseconds (INFO cpu)
	usec     float64 // INFO commandstats usec_per_call of EVALSHA
}

// runCeilings runs redis-benchmark with hybridlimit's and redis_rate's
// scripts, on one key and on 64, unpipelined and 16 deep.
func runCeilings(ctx context.Context, cfg config, srv *redisserver.Server) ([]ceiling, error) {
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer rdb.Close()
	sha, err := rdb.ScriptLoad(ctx, lua.TokenBucket).Result()
	if err != nil {
		return nil, err
	}
	if sha != remote.Hash() {
		return nil, fmt.Errorf("SCRIPT LOAD returned %s, want %s", sha, remote.Hash())
	}
	ourArgs, err := bench.ScriptArgs()
	if err != nil {
		return nil, err
	}
	rrSHA, rrArgs, err := bench.RedisRateSHA(ctx, srv.Addr())
	if err != nil {
		return nil, err
	}
	scripts := []struct {
		name, sha, prefix string
		args              []string
	}{
		{"hybridlimit", sha, "hybridlimit:rb:", ourArgs},
		{"redis_rate", rrSHA, "rate:rb:", rrArgs},
	}
	// Every configuration runs cfg.rbRuns times, the rounds interleaved so
	// that a slow stretch of the machine hits each script alike; the run
	// with the median requests/s is kept.
	var runs [][]ceiling
	for round := 0; round < cfg.rbRuns; round++ {
		i := 0
		for _, s := range scripts {
			for _, p := range bench.Patterns {
				for _, pipeline := range []int{1, 16} {
					c := ceiling{script: s.name, keys: p, pipeline: pipeline}
					c.args = []string{"-h", "127.0.0.1", "-p", strconv.Itoa(srv.Port()),
						"-n", strconv.Itoa(cfg.rbN), "-c", strconv.Itoa(cfg.rbConns)}
					if pipeline > 1 {
						c.args = append(c.args, "-P", strconv.Itoa(pipeline))
					}
					key := s.prefix + "hot"
					if p == bench.Spread {
						c.args = append(c.args, "-r", "64")
						key = s.prefix + "__rand_int__"
					}
					c.args = append(c.args, "--csv", "EVALSHA", s.sha, "1", key)
					c.args = append(c.args, s.args...)
					if err := runCeiling(ctx, cfg, rdb, &c); err != nil {
						return nil, err
					}
					if round == 0 {
						runs = append(runs, nil)
					}
					runs[i] = append(runs[i], c)
					i++
				}
			}
		}
	}
	res := make([]ceiling, len(runs))
	for i, cs := range runs {
		slices.SortFunc(cs, func(a, b ceiling) int { return cmp.Compare(a.rps, b.rps) })
		res[i] = cs[len(cs)/2]
	}
	return res, nil
}

// runCeiling runs redis-benchmark with c.args and fills in c's figures.
func runCeiling(ctx context.Context, cfg config, rdb *redis.Client, c *ceiling) error {
	fmt.Fprintf(cfg.progress, "redis-benchmark %s\n", strings.Join(c.args, " "))
	if err := rdb.ConfigResetStat(ctx).Err(); err != nil {
		return err
	}
	cpu0, err := bench.ServerCPU(ctx, rdb)
	if err != nil {
		return err
	}
	out, err := exec.CommandContext(ctx, "redis-benchmark", c.args...).Output()
	if err != nil {
		return fmt.Errorf("redis-benchmark: %w", err)
	}
	cpu1, err := bench.ServerCPU(ctx, rdb)
	if err != nil {
		return err
	}
	c.srvCPU = float64((cpu1 - cpu0).Nanoseconds()) / float64(cfg.rbN)
	if c.rps, c.p50, c.p99, err = parseCSV(out); err != nil {
		return err
	}
	stats, err := rdb.Info(ctx, "commandstats").Result()
	if err != nil {
		return err
	}
	c.usec, err = usecPerCall(stats, "evalsha")
	return err
}

// parseCSV reads requests per second and the p50 and p99 latencies from
// redis-benchmark --csv output.
func parseCSV(out []byte) (rps, p50, p99 float64, err error) {
	recs, err := csv.NewReader(bytes.NewReader(out)).ReadAll()
	if err != nil {
		return 0, 0, 0, fmt.Errorf("redis-benchmark output: %w", err)
	}
	if len(recs) != 2 {
		return 0, 0, 0, fmt.Errorf("redis-benchmark output: %d rows, want 2:\n%s", len(recs), out)
	}
	col := map[string]int{}
	for i, h := range recs[0] {
		col[h] = i
	}
	get := func(name string) (float64, error) {
		i, ok := col[name]
		if !ok || i >= len(recs[1]) {
			return 0, fmt.Errorf("redis-benchmark output: no %s column", name)
		}
		return strconv.ParseFloat(recs[1][i], 64)
	}
	if rps, err = get("rps"); err != nil {
		return
	}
	if p50, err = get("p50_latency_ms"); err != nil {
		return
	}
	p99, err = get("p99_latency_ms")
	return
}

// usecPerCall returns usec_per_call of cmd from INFO commandstats.
func usecPerCall(stats, cmd string) (float64, error) {
	for _, line := range strings.Split(stats, "\r\n") {
		v, ok := strings.CutPrefix(line, "cmdstat_"+cmd+":")
		if !ok {
			continue
		}
		for _, kv := range strings.Split(v, ",") {
			if n, ok := strings.CutPrefix(kv, "usec_per_call="); ok {
				return strconv.ParseFloat(n, 64)
			}
		}
	}
	return 0, fmt.Errorf("INFO commandstats has no usec_per_call for %s", cmd)
}

// machine describes where the measurements ran.
type machine struct {
	nproc, cpu, goVersion, redisVersion, kernel, loadBefore string
	gomaxprocs                                              int
}

func describeMachine() machine {
	m := machine{
		nproc:        command("nproc"),
		goVersion:    command("go", "version"),
		redisVersion: command("redis-server", "--version"),
		kernel:       command("uname", "-sr"),
		loadBefore:   loadAvg(),
		gomaxprocs:   runtime.GOMAXPROCS(0),
	}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.cpu = strings.TrimSpace(v)
				break
			}
		}
	}
	return m
}

// command returns the trimmed output of a command, or a note that it failed.
func command(name string, args ...string) string {
	out, err := exec.Command(name, args...).Output()
	if err != nil {
		return fmt.Sprintf("(%s: %v)", name, err)
	}
	return strings.TrimSpace(string(out))
}

// loadAvg returns the 1, 5 and 15 minute load averages.
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}
