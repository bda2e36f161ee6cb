#!/usr/bin/env bash
# hetero-socket between PUs (issue "HeteroK8s-Mesh end to end", item 1; docs/shm.md "Between
# PUs"): 64-byte sockperf ping-pong from PU a (CPU 0) to PU b (CPU 1) of one split namespace,
# side by side in one run, in interleaved rounds:
#
#   veth   the client dials 127.0.0.1:P; the split namespace's rules carry it over the PUs' veth
#          link (NAT on both sides); no library
#   shm    the same call with the library preloaded on both ends: the data moves to shared
#          memory between the PUs (the agents prove each connection)
#   local  reference: both ends on PU b (one network namespace), loopback TCP, no library, the
#          client pinned to CPU 0 all the same
#
#   crates/shm/scripts/bench_pus.sh [--quick] [target-dir]
#
# Prints one markdown table (p50, mean, p99 per path and the veth/shm ratio against the target
# ≥ 5×). --quick: 1-second runs and one round, to check that the script works. Needs root,
# sockperf, python3, and a release build:
#   cargo build --release -p flatmesh -p flatmesh-shm
# The vCPUs are held polling for the run (/dev/cpu_dma_latency = 0), as in bench.sh: a halted
# vCPU's wake-up would otherwise dominate every round trip. FLATMESH_BENCH_IDLE_STATES=1 leaves
# the idle states alone.
set -euo pipefail
QUICK=0
if [ "${1:-}" = --quick ]; then QUICK=1; shift; fi
T=$(readlink -f "${1:-${CARGO_TARGET_DIR:-target}}/release")
FLATMESH=$T/flatmesh
LIB=$T/libflatmesh_shm.so
if [ ! -x "$FLATMESH" ] || [ ! -f "$LIB" ]; then
  echo "build first: cargo build --release -p flatmesh -p flatmesh-shm" >&2; exit 1
fi
for tool in sockperf python3; do
  command -v $tool >/dev/null || { echo "$tool is missing: apt-get install -y $tool" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "run as root (network namespaces, nftables, the bind hook)" >&2; exit 1; }

SECONDS_PER_RUN=3; ROUNDS=3
if [ $QUICK = 1 ]; then SECONDS_PER_RUN=1; ROUNDS=1; fi
RES=$(mktemp -d /tmp/flatmesh-shm-pus.XXXXXX)
CONFIG=$RES/pod.yaml
cat > "$CONFIG" <<EOF
namespace: shmbench
state_dir: /run/flatmesh/pu-bench
poll_interval_ms: 20
pus:
  - { name: a, cpus: "0" }
  - { name: b, cpus: "$(( $(nproc) > 1 ? 1 : 0 ))" }
EOF
PIDS=()
POLLING=
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  "$FLATMESH" pu down --config "$CONFIG" >/dev/null 2>&1 || true
  rm -rf "$RES"
}
trap cleanup EXIT
if [ "${FLATMESH_BENCH_IDLE_STATES:-0}" != 1 ] && [ -w /dev/cpu_dma_latency ]; then
  python3 -c 'import os, struct, signal; fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY); os.write(fd, struct.pack("i", 0)); signal.pause()' &
  PIDS+=($!)
  POLLING=", vCPUs held polling (cpu_dma_latency 0)"
fi

"$FLATMESH" pu up --config "$CONFIG" >/dev/null
for pu in a b; do
  "$FLATMESH" pu agent --config "$CONFIG" --pu $pu 2>"$RES/agent-$pu.log" & PIDS+=($!)
done
on() { local pu=$1; shift; "$FLATMESH" pu run --config "$CONFIG" --pu "$pu" -- "$@"; }

PORT=$((17400 + RANDOM % 1000))
# The servers, all on PU b: plain (for veth and local) and preloaded (for shm).
on b sockperf server --tcp -i 127.0.0.1 -p $PORT >/dev/null 2>&1 & PIDS+=($!)
on b env LD_PRELOAD="$LIB" FLATMESH_SHM_STATS="$RES/stats" sockperf server --tcp -i 127.0.0.1 -p $((PORT + 1)) >/dev/null 2>&1 & PIDS+=($!)
# Wait until PU a maps both ports to PU b (the agents' rules).
for _ in $(seq 200); do
  status=$("$FLATMESH" pu status --config "$CONFIG" 2>/dev/null || true)
  if echo "$status" | grep -q "$PORT" && echo "$status" | grep -q "$((PORT + 1))"; then break; fi
  sleep 0.05
done
sleep 0.5

pingpong() { # path round
  local port=$PORT run=(on a)
  case $1 in
    shm) port=$((PORT + 1)); run=(on a env LD_PRELOAD="$LIB" FLATMESH_SHM_STATS="$RES/stats") ;;
    # The reference's client enters PU b's network namespace only (not its cpuset, which holds
    # CPU 1 alone), so that it too runs on CPU 0 and every path crosses CPUs.
    local) run=(ip netns exec fmpu-shmbench-b) ;;
  esac
  local out
  out=$("${run[@]}" taskset -c 0 sockperf ping-pong --tcp -i 127.0.0.1 -p $port -m 64 -t $SECONDS_PER_RUN --mps 10000000 2>&1)
  echo "$out" | sed -n 's/.*percentile 50.000 = *\([0-9.]*\).*/\1/p' >> "$RES/p50-$1"
  echo "$out" | sed -n 's/.*avg-latency=\([0-9.]*\).*/\1/p' | tail -1 >> "$RES/avg-$1"
  echo "$out" | sed -n 's/.*percentile 99.000 = *\([0-9.]*\).*/\1/p' >> "$RES/p99-$1"
}

echo "hetero-socket between PUs: $(date -u +%FT%TZ), $(nproc) CPUs, kernel $(uname -r)${POLLING}$([ $QUICK = 1 ] && echo ', QUICK (numbers meaningless)')" >&2
for round in $(seq $ROUNDS); do
  for path in veth shm local; do
    echo "round $round: $path ..." >&2
    pingpong $path
  done
done

python3 - "$RES" "$ROUNDS" "$SECONDS_PER_RUN" <<'EOF'
import os, statistics, sys
res, rounds, seconds = sys.argv[1], sys.argv[2], sys.argv[3]
def values(name):
    try:
        return [float(v) for v in open(os.path.join(res, name)).read().split()]
    except (OSError, ValueError):
        return []
def median(name):
    v = values(name)
    return statistics.median(v) if v else float("nan")
accelerated = 0
try:
    for line in open(os.path.join(res, "stats")):
        if line.startswith("flatmesh-shm pid "):
            w = line.split()
            accelerated += int(dict(zip(w[1::2], w[2::2])).get("accelerated", 0))
except OSError:
    pass
labels = {
    "veth": "PU a → PU b over the veth link (localhost, reverse-mapped), TCP",
    "shm": "PU a → PU b, hetero-socket shared memory",
    "local": "reference: same PU, loopback TCP",
}
print(f"sockperf ping-pong, 64 B, {seconds} s per run, median of {rounds} interleaved rounds")
print()
print("| path | p50 (µs) | mean (µs) | p99 (µs) |")
print("|---|---:|---:|---:|")
for path in ("veth", "shm", "local"):
    print(f"| {labels[path]} | {median('p50-' + path):.2f} | {median('avg-' + path):.2f} | {median('p99-' + path):.2f} |")
ratio = median("p50-veth") / median("p50-shm")
verdict = "PASS" if ratio >= 5 else "MISS"
print()
print(f"veth / shm, p50: {ratio:.1f}× lower over shared memory (target ≥ 5×: {verdict}); "
      f"connections the clients moved to shared memory: {accelerated}")
EOF
