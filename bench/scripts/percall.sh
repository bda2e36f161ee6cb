#!/bin/bash
# Where a proxy's time goes per request (issue 19): flatmesh's user tier against nginx and
# HAProxy (one thread each), same
# work per request, the proxy alone on CPU 1 and the load generator and backends on CPU 0, idle
# vCPUs polling. For each system it prints, per request: CPU in user space and in the kernel
# (from /proc/PID/stat), system calls (perf's raw_syscalls:sys_enter), context switches, and
# the latency. With PROFILE=1 it also samples flatmesh (`perf record --call-graph fp`) and
# splits its CPU by the task the sample ran in (the h2 server connection, the stream's L7
# task, the h2 client connection and a streaming call's request body task; the HTTP/1
# connection task; PROFILE_TASK=<name> lists the functions inside one of them), user space and
# kernel apart. Call stacks need frame pointers: build with
#   RUSTFLAGS="-C force-frame-pointers=yes" cargo build --release -p flatmesh --target-dir /tmp/fp
# and pass FLATMESH_BIN=/tmp/fp/release/flatmesh. Root; tools from `bench/run --install-only`.
#
#   bench/scripts/percall.sh grpc [CALLS]     one gRPC unary call at a time (ghz -c 1)
#   bench/scripts/percall.sh http1 [SECONDS]  HTTP/1.1 keep-alive, 32 connections (wrk)
#   bench/scripts/percall.sh http2 [SECONDS]  h2c, 16 connections x 10 streams (h2load), the
#                                             same routes and HTTP/1.1 backends; the last
#                                             column is h2load's mean, not a p50
#   SYSTEMS="flatmesh nginx" ...               only these systems (default: flatmesh nginx haproxy)
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-grpc}
flatmesh=${FLATMESH_BIN:-target/release/flatmesh}
work=$(mktemp -d /tmp/flatmesh-percall.XXXXXX)
. bench/scripts/nginx_conf.sh
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -f "$work/backend.pid" ] && kill "$(cat "$work/backend.pid")" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
for tool in perf taskset nginx haproxy; do
  command -v "$tool" > /dev/null || { echo "percall.sh needs $tool" >&2; exit 1; }
done
[ -x "$flatmesh" ] || { echo "no flatmesh binary at $flatmesh (cargo build --release -p flatmesh)" >&2; exit 1; }

case "$mode" in
  grpc)
    calls=${2:-20000}
    [ -x bench/.bin/ghz ] && [ -x bench/.bin/grpc-backend ] || { echo "needs bench/.bin/ghz and grpc-backend (bench/run --install-only)" >&2; exit 1; }
    routes='      - match: { path: { prefix: "/" } }
        cluster: app'
    clusters='  - name: app
    endpoints: ["127.0.0.1:18090"]
    protocol: http2'
    nginx_http='  upstream app { server 127.0.0.1:18090; keepalive 64; keepalive_requests 10000000; }
  server { listen 127.0.0.1:19180 http2; location ^~ / { grpc_pass grpc://app; } }'
    haproxy_http='frontend web
  mode http
  bind 127.0.0.1:19180 proto h2
  default_backend app
backend app
  mode http
  server s1 127.0.0.1:18090 proto h2'
    taskset -c 0 bench/.bin/grpc-backend -addr 127.0.0.1:18090 > "$work/backend.log" 2>&1 &
    pids+=($!)
    ;;
  http1|http2)
    secs=${2:-8}
    tool=wrk; [ "$mode" = http2 ] && tool=h2load
    command -v $tool > /dev/null || { echo "percall.sh $mode needs $tool" >&2; exit 1; }
    # HTTP/2 clients (h2c with prior knowledge) on the proxy's side; HTTP/1.1 to the backends.
    h2=""; [ "$mode" = http2 ] && h2=" http2"
    h2proto=""; [ "$mode" = http2 ] && h2proto=" proto h2"
    routes=$(for i in $(seq 0 9); do printf '      - match: { path: { prefix: /svc%s/ } }\n        cluster: svc-%s\n' "$i" "$i"; done)
    clusters=$(for i in $(seq 0 9); do printf '  - name: svc-%s\n    endpoints: ["127.0.0.1:%s"]\n' "$i" $((18100 + i)); done)
    nginx_http=$(for i in $(seq 0 9); do
      printf '  upstream svc%s { server 127.0.0.1:%s; keepalive 64; keepalive_requests 100000000; }\n' "$i" $((18100 + i))
    done
    printf '  server { listen 127.0.0.1:19180%s; keepalive_requests 100000000;\n' "$h2"
    for i in $(seq 0 9); do
      printf '    location /svc%s/ { proxy_pass http://svc%s; proxy_http_version 1.1; proxy_set_header Connection ""; }\n' "$i" "$i"
    done
    printf '  }')
    haproxy_http=$(printf 'frontend web\n  mode http\n  bind 127.0.0.1:19180%s\n' "$h2proto"
      for i in $(seq 0 9); do printf '  acl r%s path_beg /svc%s/\n  use_backend svc-%s if r%s\n' "$i" "$i" "$i" "$i"; done
      for i in $(seq 0 9); do printf 'backend svc-%s\n  mode http\n  server s1 127.0.0.1:%s\n' "$i" $((18100 + i)); done)
    servers=$(for i in $(seq 0 9); do printf "  server { listen 127.0.0.1:%s; location / { return 200 'svc%s'; } }\n" $((18100 + i)) "$i"; done)
    nginx_conf "$work" backend "  keepalive_requests 100000000;
$servers"
    taskset -c 0 nginx -c "$work/backend.conf" > "$work/backend.log" 2>&1 &
    ;;
  *) echo "usage: $0 grpc [CALLS] | http1 [SECONDS] | http2 [SECONDS]" >&2; exit 2 ;;
