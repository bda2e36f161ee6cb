"""The idle_connections scenarios' client: opens N keep-alive connections (HTTP/1.1, or h2c with
prior knowledge), sends one request on each and reads its answer, then holds them all open and
idle until told to close.

    python -m fmbench.idleconns PORT PATH CONNECTIONS CONCURRENCY TIMEOUT_S [h1|h2]

An h2c connection is held the way an idle gRPC client holds one: it keeps reading, acknowledges
the server's SETTINGS and answers its PINGs, and opens no more streams.

Protocol with the harness (loadgen.run_idle), one line each:
- stdout `HOLDING <json>` once every connection has had its answer (or failed): the harness
  now reads the proxy's memory;
- stdin: any line (or EOF) closes the connections;
- stdout `DONE <json>`: the result.

At most CONCURRENCY connections are being opened at once, so a proxy's upstream pool stays small
and what is measured is the cost of the downstream connections it holds. A connection that is
refused, reset, times out or gets an answer other than 200 counts as an error, with the first
few reasons kept.
"""

from __future__ import annotations

import asyncio
import json
import struct
import sys
import time
from collections.abc import Awaitable, Callable

from fmbench.procs import ProcError, raise_fd_limit

HOST = "127.0.0.1"
# Reasons kept for the report: enough to see what went wrong, bounded for 10,000 failures.
MAX_REASONS = 5


async def read_answer(reader: asyncio.StreamReader) -> int:
    """Reads one HTTP/1.1 response with a Content-Length body; returns its status."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    if length:
        await reader.readexactly(length)
    return status


# ---------------------------------------------------------------- h2c (RFC 9113), just enough

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
END_STREAM, ACK, PADDED, PRIORITY = 0x1, 0x1, 0x8, 0x20
# The largest frame the client accepts (SETTINGS_MAX_FRAME_SIZE's default): a bound on what a
# misbehaving server can make it buffer.
MAX_FRAME = 16_384


def h2_frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer (RFC 7541, 5.1) with `first`'s high bits in the first byte."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = [first | limit]
    value -= limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def h2_request_block(authority: str, path: str) -> bytes:
    """GET `path` over http: :method and :scheme from the static table, :path and :authority
    as literals without indexing (RFC 7541, 6.2.2), no Huffman coding."""

    def literal(name_index: int, value: str) -> bytes:
        v = value.encode()
        return hpack_int(name_index, 4) + hpack_int(len(v), 7) + v

    return b"\x82\x86" + literal(4, path) + literal(1, authority)


def h2_request(port: int, path: str) -> bytes:
    """The preface, empty SETTINGS and stream 1's GET, in one write."""
    block = h2_request_block(f"{HOST}:{port}", path)
    return H2_PREFACE + h2_frame(SETTINGS, 0, 0) + h2_frame(HEADERS, 0x4 | END_STREAM, 1, block)


async def h2_next_frame(reader: asyncio.StreamReader) -> tuple[int, int, int, bytes]:
    head = await reader.readexactly(9)
    length = int.from_bytes(head[:3], "big")
    if length > MAX_FRAME:
        raise ValueError(f"a {length}-byte frame, over {MAX_FRAME}")
    stream = int.from_bytes(head[5:9], "big") & 0x7FFF_FFFF
    return head[3], head[4], stream, await reader.readexactly(length)


def h2_control(writer: asyncio.StreamWriter, kind: int, flags: int, payload: bytes) -> None:
    """Acknowledges SETTINGS and answers PING, as every client must; raises on GOAWAY."""
    if kind == SETTINGS and not flags & ACK:
        writer.write(h2_frame(SETTINGS, ACK, 0))
    elif kind == PING and not flags & ACK:
        writer.write(h2_frame(PING, ACK, 0, payload))
    elif kind == GOAWAY:
        raise RuntimeError("GOAWAY")


def h2_status(flags: int, block: bytes) -> int:
    """The :status of a response HEADERS frame. Every server measured sends 200 as the static
    table's entry 8 (0x88); anything else is reported by its first byte, not decoded."""
    if flags & PADDED:
        block = block[1 : len(block) - block[0]] if block else b""
    if flags & PRIORITY:
        block = block[5:]
    if block[:1] == b"\x88":
        return 200
    raise RuntimeError(f"response header block starts {block[:1].hex() or 'empty'}, not :status 200")


