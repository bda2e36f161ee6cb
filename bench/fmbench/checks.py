"""Correctness checks: every system must route correctly before it is timed."""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

from . import loadgen, paths
from .scenarios import HOST, Check, Scenario


class CheckFailed(RuntimeError):
    pass


def _http(port: int, c: Check) -> None:
    url = f"http://{HOST}:{port}{c.path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            status, body = r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        raise CheckFailed(f"GET {url} failed: {e}")
    if status != c.status:
        raise CheckFailed(f"GET {url}: expected status {c.status}, got {status} (body {body[:80]!r})")
    if c.body is not None and body != c.body:
        raise CheckFailed(f"GET {url}: expected body {c.body!r}, got {body[:80]!r}: routed to the wrong cluster?")


def _h2(port: int, c: Check) -> None:
    url = f"http://{HOST}:{port}{c.path}"
    if shutil.which("nghttp") is None:
        raise CheckFailed("nghttp (Debian nghttp2-client) is missing; run bench/run without --no-install")
    # nghttp speaks h2c with prior knowledge to http:// URLs; -v shows the response headers.
    p = subprocess.run(["nghttp", "-v", url], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=10)
    m = re.search(r"recv \(stream_id=\d+\) :status: (\d+)", p.stdout)
    if p.returncode != 0 or not m:
        raise CheckFailed(f"HTTP/2 GET {url} failed (nghttp exit {p.returncode}): {p.stdout.strip()[-300:]}")
    if int(m.group(1)) != c.status:
        raise CheckFailed(f"HTTP/2 GET {url}: expected status {c.status}, got {m.group(1)}")
    # -v interleaves the body with the frame log; the body is a line of its own.
    if c.body is not None and c.body.strip() not in p.stdout.splitlines():
        raise CheckFailed(f"HTTP/2 GET {url}: body is not {c.body!r}: routed to the wrong cluster?")


def _grpc(port: int) -> None:
    p = subprocess.run(
        [str(paths.GRPC_BACKEND_BIN), "-check", f"{HOST}:{port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=20,
    )
    if p.returncode != 0:
        raise CheckFailed(p.stdout.strip()[-400:])


def _tcp(scenario: Scenario, port: int, tmp: Path, env: dict | None) -> None:
    # A one-second run of the scenario's own tool through the relay must complete.
    load = replace(scenario.points[0], duration=1.0)
    try:
        r = loadgen.run(scenario, load, port, env, tmp)
    except loadgen.LoadError as e:
        raise CheckFailed(f"{load.tool} through port {port} failed: {e}")
    if r.ops <= 0:
        raise CheckFailed(f"{load.tool} through port {port} completed nothing")


def run_checks(scenario: Scenario, port: int, is_proxy: bool, tmp: Path, env: dict | None = None) -> list[str]:
    """Run the scenario's checks against `port`; returns descriptions of what passed, raises CheckFailed."""
    done = []
    for c in scenario.checks:
        if c.routed_only and not is_proxy:
            continue
        if c.kind == "http":
            _http(port, c)
            done.append(f"GET {c.path} -> {c.status}")
        elif c.kind == "h2":
            _h2(port, c)
            done.append(f"h2 GET {c.path} -> {c.status}")
        elif c.kind == "grpc":
            _grpc(port)
            done.append("grpc unary+bidi echo")
        elif c.kind == "tcp":
            _tcp(scenario, port, tmp, env)
            done.append(f"{scenario.points[0].tool} 1 s")
        else:
            raise CheckFailed(f"unknown check kind {c.kind!r} in scenario {scenario.name}")
    return done