esac

cat > "$work/flatmesh.yaml" <<YAML
admin: "127.0.0.1:19100"
workers: 1
listeners:
  - name: web
    address: "127.0.0.1:19180"
    protocol: http
    routes:
$routes
clusters:
$clusters
YAML
nginx_conf "$work" nginx "$nginx_http"

cat > "$work/haproxy.cfg" <<CONF
global
  nbthread 1
  maxconn 8000
defaults
  timeout connect 2s
  timeout client 60s
  timeout server 60s
  timeout http-keep-alive 60s
$haproxy_http
CONF

# One load run against port 19180; prints "REQUESTS P50_US".
load() {
  if [ "$mode" = grpc ]; then
    taskset -c 0 bench/.bin/ghz --insecure --proto bench/grpc-backend/echo.proto \
      --call bench.Echo.Unary -d '{"payload":"aGVsbG8gZmxhdG1lc2ggYmVuY2ggMDEyMzQ1Njc4OQ=="}' \
      -c 1 --connections 1 -n "$1" -O json 127.0.0.1:19180 > "$work/ghz.json"
    python3 - "$work/ghz.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
lat = sorted(x["latency"] / 1000 for x in d["details"] if x["status"] == "OK")
print(len(lat), f"{lat[len(lat) // 2]:.1f}")
PY
  else
    # h2load gives no percentiles: for HTTP/2 the last column is its mean time per request.
    if [ "$mode" = http2 ]; then
      taskset -c 0 h2load -c16 -m10 -D "$1" http://127.0.0.1:19180/svc3/x > "$work/load.txt"
    else
      taskset -c 0 wrk -t1 -c32 -d"$1s" --latency http://127.0.0.1:19180/svc3/x > "$work/load.txt"
    fi
    python3 - "$work/load.txt" <<'PY'
import re, sys
t = open(sys.argv[1]).read()
done = re.search(r"(\d+) requests in", t) or re.search(r"requests: \d+ total, \d+ started, \d+ done, (\d+) succeeded", t)
m = re.search(r"50%\s+([\d.]+)(us|ms|s)", t) or re.search(r"time for request:\s+\S+\s+\S+\s+([\d.]+)(us|ms|s)", t)
print(int(done.group(1)), f"{float(m.group(1)) * {'us': 1, 'ms': 1e3, 's': 1e6}[m.group(2)]:.1f}")
PY
  fi
}
# The load's size: calls for gRPC, seconds for HTTP/1.1 and HTTP/2.
size() { if [ "$mode" = grpc ]; then echo "$calls"; else echo "$secs"; fi; }
warm() { if [ "$mode" = grpc ]; then load 500 > /dev/null; else load 1 > /dev/null; fi; }

