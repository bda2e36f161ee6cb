"""What two nodes really negotiated, read off the wire: the TLS 1.3 ServerHellos on the
loopback interface, sniffed with a packet socket while the correctness checks run.

The ServerHello is the last plaintext message of a TLS 1.3 handshake: it names the cipher
suite, and carries a `pre_shared_key` extension exactly when the server accepted a session
resumption. Reading it on the wire checks flatmesh and Envoy the same way, whatever each
reports about itself. Needs root (a packet socket); without it the run says so.
"""

from __future__ import annotations

import socket
import struct
import threading

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4  # loopback frames are seen twice; keep the incoming copy only
SUITES = {
    0x1301: "TLS_AES_128_GCM_SHA256",
    0x1302: "TLS_AES_256_GCM_SHA384",
    0x1303: "TLS_CHACHA20_POLY1305_SHA256",
}
EXT_SUPPORTED_VERSIONS = 0x002B
EXT_PRE_SHARED_KEY = 0x0029
# A HelloRetryRequest is a ServerHello with this random (RFC 8446, 4.1.3).
HRR_RANDOM = bytes.fromhex("CF21AD74E59A6111BE1D8C021E65B891C2A211167ABB8C5E079E09E2C8A8339C")


class WireError(RuntimeError):
    pass


def parse_server_hello(payload: bytes) -> dict | None:
    """The suite, version and resumption of a ServerHello at the start of a TCP payload."""
    # TLS record: type 22 (handshake), version, length; then handshake type 2 (ServerHello).
    if len(payload) < 9 or payload[0] != 0x16 or payload[5] != 0x02:
        return None
    body = payload[9:]
    try:
        random = body[2:34]
        sid_len = body[34]
        at = 35 + sid_len
        suite = struct.unpack_from("!H", body, at)[0]
        at += 3  # suite, compression method
        ext_end = at + 2 + struct.unpack_from("!H", body, at)[0]
        at += 2
        version, resumed = "TLSv1.2", False
        while at + 4 <= min(ext_end, len(body)):
            ext, size = struct.unpack_from("!HH", body, at)
            if ext == EXT_SUPPORTED_VERSIONS and size == 2 and struct.unpack_from("!H", body, at + 4)[0] == 0x0304:
                version = "TLSv1.3"
            elif ext == EXT_PRE_SHARED_KEY:
                resumed = True
            at += 4 + size
    except (IndexError, struct.error):
        return None
    if random == HRR_RANDOM:
        return None
    return {"suite": SUITES.get(suite, f"0x{suite:04x}"), "version": version, "resumed": resumed}


def parse_frame(frame: bytes, server_port: int) -> dict | None:
    """A ServerHello sent from `server_port` in an Ethernet/IPv4/TCP frame (loopback's framing)."""
    if len(frame) < 14 + 20 or frame[12:14] != b"\x08\x00":
        return None
    ip = frame[14:]
    if ip[0] >> 4 != 4 or ip[9] != 6:
        return None
    tcp = ip[(ip[0] & 0x0F) * 4 :]
    if len(tcp) < 20 or struct.unpack_from("!H", tcp, 0)[0] != server_port:
        return None
    return parse_server_hello(tcp[(tcp[12] >> 4) * 4 :])


def summarize(hellos: list[dict]) -> dict:
    """Handshakes seen, how many were resumptions, and the suites and versions negotiated."""
    out: dict = {"handshakes": len(hellos), "resumed": sum(h["resumed"] for h in hellos), "suites": {}, "versions": {}}
    for h in hellos:
        out["suites"][h["suite"]] = out["suites"].get(h["suite"], 0) + 1
        out["versions"][h["version"]] = out["versions"].get(h["version"], 0) + 1
    return out


def describe(summary: dict | None) -> str:
    """"591 handshakes, 97% resumed, TLS_AES_128_GCM_SHA256" (or why they were not read)."""
    if not summary:
        return "not read"
    if "error" in summary:
        return f"not read: {summary['error']}"
    if not summary["handshakes"]:
        return "no handshake seen"
    suites = summary["suites"]
    names = ", ".join(k if len(suites) == 1 else f"{k} ×{v}" for k, v in suites.items())
    return f"{summary['handshakes']} handshakes, {100 * summary['resumed'] / summary['handshakes']:.0f}% resumed, {names}"


class HelloSniffer:
    """Collects the ServerHellos sent from `port` on the loopback interface until `stop()`."""

    def __init__(self, port: int):
        self.port = port
        self.hellos: list[dict] = []
        self._done = threading.Event()
        try:
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            self.sock.bind(("lo", 0))
        except (OSError, AttributeError) as e:
            raise WireError(f"cannot sniff the loopback interface (needs root and AF_PACKET): {e}")
        self.sock.settimeout(0.1)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            try:
                frame, addr = self.sock.recvfrom(65536)
            except socket.timeout:
                continue
            except OSError:
                return
            if addr[2] == PACKET_OUTGOING:
                continue
            hello = parse_frame(frame, self.port)
            if hello:
                self.hellos.append(hello)

    def stop(self) -> dict:
        """Ends the capture (again: a no-op) and summarises what it saw."""
        if not self._done.is_set():
            self._done.set()
            self._thread.join(2)
            self.sock.close()
        return summarize(self.hellos)
