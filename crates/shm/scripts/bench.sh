#!/usr/bin/env bash
# hetero-socket benchmark: loopback TCP vs shared memory, side by side in one run.
# Server pinned to CPU 0, client to CPU 1 (DESIGN.md "Measuring").
# Usage: crates/shm/scripts/bench.sh [target-dir]   (needs root, sockperf, iperf3)
set -euo pipefail
T=${1:-${CARGO_TARGET_DIR:-target}}/release
LIB=$(readlink -f "$T/libflatmesh_shm.so"); PROBE=$T/examples/shm_probe
[ -f "$LIB" ] && [ -x "$PROBE" ] || { echo "build first: cargo build --release -p flatmesh-shm --lib --examples" >&2; exit 1; }
pre() { if [ "$1" = shm ]; then echo "env LD_PRELOAD=$LIB"; else echo "env -u LD_PRELOAD"; fi; }

echo "## sockperf ping-pong, 16 B, 10 s (server CPU 0, client CPU 1)"
for mode in tcp shm; do
  $(pre $mode) taskset -c 0 sockperf server --tcp -i 127.0.0.1 -p 17400 >/dev/null 2>&1 & S=$!; sleep 0.7
  out=$($(pre $mode) taskset -c 1 sockperf ping-pong --tcp -i 127.0.0.1 -p 17400 -m 16 -t 10 2>&1)
  kill $S; wait $S 2>/dev/null || true
  avg=$(echo "$out" | sed -n 's/.*avg-latency=\([0-9.]*\).*/\1/p' | tail -1)
  p50=$(echo "$out" | sed -n 's/.*percentile 50.000 = *\([0-9.]*\).*/\1/p')
  p99=$(echo "$out" | sed -n 's/.*percentile 99.000 = *\([0-9.]*\).*/\1/p')
  echo "$mode avg_us=$avg p50_us=$p50 p99_us=$p99"
done

echo "## iperf3 throughput, 5 s, write size 64 B and 64 KiB (server CPU 0, client CPU 1)"
for len in 64 65536; do
  for mode in tcp shm; do
    $(pre $mode) taskset -c 0 iperf3 -s -1 -p 17401 >/dev/null 2>&1 & S=$!; sleep 0.7
    gbps=$($(pre $mode) taskset -c 1 iperf3 -c 127.0.0.1 -p 17401 -t 5 -l $len -J | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/1e9,3))')
    wait $S 2>/dev/null || true
    echo "$mode len=$len gbit_per_s=$gbps"
  done
done

echo "## 1,000 open connections: shared memory reserved and resident, idle CPU over 5 s"
cpu() { awk '{print $14+$15}' /proc/$1/stat; }
for design in "shm-64KiB-records:64" "shm-8MiB-records(16MiB/conn):8192" "tcp:0"; do
  name=${design%%:*}; kib=${design##*:}
  mode=shm; [ "$kib" = 0 ] && mode=tcp
  base=$(awk '/^Shmem:/{print $2}' /proc/meminfo)
  $(pre $mode) FLATMESH_SHM_RING_KIB=$kib $PROBE serve epoll 1000 > /tmp/shm-bench-srv.out & S=$!
  for i in $(seq 300); do grep -q ready /tmp/shm-bench-srv.out && break; sleep 0.1; done
  port=$(awk '/ready/{print $2}' /tmp/shm-bench-srv.out)
  $(pre $mode) FLATMESH_SHM_RING_KIB=$kib SHM_PROBE_HOLD_SECS=8 $PROBE client $port many:1000 > /tmp/shm-bench-cli.out & C=$!
  for i in $(seq 200); do grep -q "^open" /tmp/shm-bench-cli.out && break; sleep 0.1; done
  sleep 1
  now=$(awk '/^Shmem:/{print $2}' /proc/meminfo)
  reserved=$(python3 -c 'import sys; print(sum(int(l.split()[0].split("-")[1],16)-int(l.split()[0].split("-")[0],16) for l in open(sys.argv[1]) if "flatmesh-shm-" in l)//1024)' /proc/$C/maps)
  rss_s=$(awk '/VmRSS/{print $2}' /proc/$S/status); rss_c=$(awk '/VmRSS/{print $2}' /proc/$C/status)
  c0=$(( $(cpu $S) + $(cpu $C) )); sleep 5; c1=$(( $(cpu $S) + $(cpu $C) ))
  wait $C; wait $S
  echo "$name reserved_kib=$reserved resident_shmem_kib=$((now-base)) rss_server_kib=$rss_s rss_client_kib=$rss_c idle_cpu_ticks_5s=$((c1-c0))"
done
