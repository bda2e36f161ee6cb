"""Running the load tools (pinned to CPU 0) and parsing their output into one result shape.

Each tool reports differently; everything here ends up as a `LoadResult`:
completed operations, duration, rate, latency percentiles in microseconds and
an error count. Latency percentiles come from the tool itself where it gives
them (wrk via wrk-report.lua, fortio, sockperf) and from per-request logs where
it does not (h2load --log-file, ghz's per-call details).
"""

from __future__ import annotations

import json
import math
import os
import re
import select
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import paths, procs
from .scenarios import HOST, Load, Scenario

PERCENTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "p999": 99.9}
GRPC_PAYLOAD = "aGVsbG8gZmxhdG1lc2ggYmVuY2ggMDEyMzQ1Njc4OQ=="  # 32 bytes, base64


CLIENT_SHUTDOWN_ERRORS = ("the client connection is closing", "use of closed network connection")


class LoadError(RuntimeError):
    pass


@dataclass
class LoadResult:
    ops: int  # completed requests / round trips / streams; bytes for iperf3
    duration_s: float
    rate: float  # ops per second (bits per second for iperf3)
    lat_us: dict | None  # p50, p90, p99, p999 in microseconds
    errors: int
    raw: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def percentiles(samples: list[float]) -> dict:
    """Nearest-rank percentiles of the samples (microseconds)."""
    if not samples:
        return {k: None for k in PERCENTILES}
    s = sorted(samples)
    out = {}
    for k, p in PERCENTILES.items():
        # round() first: 99.9 / 100 * 1000 is 999.0000000000001 in floating point.
        rank = max(1, math.ceil(round(p / 100.0 * len(s), 9)))
        out[k] = float(s[rank - 1])
    return out


def _run(argv: list[str], timeout: float, env: dict | None, what: str) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, **(env or {}))
    try:
        return subprocess.run(
            procs.pinned(procs.LOAD_CPU, argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            timeout=timeout,
            env=full_env,
        )
    except subprocess.TimeoutExpired:
        raise LoadError(f"{what} did not finish within {timeout:.0f}s; the system under test may be hung.")
    except OSError as e:
        raise LoadError(f"cannot run {argv[0]}: {e}. Run bench/run without --no-install to install it.")


def _secs(d: float) -> int:
    return max(1, int(math.ceil(d)))


# ---------------------------------------------------------------- wrk


def run_wrk(url: str, load: Load, env: dict | None) -> LoadResult:
    argv = [
        "wrk", "-t1", f"-c{load.params['connections']}", f"-d{_secs(load.duration)}s",
        "--timeout", "5s", "-s", str(paths.WRK_SCRIPT),
    ]
    if load.params.get("close"):
        argv += ["-H", "Connection: close"]
    argv.append(url)
    p = _run(argv, load.duration + 30, env, "wrk")
    return parse_wrk(p.stdout, p.stderr, p.returncode)


def parse_wrk(stdout: str, stderr: str = "", rc: int = 0) -> LoadResult:
    m = re.search(r"^WRKJSON (\{.*\})$", stdout, re.M)
    if rc != 0 or not m:
        raise LoadError(f"wrk failed (exit {rc}): {(stderr or stdout).strip()[-500:]}")
    d = json.loads(m.group(1))
    dur = d["duration_us"] / 1e6
    errors = sum(d["errors"].values())
    lat = {k: d["lat_us"][k] for k in PERCENTILES}
    return LoadResult(d["requests"], dur, d["requests"] / dur if dur else 0.0, lat, errors, d)


# ---------------------------------------------------------------- h2load


def run_h2load(url: str, load: Load, env: dict | None, tmp: Path) -> LoadResult:
    log = tmp / "h2load-requests.log"
    if log.exists():
        log.unlink()
    argv = [
        "h2load", "-t1", "-c", str(load.params["connections"]), "-m", str(load.params["streams"]),
        "-D", str(_secs(load.duration)), f"--log-file={log}", url,
    ]
    p = _run(argv, load.duration + 30, env, "h2load")
    try:
        per_request = log.read_text()
    except OSError:
        per_request = ""
    finally:
        if log.exists():
            log.unlink()
    return parse_h2load(p.stdout, per_request, p.returncode, p.stderr)


def parse_h2load(stdout: str, per_request_log: str, rc: int = 0, stderr: str = "") -> LoadResult:
    fin = re.search(r"finished in ([\d.]+)(ms|s), ([\d.]+) req/s", stdout)
    req = re.search(
        r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored, (\d+) timeout",
        stdout,
    )
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", stdout)
    if rc != 0 or not fin or not req:
        raise LoadError(f"h2load failed (exit {rc}): {(stderr or stdout).strip()[-500:]}")
    dur = float(fin.group(1)) / (1000.0 if fin.group(2) == "ms" else 1.0)
    ok = int(req.group(4))
    errors = int(req.group(5)) + int(req.group(6)) + int(req.group(7))
    if codes:
        errors += int(codes.group(3)) + int(codes.group(4))
    # --log-file lines: start time (us), status, elapsed (us).
    samples = []
    for line in per_request_log.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1].isdigit():
            samples.append(float(parts[2]))
    return LoadResult(ok, dur, float(fin.group(3)), percentiles(samples), errors, {"summary": stdout[fin.start():]})


