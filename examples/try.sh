#!/usr/bin/env bash
# Starts a throwaway redis-server on a free loopback port (data in a temp
# dir, stopped on exit) and runs cmd/tryit against it: the example service
# under HTTP and gRPC load, with its Redis cut off from second 4 to 8.
# Extra arguments go to tryit (go run ./cmd/tryit -h lists them).
set -euo pipefail
cd "$(dirname "$0")"

if ! command -v redis-server >/dev/null; then
  echo "redis-server not found. Install it: sudo apt-get install redis-server (Debian, Ubuntu), brew install redis (macOS)" >&2
  exit 1
fi

dir=$(mktemp -d)
pid=""
cleanup() {
  if [ -n "$pid" ]; then
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  fi
  rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Build first, so that compiling is not taken for the service's time.
go build -o "$dir/tryit" ./cmd/tryit

# listening PORT: whether something accepts connections on 127.0.0.1:PORT.
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# pong PORT: whether a Redis answers PING there.
pong() (
  exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 1
  printf 'PING\r\n' >&3
  read -r -t 1 reply <&3 || exit 1
  [[ $reply == +PONG* ]]
)

port=""
for _ in $(seq 20); do
  p=$((20000 + RANDOM % 30000))
  listening "$p" && continue
  redis-server --port "$p" --bind 127.0.0.1 --dir "$dir" --save "" --appendonly no \
    --logfile "$dir/redis.log" &
  pid=$!
  for _ in $(seq 50); do
    kill -0 "$pid" 2>/dev/null || break # it could not bind: try another port
    if pong "$p" 2>/dev/null; then
      port=$p
      break 2
    fi
    sleep 0.1
  done
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  pid=""
done
if [ -z "$port" ]; then
  echo "could not start redis-server; its log:" >&2
  cat "$dir/redis.log" >&2 || true
  exit 1
fi

echo "redis-server $(redis-server --version | grep -o 'v=[^ ]*') on 127.0.0.1:$port (pid $pid)"
"$dir/tryit" -redis "127.0.0.1:$port" "$@"
