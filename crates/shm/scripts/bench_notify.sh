#!/usr/bin/env bash
# U-NAPI's notification modes (papers/004 §4.2.4; docs/shm.md "Waking a sleeper"): how a waiter
# that has polled its budget away is woken, and what that costs in CPU and latency.
#
#   crates/shm/scripts/bench_notify.sh [--quick] [target-dir] [output.svg]
#
# A 16-byte ping-pong over shared memory (shm_probe: a blocking echo server on CPU 0, or with
# SERVER=epoll one that waits in epoll_wait; the client on CPU 1) with a pause between round trips (THINK_US, 100 µs by default) longer than
# short polling budgets, so the server has to sleep between requests, as a real server with
# gaps between requests does. Every mode runs with each polling budget (FLATMESH_SHM_SPIN_US):
#
#   sync    wake-up byte over the kernel socket (the default)
#   async   a signal (tgkill) to the sleeping thread
#   norw    Notify-on-RW: the sleeper write-protects the peer's header page through the peer's
#           userfaultfd; the peer's next store faults and the fault wakes the sleeper
#
# Budgets: 0 (sleep at once), 10, 50 (the default) and 1,000,000 µs (never sleeps within a
# pause: pure polling, the latency floor and CPU ceiling). Reported per mode and budget: round
# trip p50 and p99 (half of it, one-way, as sockperf does) and CPU per request (server + client
# user+system time over the run, divided by the requests; the pause itself costs no CPU).
# Prints a markdown table and writes a plot of CPU per request against p50 latency (SVG).
#
# Rounds are interleaved (every configuration once per round, ROUNDS rounds, median kept) so
# that a noisy moment of the machine hits all of them alike. Needs root for the idle-state
# hold (see bench.sh: /dev/cpu_dma_latency = 0 for the run; FLATMESH_BENCH_IDLE_STATES=1 leaves
# the idle states alone), python3, taskset, and a release build:
#   cargo build --release -p flatmesh-shm --lib --examples
set -euo pipefail
QUICK=0
if [ "${1:-}" = --quick ]; then QUICK=1; shift; fi
T=$(readlink -f "${1:-${CARGO_TARGET_DIR:-target}}/release")
SVG=${2:-notify.svg}
LIB=$T/libflatmesh_shm.so
PROBE=$T/examples/shm_probe
if [ ! -f "$LIB" ] || [ ! -x "$PROBE" ]; then
  echo "build first: cargo build --release -p flatmesh-shm --lib --examples" >&2; exit 1
fi
for tool in python3 taskset; do
  command -v $tool >/dev/null || { echo "$tool is missing: apt-get install -y $tool" >&2; exit 1; }
done

