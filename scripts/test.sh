#!/usr/bin/env bash
# Runs hybridlimit's whole test suite with the race detector, as CI does.
# The real-Redis tests start their own redis-server processes on free
# loopback ports; this script installs Debian's redis-server (which brings
# redis-cli) when it is missing. Extra arguments go to `go test`.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
  echo "redis-server not found: installing Debian's redis-server" >&2
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi
# Debian starts a redis-server service on 6379 after installing; the tests
# never use it (they start their own), so leave it alone.
redis-server --version

go vet ./...
# -p 1: one package at a time. Several packages measure per-second counts
# and latencies against real servers under a 50 ms budget; run side by
# side on two cores under the race detector, one package's load made the
# other's healthy Redis look slow (the demo's first second went local).
start=$SECONDS
# Build every package's tests first, two at a time: -p counts builds as
# well as test binaries, so under -p 1 a fresh clone compiled them one
# after another (92 s, against 53 s two at a time). Build errors show in
# the run below.
go test -race -count=1 "$@" -run '^$' ./... > /dev/null 2>&1 || true
# -parallel 5: the root package's tests on real servers that mostly wait
# (the `parallel` helper of faults_test.go) run five at a time; their load
# is a few hundred decisions a second each, a quarter of a core for all of
# them, and one after another they took a minute of the suite.
go test -race -count=1 -p 1 -parallel 5 -timeout 15m "$@" ./...
echo "== the suite took $((SECONDS - start)) s"

# Allocation counts, without the race detector: under it sync.Pool drops a
# quarter of what is put back, so the tests that count a pooled path's
# allocations skip there (TestRemotePathAllocs).
start=$SECONDS
go test -count=1 "$@" -run 'Allocs$' .
echo "== the allocation tests without -race took $((SECONDS - start)) s, build included"

# The simulator's long run: 2,000 seeds, each a fleet under faults drawn
# from it, at virtual time (the suite above runs the first 100). A failing
# seed prints the command that replays it. The extra arguments go before
# -run, so that a -run of the caller's does not replace this one, and after
# the rest, so that a -timeout or -sim.seeds of the caller's does.
start=$SECONDS
go test -race -count=1 -sim.seeds 2000 -timeout 15m "$@" -run 'TestSim$' .
echo "== the simulator's 2,000 seeds took $((SECONDS - start)) s, build included"

# Modules nested in the repository (extras whose dependencies stay out of
# the library's go.mod) are tested the same way.
for mod in $(git ls-files '*/go.mod' 2>/dev/null || find . -mindepth 2 -name go.mod); do
  dir=$(dirname "$mod")
  echo "== $dir"
  (cd "$dir" && go vet ./... && go test -race -count=1 -timeout 15m "$@" ./...)
done
