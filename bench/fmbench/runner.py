"""The measurement loop: repeats x scenarios x systems, all in one run so ratios are fair.

For each repeat and scenario every system is started fresh (pinned to CPU 1),
checked for correctness, warmed up, then measured point by point. The order
of systems rotates between repeats so no system always runs first or last.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import certs, checks, loadgen, procs, profile, wire
from .backends import Backends
from .scenarios import HOP_PORT, Scenario
from .systems import Envoy, Flatmesh, System, SystemError_, find_flatmesh

WARMUP_S = 1.0
SETTLE_S = 0.5  # after readiness, before reading idle RSS


@dataclass
class RunOutcome:
    records: list[dict] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)  # failed checks / start-ups / loads
    skipped: list[dict] = field(default_factory=list)  # unsupported combinations


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _per_unit(scenario: Scenario, cpu_s: float | None, ops: float) -> float | None:
    """CPU seconds per 10k operations; per GB moved for the byte-stream scenario."""
    if cpu_s is None or ops <= 0:
        return None
    return cpu_s / (ops / 1e9) if scenario.unit == "byte" else cpu_s / ops * 1e4


def _record(
    system: System, scenario: Scenario, rep: int, load, res: loadgen.LoadResult, usage, idle_kb, host_cpu_s=None, idle_anon_kb=None
) -> dict:
    per = _per_unit(scenario, usage.cpu_s, res.ops) if usage else None
    return {
        "system": system.name,
        "scenario": scenario.name,
        "repeat": rep,
        "x": load.x,
        "tool": load.tool,
        "params": load.params,
        "ops": res.ops,
        "duration_s": round(res.duration_s, 3),
        "rate": res.rate,
        "lat_us": res.lat_us,
        "errors": res.errors,
        "cpu_s": round(usage.cpu_s, 3) if usage else None,
        "cpu_per_unit": per,
        "host_cpu_s": round(host_cpu_s, 3) if host_cpu_s is not None else None,
        "host_cpu_per_unit": _per_unit(scenario, host_cpu_s, res.ops),
        "peak_rss_kb": usage.peak_rss_kb if usage else None,
        "idle_rss_kb": idle_kb,
        "idle_anon_kb": idle_anon_kb,
        "raw": res.raw,
    }


def measure_system(
    system: System, scenario: Scenario, rep: int, workroot: Path, outcome: RunOutcome, stop_on_failure: bool
) -> None:
    workdir = workroot / scenario.name / system.name.replace("+", "-") / f"rep{rep}"
    workdir.mkdir(parents=True, exist_ok=True)
    port = system.target_port(scenario)
    started: list = []
    where = "start"
    # The handshakes between the nodes, read on the wire from start-up through the checks and
    # the warm-up (not during the timed runs: the sniffer costs CPU).
    sniffer = hop_sniffer(scenario, system)
    hop = None if not isinstance(sniffer, dict) else sniffer
    try:
        launches = system.launches(scenario, workdir)
        idle_kb = idle_anon_kb = None
        if launches:
            # Every process of the system (both nodes of an mTLS pair) on the SUT CPU, each
            # ready before the next starts (the server node before the client node).
            for launch in launches:
                procs.ensure_free(launch.ports, launch.name)
                proc = procs.start(launch.name, procs.SUT_CPU, launch.argv, workdir, launch.env)
                started.append(proc)
                procs.wait_ready(proc, launch.ports, launch.ready_url, 30, workdir)
            system.after_ready(workdir)
            time.sleep(SETTLE_S)
            pids = [pid for p in started for pid in procs.tree(p.pid)]
            idle_kb, idle_anon_kb = procs.rss_kb(pids), procs.anon_kb(pids)
        where = "correctness check"
        passed = checks.run_checks(scenario, port, system.is_proxy, workdir, system.client_env)
        if rep == 0:
            _log(f"  {system.name}: checks ok ({'; '.join(passed)})")
        where = "load"
        for i, load in enumerate(scenario.points):
            # No warm-up for a bulk stream or for the idle connections (whose figure is memory).
            if i == 0 and load.tool not in ("iperf3", "idle"):
                loadgen.run(scenario, replace(load, duration=WARMUP_S), port, system.client_env, workdir)
            if i == 0 and isinstance(sniffer, wire.HelloSniffer):
                hop = sniffer.stop()
                _log(f"  {system.name}: between the nodes (start-up, checks, warm-up): {wire.describe(hop)}")
            meter = procs.Meter([p.pid for p in started])
            res = loadgen.run(scenario, load, port, system.client_env, workdir, on_hold=lambda: held_memory(started))
            usage = meter.finish()
            rec = _record(system, scenario, rep, load, res, usage, idle_kb, meter.host_cpu_s(), idle_anon_kb)
            if hop is not None:
                rec["hop_tls"] = hop
            outcome.records.append(rec)
            lat = res.lat_us or {}
            p99 = lat.get("p99")
            _log(
                f"  {system.name:<10} {scenario.name}{'' if load.x is None else f' x={load.x:g}'}: "
                f"{res.rate:,.0f}/s p99={'-' if p99 is None else f'{p99:,.0f}us'} errors={res.errors}"
                + (f" cpu={usage.cpu_s:.2f}s" if usage else "")
            )
        if scenario.topology.mtls and outcome.records and isinstance(system, Envoy):
            outcome.records[-1]["tls_stats"] = envoy_tls_stats(system, scenario)
        if scenario.profile and started:
            where = "profile"
            outcome.records[-1]["profile"] = profile_run(scenario, port, system, started, workdir)
    except (procs.ProcError, checks.CheckFailed, loadgen.LoadError, SystemError_, OSError, profile.ProfileError) as e:
        outcome.failures.append({"system": system.name, "scenario": scenario.name, "repeat": rep, "stage": where, "error": str(e)})
        _log(f"  FAIL {system.name} / {scenario.name} ({where}): {e}")
        if stop_on_failure:
            raise
    finally:
        if isinstance(sniffer, wire.HelloSniffer):
            sniffer.stop()
        for proc in reversed(started):
            procs.stop(proc)


def held_memory(started: list) -> dict:
    """The system's resident memory now (the idle_connections scenario reads it while the
    connections are held)."""
    return {"held_rss_kb": procs.rss_kb([pid for p in started for pid in procs.tree(p.pid)])}


def hop_sniffer(scenario: Scenario, system: System):
    """For a two-node system: a sniffer of the server node's ServerHellos, or why there is none."""
    if not scenario.topology.mtls or not system.is_proxy:
        return None
    try:
        return wire.HelloSniffer(HOP_PORT)
    except wire.WireError as e:
        return {"error": str(e)}


