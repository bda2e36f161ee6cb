#!/usr/bin/env bash
# hetero-socket benchmark (issue 6, papers/004 §4.2/§6.1): loopback TCP against shared memory,
# side by side in one run, under identical conditions; prints one table with the ratios and the
# targets. Server pinned to CPU 0, client to CPU 1 (DESIGN.md "Measuring").
#
#   crates/shm/scripts/bench.sh [--quick] [target-dir]
#
# Three systems:
#   tcp      plain loopback TCP (no library)
#   shm      the library with its defaults: 64 KiB local records per direction + 128 MiB of
#            per-core shared arenas (the paper's "128 KB local, 128 MB arena")
#   reserve  the library as a fixed-reservation design: 8 MiB local records per direction
#            (16 MiB per connection) and no arena (FLATMESH_SHM_LOCAL_KIB=8192, ARENA_MIB=0)
# Measured: sockperf ping-pong 16 B (latency), iperf3 with 64 B and 64 KiB writes (throughput,
# plus the library's data-path system calls per message), and 1,000 open connections held
# idle (shared memory reserved and resident, CPU used while idle).
#
# --quick: 1-second runs and 100 connections, to check that the script works (numbers are
# meaningless then). Needs root, sockperf, iperf3, python3; build first:
#   cargo build --release -p flatmesh-shm --lib --examples
#
# The vCPUs are held polling for the whole run (/dev/cpu_dma_latency = 0, released when the
# script exits): on a VM whose idle vCPU halts, waking a sleeping peer on the other CPU costs
# 70-150 µs, which would measure the hypervisor, not the transports. Both transports run under
# the same setting. FLATMESH_BENCH_IDLE_STATES=1 leaves the idle states alone.
set -euo pipefail
QUICK=0
if [ "${1:-}" = --quick ]; then QUICK=1; shift; fi
T=${1:-${CARGO_TARGET_DIR:-target}}/release
LIB=$(readlink -f "$T/libflatmesh_shm.so" 2>/dev/null || true)
PROBE=$T/examples/shm_probe
if [ ! -f "$LIB" ] || [ ! -x "$PROBE" ]; then
  echo "build first: cargo build --release -p flatmesh-shm --lib --examples" >&2; exit 1
fi
for tool in sockperf iperf3 python3 taskset; do
  command -v $tool >/dev/null || { echo "$tool is missing: apt-get install -y $tool" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "run as root (region files and 1,000-connection fd limits)" >&2; exit 1; }

LAT_S=10; TP_S=5; HOLD_S=5; CONNS=1000
if [ $QUICK = 1 ]; then LAT_S=1; TP_S=1; HOLD_S=1; CONNS=100; fi
RES=$(mktemp -d /tmp/flatmesh-shm-bench.XXXXXX)
PIDS=()
POLLING=
if [ "${FLATMESH_BENCH_IDLE_STATES:-0}" != 1 ] && [ -w /dev/cpu_dma_latency ]; then
  # The request holds while the file stays open: a helper keeps it open until it is killed.
  python3 -c 'import os, struct, signal; fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY); os.write(fd, struct.pack("i", 0)); signal.pause()' &
  PIDS+=($!)
  POLLING=", vCPUs held polling (cpu_dma_latency 0)"
fi
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$RES"; }
trap cleanup EXIT
PORT=$((17400 + RANDOM % 1000))
next_port() { PORT=$((PORT + 1)); }

# Environment for one system: `env ...` prefix.
envfor() {
  case $1 in
    tcp) echo "env -u LD_PRELOAD" ;;
    shm) echo "env LD_PRELOAD=$LIB FLATMESH_SHM_STATS=$RES/stats-$2" ;;
    reserve) echo "env LD_PRELOAD=$LIB FLATMESH_SHM_LOCAL_KIB=8192 FLATMESH_SHM_ARENA_MIB=0 FLATMESH_SHM_STATS=$RES/stats-$2" ;;
  esac
}
put() { echo "$2" > "$RES/$1"; }

wait_port() { for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$1) 2>/dev/null && return 0; sleep 0.05; done; return 1; }