# ---------------------------------------------------------------- ghz


def run_ghz(target: str, load: Load, env: dict | None) -> LoadResult:
    msgs = load.params.get("messages", 1)
    data = {"payload": GRPC_PAYLOAD}
    body = json.dumps([data] * msgs if msgs > 1 else data)
    argv = [
        str(paths.gobin("ghz")), "--insecure", "--proto", str(paths.ECHO_PROTO),
        "--call", load.params["call"], "-d", body,
        "-c", str(load.params["concurrency"]), "--connections", str(load.params["connections"]),
        "-z", f"{_secs(load.duration)}s", "-O", "json", target,
    ]
    if "rps" in load.params:
        argv[-3:-3] = ["--rps", str(load.params["rps"])]
    p = _run(argv, load.duration + 60, env, "ghz")
    return parse_ghz(p.stdout, p.returncode, p.stderr)


def parse_ghz(stdout: str, rc: int = 0, stderr: str = "") -> LoadResult:
    try:
        d = json.loads(stdout)
    except json.JSONDecodeError:
        raise LoadError(f"ghz failed (exit {rc}): {(stderr or stdout).strip()[-500:]}")
    codes = d.get("statusCodeDistribution") or {}
    ok = int(codes.get("OK", 0))
    # When -z expires ghz closes its own connections under calls still in flight;
    # those calls fail with these client-side messages. They are not the proxy's errors.
    shutdown = sum(
        int(n)
        for msg, n in (d.get("errorDistribution") or {}).items()
        if any(s in msg for s in CLIENT_SHUTDOWN_ERRORS)
    )
    errors = sum(int(v) for k, v in codes.items() if k != "OK") - shutdown
    dur = d.get("total", 0) / 1e9
    samples = [x["latency"] / 1000.0 for x in d.get("details") or [] if x.get("status") == "OK"]
    if samples:
        lat = percentiles(samples)
    else:
        dist = {int(x["percentage"]): x["latency"] / 1000.0 for x in d.get("latencyDistribution") or []}
        lat = {"p50": dist.get(50), "p90": dist.get(90), "p99": dist.get(99), "p999": None}
    summary = {k: v for k, v in d.items() if k not in ("details", "options", "histogram")}
    summary["client_shutdown_errors"] = shutdown
    return LoadResult(ok, dur, ok / dur if dur else 0.0, lat, errors, summary)


# ---------------------------------------------------------------- fortio