exec 3> /dev/cpu_dma_latency
printf '\x00\x00\x00\x00' >&3
printf '%-9s %9s %10s %10s %10s %10s %9s\n' system requests "user us" "kernel us" syscalls "switches" "p50 us"
for system in ${SYSTEMS:-flatmesh nginx haproxy}; do
  case "$system" in
    flatmesh) taskset -c 1 "$flatmesh" node --config "$work/flatmesh.yaml" > "$work/node.log" 2>&1 & ;;
    nginx) taskset -c 1 nginx -c "$work/nginx.conf" > "$work/nginx.log" 2>&1 & ;;
    haproxy) taskset -c 1 haproxy -db -f "$work/haproxy.cfg" > "$work/haproxy.log" 2>&1 & ;;
  esac
  proxy=$!
  pids+=($proxy)
  sleep 1
  # nginx serves in its worker process, the master's only child.
  target=$proxy
  [ "$system" = nginx ] && target=$(pgrep -P "$proxy" | head -1)
  warm
  read -r u1 s1 < <(awk '{print $14, $15}' "/proc/$target/stat")
  perf stat -e raw_syscalls:sys_enter,context-switches -x, -o "$work/stat.txt" -p "$target" &
  stat=$!
  sleep 0.2
  read -r n p50 < <(load "$(size)")
  kill -INT $stat; wait $stat 2>/dev/null || true
  read -r u2 s2 < <(awk '{print $14, $15}' "/proc/$target/stat")
  tick=$(getconf CLK_TCK)
  python3 - "$work/stat.txt" "$system" "$n" "$p50" "$u1" "$u2" "$s1" "$s2" "$tick" <<'PY'
import sys
stat, system, n, p50, u1, u2, s1, s2, tick = sys.argv[1:]
n = int(n)
counts = {}
for line in open(stat):
    f = line.strip().split(",")
    if len(f) > 2 and f[0].replace(".", "").isdigit():
        counts[f[2]] = float(f[0])
per = lambda ticks: ticks / int(tick) * 1e6 / n
print(f"{system:9s} {n:9d} {per(int(u2) - int(u1)):10.1f} {per(int(s2) - int(s1)):10.1f} "
      f"{counts.get('raw_syscalls:sys_enter', 0) / n:10.2f} {counts.get('context-switches', 0) / n:10.2f} {float(p50):9.1f}")
PY
  if [ "$system" = flatmesh ] && [ "${PROFILE:-0}" = 1 ]; then
    perf record -q --call-graph fp -F 4000 -p "$target" -o "$work/perf.data" > /dev/null 2>&1 &
    rec=$!
    sleep 0.2
    load "$(size)" > /dev/null
    kill -INT $rec; wait $rec 2>/dev/null || true
    perf script -i "$work/perf.data" -F ip,sym,dso 2> /dev/null > "$work/stacks.txt"
    python3 - "$work/stacks.txt" <<'PY'
import collections, os, re, sys
# The task a sample ran in: the first of these found walking from the leaf to the root.
TASKS = [
    ("h2 client connection", "h2::client::Connection"),
    ("request body to the endpoint", "RequestPipe"),
    ("h2 server connection", "h2::server::Connection"),
    ("HTTP/2 stream (L7)", "h2::stream::serve"),
    ("HTTP/1 connection (L7)", "h1::conn::serve"),
    ("runtime: waiting for I/O", "Context::park"),
]
share = collections.defaultdict(lambda: [0, 0])
# With PROFILE_TASK set to one of the names above: the functions that task's samples ran in,
# counted once per sample (inclusive), to find which callee holds its time.
focus = os.environ.get("PROFILE_TASK")
inside = collections.Counter()
focused = 0
total = 0
for sample in open(sys.argv[1]).read().split("\n\n"):
    frames = [l.strip() for l in sample.strip().split("\n") if l.strip()]
    if not frames:
        continue
    total += 1
    kernel = "kernel.kallsyms" in frames[0]
    task = next((name for f in frames for name, mark in TASKS if mark in f), "other (scheduler, timers)")
    share[task][0 if kernel else 1] += 1
    if task == focus:
        focused += 1
        inside.update({re.sub(r"::h[0-9a-f]{16}$", "", f.split(" ", 1)[-1].rsplit(" (", 1)[0]) for f in frames})
print(f"\nflatmesh's CPU by task ({total} samples): kernel / user space, % of all samples")
for task, (k, u) in sorted(share.items(), key=lambda kv: -sum(kv[1])):
    print(f"  {task:28s} {100 * k / total:5.1f} / {100 * u / total:5.1f}")
if focus:
    print(f"\n{focus}: functions by share of its {focused} samples (inclusive)")
    for name, n in inside.most_common(60):
        print(f"  {100 * n / max(focused, 1):5.1f}  {name[:150]}")
PY
  fi
  kill "$proxy"; wait "$proxy" 2>/dev/null || true
  sleep 0.3
done