latency() { # system
  # --mps: with the default "max" sockperf sizes its reply table for (seconds + 1) x 600,000
  # round trips and aborts with "_seqN > m_maxSequenceNo" when shm goes faster; an explicit
  # rate above any real one sizes the table from it and paces nothing.
  next_port
  $(envfor $1 lat) taskset -c 0 sockperf server --tcp -i 127.0.0.1 -p $PORT >/dev/null 2>&1 & local s=$!; PIDS+=($s)
  sleep 0.7
  local out
  out=$($(envfor $1 lat) taskset -c 1 sockperf ping-pong --tcp -i 127.0.0.1 -p $PORT -m 16 -t $LAT_S --mps 10000000 2>&1)
  kill $s; wait $s 2>/dev/null || true
  put lat-$1-avg "$(echo "$out" | sed -n 's/.*avg-latency=\([0-9.]*\).*/\1/p' | tail -1)"
  put lat-$1-p50 "$(echo "$out" | sed -n 's/.*percentile 50.000 = *\([0-9.]*\).*/\1/p')"
  put lat-$1-p99 "$(echo "$out" | sed -n 's/.*percentile 99.000 = *\([0-9.]*\).*/\1/p')"
}

throughput() { # system write-size
  next_port
  rm -f "$RES/stats-tp$2"
  $(envfor $1 tp$2) taskset -c 0 iperf3 -s -1 -p $PORT >/dev/null 2>&1 & local s=$!; PIDS+=($s)
  sleep 0.7
  $(envfor $1 tp$2) taskset -c 1 iperf3 -c 127.0.0.1 -p $PORT -t $TP_S -l $2 -J > "$RES/iperf-$1-$2.json"
  wait $s 2>/dev/null || true
  python3 - "$RES/iperf-$1-$2.json" "$RES/stats-tp$2" "$2" > "$RES/tp-$1-$2" <<'EOF'
import json, sys, os
end = json.load(open(sys.argv[1]))["end"]["sum_received"]
calls = 0
if os.path.exists(sys.argv[2]):
    for line in open(sys.argv[2]):
        if line.startswith("flatmesh-shm pid "):
            w = line.split()
            kv = dict(zip(w[1::2], w[2::2]))
            calls += sum(int(kv[k]) for k in ("wakeups_sent", "sleeps", "kernel_checks"))
messages = end["bytes"] / int(sys.argv[3])
print(f'{end["bits_per_second"] / 1e9:.3f} {calls} {messages:.0f}')
EOF
}