TRIPS=${TRIPS:-20000}; ROUNDS=${ROUNDS:-3}; THINK_US=${THINK_US:-100}  # MODES and SPINS narrow the matrix
SERVER=${SERVER:-thread}  # or epoll: the echo server waits in epoll_wait (no other fd ticking)
if [ $QUICK = 1 ]; then TRIPS=500; ROUNDS=1; fi
MODES=${MODES:-sync async norw}
SPINS=${SPINS:-0 10 50 1000000}
RES=$(mktemp -d /tmp/flatmesh-shm-notify.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$RES"; }
trap cleanup EXIT
POLLING=
if [ "${FLATMESH_BENCH_IDLE_STATES:-0}" != 1 ] && [ -w /dev/cpu_dma_latency ]; then
  python3 -c 'import os, struct, signal; fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY); os.write(fd, struct.pack("i", 0)); signal.pause()' &
  PIDS+=($!)
  POLLING=", vCPUs held polling (cpu_dma_latency 0)"
fi
CLIENT_CPU=$(( $(nproc) > 1 ? 1 : 0 ))

one() { # mode spin round
  local env=(env LD_PRELOAD="$LIB" FLATMESH_SHM_NOTIFY=$1 FLATMESH_SHM_SPIN_US=$2)
  local out=$RES/server-$1-$2-$3
  "${env[@]}" SHM_PROBE_TICK_MS=0 SHM_PROBE_WAIT_MS=-1 taskset -c 0 "$PROBE" serve $SERVER 1 > "$out" 2>&1 & local server=$!
  for _ in $(seq 200); do grep -q '^ready' "$out" && break; sleep 0.02; done
  local port
  port=$(awk '/^ready/{print $2}' "$out")
  local client
  client=$("${env[@]}" SHM_PROBE_THINK_US=$THINK_US taskset -c $CLIENT_CPU "$PROBE" client "$port" pingpong:$TRIPS)
  wait $server
  grep -q "attached 1" "$out" || { echo "$1/$2: the connection did not move to shared memory" >&2; exit 1; }
  echo "$1 $2 $3 $(echo "$client" | grep '^pingpong') $(grep '^server_cpu_s' "$out")" >> "$RES/runs"
}

echo "U-NAPI notification modes: $(date -u +%FT%TZ), $(nproc) CPUs, kernel $(uname -r)${POLLING}, $SERVER echo server, $TRIPS round trips per run, ${THINK_US} µs pause, $ROUNDS rounds$([ $QUICK = 1 ] && echo ', QUICK (numbers meaningless)')" >&2
total=$(( ROUNDS * $(echo $MODES | wc -w) * $(echo $SPINS | wc -w) )); done_runs=0
for round in $(seq $ROUNDS); do
  for spin in $SPINS; do
    for mode in $MODES; do
      done_runs=$((done_runs + 1))
      printf '\r  run %d/%d: %s, budget %s µs          ' $done_runs $total $mode $spin >&2
      one $mode $spin $round
    done
  done
done
echo >&2

python3 - "$RES/runs" "$TRIPS" "$SVG" "$THINK_US" <<'EOF'
import sys, statistics, collections, html
runs_file, trips, svg_path, think = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
runs = collections.defaultdict(list)
for line in open(runs_file):
    w = line.split()
    mode, spin = w[0], int(w[1])
    kv = dict(zip(w[3::2], w[4::2]))
    cpu_us = (float(kv["client_cpu_s"]) + float(kv["server_cpu_s"])) * 1e6 / trips
    runs[(mode, spin)].append((float(kv["p50_us"]), float(kv["p99_us"]), cpu_us))
modes = ["sync", "async", "norw"]
spins = sorted({s for _, s in runs})
label = lambda s: "poll" if s >= 1_000_000 else f"{s} µs"
points = {}
print(f"| mode | polling budget | p50 (µs) | p99 (µs) | CPU per request (µs) |")
print("|---|---|---|---|---|")
for mode in modes:
    for spin in spins:
        r = runs.get((mode, spin))
        if not r:
            continue
        p50 = statistics.median(x[0] for x in r)
        p99 = statistics.median(x[1] for x in r)
        cpu = statistics.median(x[2] for x in r)
        points[(mode, spin)] = (cpu, p50)
        print(f"| {mode} | {label(spin)} | {p50:.2f} | {p99:.2f} | {cpu:.2f} |")

# The plot: CPU per request (x) against p50 (y), one line per mode through its budgets.
W, H, L, R, T, B = 720, 440, 70, 150, 40, 50
xs = [p[0] for p in points.values()] or [1]
ys = [p[1] for p in points.values()] or [1]
xmax, ymax = max(xs) * 1.1, max(ys) * 1.1
X = lambda v: L + (W - L - R) * v / xmax
Y = lambda v: H - B - (H - T - B) * v / ymax
colors = {"sync": "#1f77b4", "async": "#d62728", "norw": "#2ca02c"}
out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
       f'<rect width="{W}" height="{H}" fill="white"/>',
       f'<text x="{W/2}" y="20" text-anchor="middle" font-size="14">U-NAPI: CPU against latency (16 B ping-pong, {html.escape(think)} µs pause)</text>',
       f'<line x1="{L}" y1="{H-B}" x2="{W-R}" y2="{H-B}" stroke="black"/>',
       f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H-B}" stroke="black"/>',
       f'<text x="{(L+W-R)/2}" y="{H-12}" text-anchor="middle">CPU per request, server + client (µs)</text>',
       f'<text x="16" y="{(T+H-B)/2}" text-anchor="middle" transform="rotate(-90 16 {(T+H-B)/2})">p50 latency, one way (µs)</text>']
for i in range(6):
    vx, vy = xmax * i / 5, ymax * i / 5
    out.append(f'<text x="{X(vx):.1f}" y="{H-B+16}" text-anchor="middle">{vx:.1f}</text>')
    out.append(f'<text x="{L-6}" y="{Y(vy)+4:.1f}" text-anchor="end">{vy:.1f}</text>')
for n, mode in enumerate(modes):
    pts = [(points[(mode, s)], s) for s in spins if (mode, s) in points]
    if not pts:
        continue
    c = colors[mode]
    out.append('<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>' % (c, " ".join(f"{X(p[0]):.1f},{Y(p[1]):.1f}" for p, _ in pts)))
    for p, s in pts:
        out.append(f'<circle cx="{X(p[0]):.1f}" cy="{Y(p[1]):.1f}" r="4" fill="{c}"/>')
        out.append(f'<text x="{X(p[0])+6:.1f}" y="{Y(p[1])-6:.1f}" fill="{c}" font-size="10">{html.escape(label(s))}</text>')
    out.append(f'<rect x="{W-R+15}" y="{T+20*n}" width="12" height="12" fill="{c}"/>')
    out.append(f'<text x="{W-R+32}" y="{T+20*n+10}">{mode}</text>')
out.append("</svg>")
open(svg_path, "w").write("\n".join(out))
print(f"\nplot: {svg_path}", file=sys.stderr)
EOF