def run_fortio(url: str, load: Load, env: dict | None, tmp: Path) -> LoadResult:
    out = tmp / "fortio.json"
    argv = [
        str(paths.gobin("fortio")), "load", "-quiet", "-qps", str(load.params["qps"]),
        "-c", str(load.params["connections"]), "-t", f"{_secs(load.duration)}s",
        "-p", "50,90,99,99.9", "-timeout", "5s", "-json", str(out), url,
    ]
    p = _run(argv, load.duration + 30, env, "fortio")
    try:
        text = out.read_text()
    except OSError:
        raise LoadError(f"fortio wrote no result (exit {p.returncode}): {p.stderr.strip()[-500:]}")
    finally:
        if out.exists():
            out.unlink()
    return parse_fortio(text)


def parse_fortio(text: str) -> LoadResult:
    d = json.loads(text)
    hist = d["DurationHistogram"]
    count = int(hist["Count"])
    codes = d.get("RetCodes") or {}
    ok = int(codes.get("200", 0))
    names = {50.0: "p50", 90.0: "p90", 99.0: "p99", 99.9: "p999"}
    lat = {v: None for v in names.values()}
    for pc in hist.get("Percentiles") or []:
        key = names.get(round(float(pc["Percentile"]), 1))
        if key:
            lat[key] = float(pc["Value"]) * 1e6
    dur = d.get("ActualDuration", 0) / 1e9
    raw = {k: d.get(k) for k in ("RequestedQPS", "ActualQPS", "ActualDuration", "NumThreads", "RetCodes")}
    return LoadResult(ok, dur, float(d.get("ActualQPS", 0.0)), lat, count - ok, raw)


# ---------------------------------------------------------------- sockperf


def run_sockperf(port: int, load: Load, env: dict | None) -> LoadResult:
    argv = [
        # An explicit --mps: with the default (max) sockperf sizes its reply table for 600k
        # round trips per second and aborts ("_seqN > m_maxSequenceNo") when a faster path
        # (tier K, shared memory) goes past it.
        "sockperf", "ping-pong", "--tcp", "-i", HOST, "-p", str(port), "--mps", "10000000",
        "-m", str(load.params["msg_size"]), "-t", str(_secs(load.duration)),
    ]
    p = _run(argv, load.duration + 30, env, "sockperf")
    return parse_sockperf(p.stdout + p.stderr, p.returncode)


def parse_sockperf(out: str, rc: int = 0) -> LoadResult:
    out = re.sub(r"\x1b\[[0-9;]*m", "", out)  # sockperf colours some lines
    obs = re.search(r"Total (\d+) observations", out)
    # "[Valid Duration]" is the measured window; "[Total Run]" also counts the warm-up.
    valid = re.search(r"\[Valid Duration\] RunTime=([\d.]+) sec; SentMessages=(\d+); ReceivedMessages=(\d+)", out)
    if rc != 0 or not obs or not valid:
        raise LoadError(f"sockperf failed (exit {rc}): {out.strip()[-500:]}")
    pct = {}
    for m in re.finditer(r"---> percentile\s+([\d.]+)\s*=\s*([\d.]+)", out):
        pct[round(float(m.group(1)), 3)] = float(m.group(2))
    lat = {"p50": pct.get(50.0), "p90": pct.get(90.0), "p99": pct.get(99.0), "p999": pct.get(99.9)}
    dur = float(valid.group(1))
    sent, received = int(valid.group(2)), int(valid.group(3))
    n = int(obs.group(1))
    avg = re.search(r"avg-latency=([\d.]+)", out)
    raw = {"sent": sent, "received": received, "avg_us": float(avg.group(1)) if avg else None}
    return LoadResult(n, dur, n / dur if dur else 0.0, lat, max(0, sent - received), raw)


# ---------------------------------------------------------------- iperf3


def run_iperf3(port: int, load: Load, env: dict | None) -> LoadResult:
    argv = ["iperf3", "-c", HOST, "-p", str(port), "-t", str(_secs(load.duration)), "-J"]
    p = _run(argv, load.duration + 30, env, "iperf3")
    return parse_iperf3(p.stdout, p.returncode)