memory() { # system
  next_port
  local base srv cli port
  base=$(awk '/^Shmem:/{print $2}' /proc/meminfo)
  $(envfor $1 mem) SHM_PROBE_TICK_MS=0 taskset -c 0 "$PROBE" serve epoll $CONNS > "$RES/srv-$1" 2>&1 & srv=$!; PIDS+=($srv)
  for _ in $(seq 300); do grep -q ready "$RES/srv-$1" && break; sleep 0.1; done
  port=$(awk '/ready/{print $2}' "$RES/srv-$1")
  $(envfor $1 mem) SHM_PROBE_HOLD_SECS=$((HOLD_S + 3)) taskset -c 1 "$PROBE" client $port many:$CONNS > "$RES/cli-$1" 2>&1 & cli=$!; PIDS+=($cli)
  for _ in $(seq 600); do grep -q "^open" "$RES/cli-$1" && break; sleep 0.1; done
  sleep 1
  local now reserved arena rss_s rss_c c0 c1
  now=$(awk '/^Shmem:/{print $2}' /proc/meminfo)
  # Each connection's region is mapped once by the client: sum those mappings.
  reserved=$(python3 -c 'import sys; print(sum(int(l.split()[0].split("-")[1],16)-int(l.split()[0].split("-")[0],16) for l in open(sys.argv[1]) if "/dev/shm/flatmesh-shm-" in l and "-arena-" not in l)//1024)' /proc/$cli/maps)
  arena=0
  if [ $1 = shm ]; then
    # Arena files are /dev/shm/flatmesh-shm-arena-v<version>-<layout hash>-<uid>-<core>; builds
    # with another layout leave their own set, so count one set (the largest).
    arena=$(python3 -c '
import glob, os, collections
sets = collections.Counter()
for p in glob.glob("/dev/shm/flatmesh-shm-arena-v*-*-%d-*" % os.geteuid()):
    parts = os.path.basename(p).split("-")
    if len(parts) == 7 and ".tmp" not in p:
        sets[parts[3] + "-" + parts[4]] += os.path.getsize(p)
print(max(sets.values(), default=0) // 1024)')
    if [ "$arena" = 0 ]; then arena=$((128 * 1024)); fi  # not created yet: its configured size
  fi
  c0=$(( $(awk '{print $14+$15}' /proc/$srv/stat) + $(awk '{print $14+$15}' /proc/$cli/stat) ))
  sleep $HOLD_S
  c1=$(( $(awk '{print $14+$15}' /proc/$srv/stat) + $(awk '{print $14+$15}' /proc/$cli/stat) ))
  wait $cli; wait $srv
  put mem-$1 "$(grep -o 'open [0-9]* mapped [0-9]*' "$RES/cli-$1") reserved_kib $reserved arena_kib $arena resident_kib $((now - base)) idle_ticks $((c1 - c0)) hold_s $HOLD_S"
}

echo "hetero-socket benchmark: $(date -u +%FT%TZ), $(nproc) CPUs, kernel $(uname -r)${POLLING:-}$([ $QUICK = 1 ] && echo ', QUICK (numbers meaningless)')" >&2
for s in tcp shm; do echo "latency $s ..." >&2; latency $s; done
for len in 64 65536; do for s in tcp shm reserve; do echo "throughput $s $len B ..." >&2; throughput $s $len; done; done
for s in tcp shm reserve; do echo "memory and idle CPU $s ($CONNS connections) ..." >&2; memory $s; done

python3 - "$RES" "$CONNS" "$(getconf CLK_TCK)" <<'EOF'
import sys, os
res, conns, hz = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def get(name):
    try: return open(os.path.join(res, name)).read().split()
    except OSError: return []
def num(name, i=0):
    v = get(name)
    try: return float(v[i])
    except (IndexError, ValueError): return float("nan")
def mem(system):
    v = get("mem-" + system)
    return dict(zip(v[0::2], v[1::2])) if v and v[0] == "open" else {}
rows = []
def row(metric, tcp, shm, reserve, ratio, target, ok):
    rows.append([metric, tcp, shm, reserve, ratio, target, "" if ok is None else ("PASS" if ok else "MISS")])
fmt = lambda x, d=1: "n/a" if x != x else f"{x:.{d}f}"
for q in ("p50", "avg", "p99"):
    t, s = num(f"lat-tcp-{q}"), num(f"lat-shm-{q}")
    r = t / s if s else float("nan")
    row(f"sockperf ping-pong 16 B, {q} latency (µs)", fmt(t, 2), fmt(s, 2), "", f"{fmt(r)}× lower",
        "≥ 10× lower" if q == "p50" else "", (r >= 10) if q == "p50" else None)
for length, need, label in ((64, 2, "64 B"), (65536, 4, "64 KiB")):
    t, s, v = (num(f"tp-{x}-{length}") for x in ("tcp", "shm", "reserve"))
    r = s / t if t else float("nan")
    row(f"iperf3 throughput, {label} writes (Gbit/s)", fmt(t, 2), fmt(s, 2), fmt(v, 2), f"{fmt(r)}×",
        f"≥ {need}×", r >= need)
    calls, msgs = num(f"tp-shm-{length}", 1), num(f"tp-shm-{length}", 2)
    if msgs == msgs and msgs > 0:
        row(f"  shm data-path system calls per 1,000 {label} writes", "", fmt(1000 * calls / msgs, 2), "", "", "≪ 1,000", calls < msgs / 10)
m = {s: mem(s) for s in ("tcp", "shm", "reserve")}
def mib(system, key):
    try: return int(m[system][key]) / 1024
    except (KeyError, ValueError): return float("nan")
accel = {s: m[s].get("mapped", "?") for s in m}
shm_total = mib("shm", "reserved_kib") + mib("shm", "arena_kib")
row(f"{conns} open connections: shared memory reserved (MiB)", "0", f"{fmt(shm_total, 0)} ({fmt(mib('shm','reserved_kib'),0)} local + {fmt(mib('shm','arena_kib'),0)} arena)",
    fmt(mib("reserve", "reserved_kib"), 0), f"{fmt(mib('reserve','reserved_kib') / shm_total)}× less than reserve",
    "≤ 256 MiB (at 1,000)", shm_total <= 256 if conns >= 1000 else None)
row(f"{conns} open connections: shared memory resident (MiB)", fmt(mib("tcp", "resident_kib"), 0), fmt(mib("shm", "resident_kib"), 0), fmt(mib("reserve", "resident_kib"), 0), "", "", None)
def idle(system):
    try: return 100 * int(m[system]["idle_ticks"]) / (hz * int(m[system]["hold_s"]))
    except (KeyError, ValueError): return float("nan")
row(f"{conns} idle connections: CPU, server + client (% of one core)", fmt(idle("tcp"), 2), fmt(idle("shm"), 2), fmt(idle("reserve"), 2), "", "≈ 0 (no polling)", idle("shm") < 1)
row("connections on shared memory (of those opened)", accel.get("tcp", "?"), accel.get("shm", "?"), accel.get("reserve", "?"), "", f"{conns}", accel.get("shm") == str(conns))
head = ["metric", "loopback TCP", "shm (64 KiB local + arena)", "shm reserve (16 MiB/conn)", "shm vs TCP", "target", ""]
print("| " + " | ".join(head) + " |")
print("|" + "---|" * len(head))
for r in rows:
    print("| " + " | ".join(r) + " |")
EOF
