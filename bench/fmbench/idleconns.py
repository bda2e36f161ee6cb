"""The idle_connections scenario's client: opens N HTTP/1.1 keep-alive connections, sends one
request on each and reads its answer, then holds them all open and idle until told to close.

    python -m fmbench.idleconns PORT PATH CONNECTIONS CONCURRENCY TIMEOUT_S

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


async def open_one(port: int, request: bytes, timeout: float):
    """One connection with its request answered: (reader, writer, latency in µs), or the error."""
    start = time.perf_counter()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), timeout)
    try:
        writer.write(request)
        status = await asyncio.wait_for(read_answer(reader), timeout)
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
) -> dict:
    """Opens the connections, calls `holding` with the summary once all have their answer,
    holds them until `release` returns, then closes them and returns the result."""
    request = f"GET {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n".encode()
    gate = asyncio.Semaphore(concurrency)
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    latencies: list[float] = []
    reasons: list[str] = []
    errors = 0

    async def one() -> None:
        nonlocal errors
        async with gate:
            try:
                reader, writer, us = await open_one(port, request, timeout)
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, RuntimeError) as e:
                errors += 1
                if len(reasons) < MAX_REASONS:
                    reasons.append(f"{type(e).__name__}: {e}")
                return
        held.append((reader, writer))
        latencies.append(us)

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(connections)))
    opened_s = time.perf_counter() - start
    summary = {"held": len(held), "errors": errors, "reasons": reasons, "open_s": round(opened_s, 3)}
    holding(summary)
    await release()
    # Still open? A proxy that dropped idle connections while they were held shows here as EOF
    # (the loop kept reading while it waited).
    closed_meanwhile = sum(1 for r, w in held if r.at_eof() or w.transport.is_closing())
    for _, w in held:
        w.close()
    summary.update({"latencies_us": latencies, "closed_while_held": closed_meanwhile})
    return summary


if __name__ == "__main__":
    if len(sys.argv) != 6:
        raise SystemExit(__doc__)
    port, path, n, conc, timeout = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    try:
        raise_fd_limit(n + 64)
    except ProcError as e:
        raise SystemExit(f"idleconns: {e}")

    async def stdin_line() -> object:
        # Hold until the harness has measured: any line on stdin, or EOF.
        return await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    def say_holding(summary: dict) -> None:
        print("HOLDING " + json.dumps(summary), flush=True)

    result = asyncio.run(hold(port, path, n, conc, timeout, say_holding, stdin_line))
    print("DONE " + json.dumps(result), flush=True)