def parse_iperf3(stdout: str, rc: int = 0) -> LoadResult:
    try:
        d = json.loads(stdout)
    except json.JSONDecodeError:
        raise LoadError(f"iperf3 failed (exit {rc}): {stdout.strip()[-500:]}")
    if d.get("error") or rc != 0:
        raise LoadError(f"iperf3 failed: {d.get('error', 'exit ' + str(rc))}")
    recv = d["end"]["sum_received"]
    sent = d["end"]["sum_sent"]
    raw = {"bits_per_second": recv["bits_per_second"], "retransmits": sent.get("retransmits")}
    return LoadResult(int(recv["bytes"]), float(recv["seconds"]), float(recv["bits_per_second"]), None, 0, raw)


# ---------------------------------------------------------------- idle connections


def run_idle(port: int, path: str, load: Load, env: dict | None, on_hold: Callable[[], dict] | None) -> LoadResult:
    """Opens `connections` keep-alive connections (HTTP/1.1, or h2c when `protocol` is "h2"; one
    request each, `concurrency` opening at once) with fmbench.idleconns on the load CPU, holds them idle for `duration` seconds, calls
    `on_hold` (which reads the system's memory) and closes them. The rate is connections opened
    per second; the latencies are each connection's connect + first request."""
    conns, concurrency = load.params["connections"], load.params.get("concurrency", 64)
    protocol = load.params.get("protocol", "h1")
    timeout = 10.0
    argv = [sys.executable, "-m", "fmbench.idleconns", str(port), path, str(conns), str(concurrency), str(timeout), protocol]
    full_env = dict(os.environ, **(env or {}), PYTHONPATH=str(paths.BENCH))
    try:
        p = subprocess.Popen(
            procs.pinned(procs.LOAD_CPU, argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=full_env,
        )
    except OSError as e:
        raise LoadError(f"cannot run the idle-connection client: {e}")
    try:
        holding = _read_tagged(p, "HOLDING", 60 + conns / 100)
        time.sleep(load.duration)
        measured = on_hold() if on_hold else {}
        p.stdin.write("close\n")
        p.stdin.flush()
        done = _read_tagged(p, "DONE", 60)
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
    return parse_idle(holding, done, measured)


def _read_tagged(p: subprocess.Popen, tag: str, timeout: float) -> dict:
    """The JSON after `tag` on the next stdout line of `p`, within `timeout` seconds."""
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    line = p.stdout.readline() if ready else ""
    if not line.startswith(tag + " "):
        p.kill()
        err = p.stderr.read()[-500:]
        got = line.strip()[:200] or ("nothing" if ready else f"nothing within {timeout:.0f}s")
        raise LoadError(f"the idle-connection client said {got!r}, not {tag}: {err.strip()}")
    return json.loads(line[len(tag) + 1 :])


def parse_idle(holding: dict, done: dict, measured: dict) -> LoadResult:
    held = int(holding["held"])
    open_s = float(holding["open_s"])
    closed = int(done.get("closed_while_held", 0))
    raw = {
        "held": held,
        "open_s": open_s,
        "reasons": holding.get("reasons", []),
        "closed_while_held": closed,
        **measured,
    }
    errors = int(holding["errors"]) + closed
    return LoadResult(held, open_s, held / open_s if open_s else 0.0, percentiles(done.get("latencies_us", [])), errors, raw)


# ---------------------------------------------------------------- dispatch


def run(
    scenario: Scenario, load: Load, port: int, env: dict | None, tmp: Path, on_hold: Callable[[], dict] | None = None
) -> LoadResult:
    url = f"http://{HOST}:{port}{scenario.path}"
    if load.tool == "wrk":
        return run_wrk(url, load, env)
    if load.tool == "h2load":
        return run_h2load(url, load, env, tmp)
    if load.tool == "ghz":
        return run_ghz(f"{HOST}:{port}", load, env)
    if load.tool == "fortio":
        return run_fortio(url, load, env, tmp)
    if load.tool == "sockperf":
        return run_sockperf(port, load, env)
    if load.tool == "iperf3":
        return run_iperf3(port, load, env)
    if load.tool == "idle":
        return run_idle(port, scenario.path, load, env, on_hold)
    raise LoadError(f"unknown load tool {load.tool!r} in scenario {scenario.name}")
