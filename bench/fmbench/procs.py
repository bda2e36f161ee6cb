"""Starting pinned processes, waiting for readiness, and reading CPU and memory from /proc.

Every process the harness starts gets its own session (process group), is
recorded here, and is stopped by its own id when the run ends, even on Ctrl-C.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
SUT_CPU = "1"
LOAD_CPU = "0"

_started: list[subprocess.Popen] = []


class ProcError(RuntimeError):
    pass


def raise_fd_limit(need: int) -> None:
    """Raises this process's open-file limit (soft, and hard as root) to at least `need`; the
    processes it starts inherit it. A clear error when it cannot."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, max(need, hard)))
    except (ValueError, OSError) as e:
        raise ProcError(
            f"{need} open files are needed; the limit is {soft} (hard {hard}) and cannot be raised ({e}): "
            "run as root or raise `ulimit -n`"
        )


def pinned(cpu: str, argv: list[str]) -> list[str]:
    return ["taskset", "-c", cpu, *argv]


def start(name: str, cpu: str, argv: list[str], logdir: Path, env: dict | None = None) -> subprocess.Popen:
    """Start argv pinned to `cpu`, output to logdir/<name>.log."""
    log = open(logdir / f"{name}.log", "wb")
    full_env = dict(os.environ, **(env or {}))
    try:
        p = subprocess.Popen(
            pinned(cpu, argv), stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
    except OSError as e:
        raise ProcError(f"cannot start {name} ({argv[0]}): {e}. Is it installed? Run bench/run without --no-install.")
    finally:
        log.close()
    p.name = name  # type: ignore[attr-defined]
    _started.append(p)
    return p


def stop(p: subprocess.Popen, timeout: float = 5.0) -> None:
    """Stop a process we started: SIGTERM to its own process group, then SIGKILL."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout)
    else:
        # The leader exited; children (nginx workers) may still hold the group.
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if p in _started:
        _started.remove(p)


def stop_all() -> None:
    for p in list(reversed(_started)):
        stop(p, timeout=3.0)


atexit.register(stop_all)


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def ensure_free(ports: list[int], who: str) -> None:
    busy = [p for p in ports if port_open(p)]
    if busy:
        raise ProcError(
            f"port(s) {busy} on 127.0.0.1 are already in use, so {who} cannot start. "
            f"Stop whatever listens there (`ss -ltnp | grep -E ':({'|'.join(map(str, busy))})'`) and rerun."
        )


def wait_ready(p: subprocess.Popen, ports: list[int], url: str | None, timeout: float, logdir: Path) -> None:
    """Wait until the readiness URL answers 200 (if any) and every port accepts connections."""
    deadline = time.monotonic() + timeout
    name = getattr(p, "name", "process")
    while time.monotonic() < deadline:
        if p.poll() is not None:
            tail = _log_tail(logdir / f"{name}.log")
            raise ProcError(f"{name} exited with code {p.returncode} during start-up. Its log ends with:\n{tail}")
        ok = all(port_open(port) for port in ports)
        if ok and url:
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    ok = r.status == 200
            except (urllib.error.URLError, OSError):
                ok = False
        if ok:
            return
        time.sleep(0.05)
    tail = _log_tail(logdir / f"{name}.log")
    raise ProcError(
        f"{name} was not ready within {timeout:.0f}s (ports {ports}{', ' + url if url else ''}). Log tail:\n{tail}"
    )


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------- /proc sampling


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def tree(root: int) -> list[int]:
    """root and all its descendants (taskset execs in place, so root is the system itself)."""
    kids = _children_map()
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def cpu_seconds(pids: list[int]) -> float:
    """utime+stime of the processes (all their threads), in seconds."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After the ")" field 0 is state; utime and stime are fields 14 and 15 of stat (1-based).
        total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def _status_kb(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_kb(pids: list[int]) -> int:
    return sum(_status_kb(pid, "VmRSS") for pid in pids)


def anon_kb(pids: list[int]) -> int:
    """Sum of RssAnon: the memory the processes allocated, without the pages of their binaries
    and libraries, whose count follows the page cache (fault-around) more than the program."""
    return sum(_status_kb(pid, "RssAnon") for pid in pids)


def peak_rss_kb(pids: list[int]) -> int:
    """Sum of VmHWM (peak resident set) over the processes."""
    return sum(_status_kb(pid, "VmHWM") for pid in pids)


@dataclass
class Usage:
    cpu_s: float
    peak_rss_kb: int


def host_cpu_seconds() -> float:
    """Busy time of the whole machine, all CPUs (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


class Meter:
    """CPU and peak memory of a system's process trees (one per node) across one measurement,
    and the busy time of the whole host: a system whose work the kernel does in other
    processes' context (tier K) shows little CPU of its own, so the host figure is the fair
    comparison."""

    def __init__(self, roots: list[int]):
        self.roots = list(roots)
        self.pids: list[int] = [pid for root in self.roots for pid in tree(root)]
        self.cpu0 = cpu_seconds(self.pids)
        self.host0 = host_cpu_seconds()

    def host_cpu_s(self) -> float:
        """Busy CPU seconds of the host (load generator, backends, system and kernel) so far."""
        return host_cpu_seconds() - self.host0

    def finish(self) -> Usage | None:
        if not self.roots:
            return None
        # Re-walk the trees: a system may have forked helpers during the run.
        pids = sorted(set(self.pids) | {pid for root in self.roots for pid in tree(root)})
        return Usage(cpu_seconds(pids) - self.cpu0, peak_rss_kb(pids))