def profile_run(scenario: Scenario, port: int, system: System, started: list, workdir: Path) -> dict:
    """One more run of the scenario's first point with `perf record` on the system's processes
    (not timed: perf costs CPU). Returns the TLS / kernel / relay shares, or why there are none."""
    ok, why = profile.available()
    if not ok:
        _log(f"  {system.name}: TLS share not measured: {why}")
        return {"error": why}
    data = workdir / "perf.data"
    rec = profile.start([p.pid for p in started], data)
    try:
        loadgen.run(scenario, scenario.points[0], port, system.client_env, workdir)
    finally:
        text = profile.stop(rec, data)
    (workdir / "perf-report.txt").write_text(text)
    data.unlink(missing_ok=True)  # tens of MB; the report text stays
    out = profile.shares(text)
    _log(f"  {system.name}: CPU under perf: {profile.describe(out)}")
    return out


def envoy_tls_stats(system: Envoy, scenario: Scenario) -> dict:
    """Envoy's own TLS counters after the run (negotiated suites, handshakes, resumed sessions),
    so the report can show what was really negotiated."""
    out: dict = {}
    for url in system.stats_urls(scenario):
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                text = r.read().decode()
        except (urllib.error.URLError, OSError) as e:
            out[url] = f"unreadable: {e}"
            continue
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().isdigit() and int(value) > 0 and any(k in name for k in ("ssl.ciphers.", "ssl.handshake", "session_reused", "ssl.versions.", "ssl.connection_error", "ssl.fail")):
                out[name] = int(value)
    return out


def issue_certs(scenarios: list[Scenario], systems: list[System], workroot: Path) -> None:
    """The mTLS scenarios' certificates, once per run, given to every system (the same files)."""
    if not any(s.topology.mtls for s in scenarios):
        return
    binary = next((s.binary for s in systems if isinstance(s, Flatmesh) and s.binary), None) or find_flatmesh()
    if binary is None:
        raise SystemError_("the mTLS scenarios issue their certificates with `flatmesh ca`: build flatmesh or pass --flatmesh")
    issued = certs.issue(workroot / "certs", binary)
    _log(f"mTLS certificates from `{binary} ca`: {issued.dir} ({certs.CLIENT_ID}, {certs.SERVER_ID})")
    for s in systems:
        s.certs = issued


def run(
    scenarios: list[Scenario], systems: list[System], repeats: int, workroot: Path, stop_on_failure: bool
) -> RunOutcome:
    outcome = RunOutcome()
    held = max((s.topology.hold_connections or 0 for s in scenarios), default=0)
    if held:
        # Every system inherits this: the connections held, and room for the upstream pools.
        procs.raise_fd_limit(held + 4096)
    try:
        issue_certs(scenarios, systems, workroot)
    except (certs.CertError, SystemError_) as e:
        raise procs.ProcError(str(e))
    backends = Backends(workroot)
    try:
        for rep in range(repeats):
            for scenario in scenarios:
                _log(f"repeat {rep + 1}/{repeats}: {scenario.name} - {scenario.title}")
                backends.ensure(scenario.backends)
                k = rep % len(systems)
                for system in systems[k:] + systems[:k]:
                    ok, why = system.supports(scenario)
                    if not ok:
                        if rep == 0:
                            outcome.skipped.append({"system": system.name, "scenario": scenario.name, "why": why})
                            _log(f"  skip {system.name}: {why}")
                        continue
                    measure_system(system, scenario, rep, workroot, outcome, stop_on_failure)
    finally:
        backends.stop()
    return outcome
