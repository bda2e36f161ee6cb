#!/bin/bash
# One gRPC unary call at a time (ghz -c 1) through flatmesh, nginx grpc_pass and direct, in
# interleaved rounds on a pinned, quiet machine: the proxy on CPU 1, ghz and the grpc-go backend
# on CPU 0, idle vCPUs polling. Steadier than bench/run for this one question (rounds of the
# three systems alternate within seconds). Root; tools from `bench/run --install-only`.
#
#   bench/scripts/grpc_latency_ab.sh [ROUNDS] [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-5}
secs=${2:-6}
work=$(mktemp -d /tmp/flatmesh-grpc-ab.XXXXXX)
. bench/scripts/nginx_conf.sh
cat > "$work/flatmesh.yaml" <<YAML
admin: "127.0.0.1:19000"
workers: 1
listeners:
  - name: grpc
    address: "127.0.0.1:19080"
    protocol: http
    routes:
      - match: { path: { prefix: "/" } }
        cluster: grpc
clusters:
  - name: grpc
    endpoints: ["127.0.0.1:18090"]
    protocol: http2
YAML
nginx_conf "$work" nginx '  upstream grpc { server 127.0.0.1:18090; keepalive 64; keepalive_requests 10000000; }
  server {
    listen 127.0.0.1:19080 http2;
    location ^~ / { grpc_pass grpc://grpc; }
  }'
call() { # PORT SECONDS: prints p50, p90 and calls/s of one ghz run
  taskset -c 0 bench/.bin/ghz --insecure --proto bench/grpc-backend/echo.proto \
    --call bench.Echo.Unary -d '{"payload":"aGVsbG8gZmxhdG1lc2ggYmVuY2ggMDEyMzQ1Njc4OQ=="}' \
    -c 1 --connections 1 -z "$2s" -O json "127.0.0.1:$1" > "$work/ghz.json"
  python3 - "$work/ghz.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
lat = sorted(x["latency"] / 1000 for x in d["details"] if x["status"] == "OK")
print(f"p50 {lat[len(lat)//2]:7.1f} us   p90 {lat[int(len(lat)*.9)]:7.1f} us   {d['rps']:6.0f} calls/s")
PY
}
# Idle vCPUs poll instead of halting while the file stays open (BENCHMARKS.md, "wake-ups").
exec 3> /dev/cpu_dma_latency
printf '\x00\x00\x00\x00' >&3
taskset -c 0 bench/.bin/grpc-backend -addr 127.0.0.1:18090 > "$work/backend.log" 2>&1 &
backend=$!
trap 'kill $backend 2>/dev/null; rm -rf "$work"' EXIT
sleep 0.5
for round in $(seq "$rounds"); do
  for system in flatmesh nginx; do
    if [ "$system" = flatmesh ]; then
      taskset -c 1 target/release/flatmesh node --config "$work/flatmesh.yaml" > "$work/node.log" 2>&1 &
    else
      taskset -c 1 nginx -c "$work/nginx.conf" > "$work/nginx.log" 2>&1 &
    fi
    proxy=$!
    sleep 0.7
    call 19080 1 > /dev/null # warm-up
    printf 'round %s  %-9s' "$round" "$system"; call 19080 "$secs"
    kill $proxy; wait $proxy 2>/dev/null || true; sleep 0.3
  done
  printf 'round %s  %-9s' "$round" direct; call 18090 "$secs"
done