async def read_h2_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
    """Reads frames until stream 1 ends; returns its status."""
    status = 0
    while True:
        kind, flags, stream, payload = await h2_next_frame(reader)
        if stream == 0:
            h2_control(writer, kind, flags, payload)
            continue
        if stream != 1:
            continue
        if kind == RST_STREAM:
            raise RuntimeError("stream reset")
        if kind == HEADERS and not status:
            status = h2_status(flags, payload)
        if kind in (DATA, HEADERS) and flags & END_STREAM:
            return status


async def keep_answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """While held: acknowledge and answer the server's control frames until it closes."""
    try:
        while True:
            kind, flags, stream, payload = await h2_next_frame(reader)
            if stream == 0:
                h2_control(writer, kind, flags, payload)
    except (OSError, asyncio.IncompleteReadError, ValueError, RuntimeError):
        writer.close()


# ---------------------------------------------------------------- the connections


async def open_one(port: int, request: bytes, timeout: float, h2: bool = False):
    """One connection with its request answered: (reader, writer, latency in µs), or the error."""
    start = time.perf_counter()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), timeout)
    try:
        writer.write(request)
        answer = read_h2_answer(reader, writer) if h2 else read_answer(reader)
        status = await asyncio.wait_for(answer, timeout)
    except BaseException:
        writer.close()
        raise
    if status != 200:
        writer.close()
        raise RuntimeError(f"status {status}")
    return reader, writer, (time.perf_counter() - start) * 1e6


async def hold(
    port: int,
    path: str,
    connections: int,
    concurrency: int,
    timeout: float,
    holding: Callable[[dict], None],
    release: Callable[[], Awaitable[object]],
    h2: bool = False,
) -> dict:
    """Opens the connections, calls `holding` with the summary once all have their answer,
    holds them until `release` returns, then closes them and returns the result."""
    if h2:
        request = h2_request(port, path)
    else:
        request = f"GET {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n".encode()
    answering: list[asyncio.Task] = []
    gate = asyncio.Semaphore(concurrency)
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    latencies: list[float] = []
    reasons: list[str] = []
    errors = 0

    async def one() -> None:
        nonlocal errors
        async with gate:
            try:
                reader, writer, us = await open_one(port, request, timeout, h2)
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, RuntimeError) as e:
                errors += 1
                if len(reasons) < MAX_REASONS:
                    reasons.append(f"{type(e).__name__}: {e}")
                return
        held.append((reader, writer))
        latencies.append(us)
        if h2:
            answering.append(asyncio.create_task(keep_answering(reader, writer)))

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(connections)))
    opened_s = time.perf_counter() - start
    summary = {"held": len(held), "errors": errors, "reasons": reasons, "open_s": round(opened_s, 3)}
    holding(summary)
    await release()
    # Still open? A proxy that dropped idle connections while they were held shows here as EOF
    # (the loop kept reading while it waited).
    closed_meanwhile = sum(1 for r, w in held if r.at_eof() or w.transport.is_closing())
    for task in answering:
        task.cancel()
    for _, w in held:
        w.close()
    summary.update({"latencies_us": latencies, "closed_while_held": closed_meanwhile})
    return summary


if __name__ == "__main__":
    if len(sys.argv) not in (6, 7) or sys.argv[6:] not in ([], ["h1"], ["h2"]):
        raise SystemExit(__doc__)
    port, path, n, conc, timeout = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    use_h2 = sys.argv[6:] == ["h2"]
    try:
        raise_fd_limit(n + 64)
    except ProcError as e:
        raise SystemExit(f"idleconns: {e}")

    async def stdin_line() -> object:
        # Hold until the harness has measured: any line on stdin, or EOF.
        return await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    def say_holding(summary: dict) -> None:
        print("HOLDING " + json.dumps(summary), flush=True)

    result = asyncio.run(hold(port, path, n, conc, timeout, say_holding, stdin_line, use_h2))
    print("DONE " + json.dumps(result), flush=True)
