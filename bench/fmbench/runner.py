"""The measurement loop: repeats x scenarios x systems, all in one run so ratios are fair.

For each repeat and scenario every system is started fresh (pinned to CPU 1),
checked for correctness, warmed up, then measured point by point. The order
of systems rotates between repeats so no system always runs first or last.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import checks, loadgen, procs
from .backends import Backends
from .scenarios import Scenario
from .systems import System, SystemError_

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
    system: System, scenario: Scenario, rep: int, load, res: loadgen.LoadResult, usage, idle_kb, host_cpu_s=None
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
        "raw": res.raw,
    }


def measure_system(
    system: System, scenario: Scenario, rep: int, workroot: Path, outcome: RunOutcome, stop_on_failure: bool
) -> None:
    workdir = workroot / scenario.name / system.name.replace("+", "-") / f"rep{rep}"
    workdir.mkdir(parents=True, exist_ok=True)
    port = system.target_port(scenario)
    proc = None
    where = "start"
    try:
        launch = system.launch(scenario, workdir)
        idle_kb = None
        if launch is not None:
            listen = [lst.port for lst in scenario.topology.listeners]
            procs.ensure_free(listen, system.name)
            proc = procs.start(system.name, procs.SUT_CPU, launch.argv, workdir, launch.env)
            procs.wait_ready(proc, listen, launch.ready_url, 30, workdir)
            system.after_ready(workdir)
            time.sleep(SETTLE_S)
            idle_kb = procs.rss_kb(procs.tree(proc.pid))
        where = "correctness check"
        passed = checks.run_checks(scenario, port, system.is_proxy, workdir, system.client_env)
        if rep == 0:
            _log(f"  {system.name}: checks ok ({'; '.join(passed)})")
        where = "load"
        for i, load in enumerate(scenario.points):
            if i == 0 and load.tool not in ("iperf3",):
                loadgen.run(scenario, replace(load, duration=WARMUP_S), port, system.client_env, workdir)
            meter = procs.Meter(proc.pid if proc else None)
            res = loadgen.run(scenario, load, port, system.client_env, workdir)
            usage = meter.finish()
            rec = _record(system, scenario, rep, load, res, usage, idle_kb, meter.host_cpu_s())
            outcome.records.append(rec)
            lat = res.lat_us or {}
            p99 = lat.get("p99")
            _log(
                f"  {system.name:<10} {scenario.name}{'' if load.x is None else f' x={load.x:g}'}: "
                f"{res.rate:,.0f}/s p99={'-' if p99 is None else f'{p99:,.0f}us'} errors={res.errors}"
                + (f" cpu={usage.cpu_s:.2f}s" if usage else "")
            )
    except (procs.ProcError, checks.CheckFailed, loadgen.LoadError, SystemError_, OSError) as e:
        outcome.failures.append({"system": system.name, "scenario": scenario.name, "repeat": rep, "stage": where, "error": str(e)})
        _log(f"  FAIL {system.name} / {scenario.name} ({where}): {e}")
        if stop_on_failure:
            raise
    finally:
        if proc is not None:
            procs.stop(proc)


def run(
    scenarios: list[Scenario], systems: list[System], repeats: int, workroot: Path, stop_on_failure: bool
) -> RunOutcome:
    outcome = RunOutcome()
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
