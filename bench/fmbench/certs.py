"""The certificates of the mTLS scenarios, issued once per run by flatmesh's own CA.

`flatmesh ca init` writes a root and `flatmesh ca issue` one X.509 SVID per node; flatmesh and
Envoy load the very same files, so both pairs present the same keys and chains.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

TRUST_DOMAIN = "bench.flatmesh"
CLIENT_ID = f"spiffe://{TRUST_DOMAIN}/ns/bench/sa/client-node"
SERVER_ID = f"spiffe://{TRUST_DOMAIN}/ns/bench/sa/server-node"


class CertError(RuntimeError):
    pass


@dataclass(frozen=True)
class Certs:
    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.pem"

    def cert(self, node: str) -> Path:
        """PEM of `node` ("client" or "server"): the leaf, then its chain."""
        return self.dir / f"{node}.pem"

    def key(self, node: str) -> Path:
        return self.dir / f"{node}.key"


def issue(directory: Path, flatmesh: Path) -> Certs:
    """A fresh root and the two nodes' SVIDs in `directory` (emptied of earlier ones first)."""
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*"):
        old.unlink()
    steps = [
        [str(flatmesh), "ca", "init", "--trust-domain", TRUST_DOMAIN, "--dir", str(directory)],
        [str(flatmesh), "ca", "issue", "--dir", str(directory), "--id", CLIENT_ID, "--out", str(directory / "client")],
        [str(flatmesh), "ca", "issue", "--dir", str(directory), "--id", SERVER_ID, "--out", str(directory / "server")],
    ]
    for argv in steps:
        try:
            p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise CertError(f"`{' '.join(argv)}` could not run: {e}")
        if p.returncode != 0:
            raise CertError(f"`{' '.join(argv)}` failed (exit {p.returncode}): {p.stdout.strip()[-400:]}")
    certs = Certs(directory)
    for f in (certs.ca, certs.cert("client"), certs.key("client"), certs.cert("server"), certs.key("server")):
        if not f.is_file():
            raise CertError(f"flatmesh ca did not write {f}")
    return certs
