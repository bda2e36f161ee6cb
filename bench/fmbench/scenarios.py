"""The scenario definitions: one data structure each, from which every system's config is generated.

A scenario is a topology (listeners -> routes -> clusters -> backend ports), one
or more load points (the tool and its parameters; sweeps have several points),
and the checks that prove a system routes correctly before it is timed.

Port plan (all on 127.0.0.1):
  18080+i   backend nginx, HTTP/1.1, answers "svc-i\\n" for cluster svc-i
  18180+i   the same backend speaking h2c (prior knowledge), for "direct" HTTP/2
  18090     gRPC echo backend (grpc-backend/)
  18100     sockperf server
  18110     iperf3 server
  19080     system under test: HTTP listener
  19100     system under test: TCP listener
  19200     the mTLS scenarios' server node (the client node listens on 19080/19100)
  19000/1   admin ports of flatmesh / Envoy (the client node's in the mTLS scenarios)
  19002/3   admin ports of the server node of flatmesh / Envoy in the mTLS scenarios
  18120     the tracing scenarios' OTLP/gRPC collector (Jaeger, or one that never answers)
  18121     Jaeger's query API (tracing scenarios)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

HOST = "127.0.0.1"
N_SERVICES = 10
HTTP_BACKEND_BASE = 18080
H2C_BACKEND_BASE = 18180
GRPC_BACKEND_PORT = 18090
SOCKPERF_PORT = 18100
IPERF_PORT = 18110
OTLP_PORT = 18120
JAEGER_QUERY_PORT = 18121
SUT_HTTP_PORT = 19080
SUT_TCP_PORT = 19100
HOP_PORT = 19200  # the server node of a two-node (mTLS) pair
HOP_CLUSTER = "server-node"  # the client node's cluster of the server node
NO_ROUTE_PATH = "/no-such-route/x"


def svc_body(i: int) -> str:
    """Body the backend answers for cluster svc-i; the checks compare against it."""
    return f"svc-{i}\n"


@dataclass(frozen=True)
class Route:
    kind: str  # "exact" | "prefix" | "regex" (regex is matched against the whole path)
    value: str
    cluster: str


@dataclass(frozen=True)
class Cluster:
    name: str
    port: int
    protocol: str = "http1"  # upstream protocol: "http1" | "http2" | "tcp"
    # Originate mutual TLS to the endpoint (the client node's certificate, the server node's
    # SPIFFE ID checked); the systems take the certificates from certs.py.
    tls: bool = False
    # HBONE: carry each connection as an HTTP/2 CONNECT to this port of the endpoint's node,
    # `:authority` the endpoint (flatmesh's `tunnel: hbone`, `tunnel_port`).
    tunnel_port: int | None = None


@dataclass(frozen=True)
class Listener:
    name: str
    port: int
    protocol: str  # "http" | "tcp" | "hbone"
    routes: tuple[Route, ...] = ()
    cluster: str | None = None  # tcp listeners only
    # Downstream speaks HTTP/2 (h2c prior knowledge). flatmesh and Envoy detect it
    # on their own; nginx 1.22 needs an h2-only port, so its generator reads this.
    h2: bool = False
    # Terminate mutual TLS: a client certificate is required and its SPIFFE ID must be the
    # client node's.
    tls: bool = False


@dataclass(frozen=True)
class Topology:
    listeners: tuple[Listener, ...]
    clusters: tuple[Cluster, ...]
    # Every resilience policy of issue 17 on every route and cluster, set so that none is
    # triggered (systems.py writes each system's equivalent); only systems with all of them
    # take part.
    policies: bool = False
    # Two proxies in a row over mutual TLS (issue 16): "tls" (the client node's cluster
    # originates mTLS to the server node's listener) or "hbone" (an HBONE tunnel). The
    # listeners and clusters above are then the logical path; `mtls_pair` splits it in two.
    mtls: str | None = None
    # Distributed tracing (issue 22): the share of requests sampled, exported over OTLP/gRPC to
    # the collector on OTLP_PORT (the "jaeger" or "stalled_collector" backend).
    trace_sample: float | None = None
    # Client connections the system must hold at once when more than its usual limits allow
    # (the idle_connections scenario): each system's connection caps are raised above it.
    hold_connections: int | None = None

    def cluster(self, name: str) -> Cluster:
        for c in self.clusters:
            if c.name == name:
                return c
        raise KeyError(f"scenario topology has no cluster {name!r}")


@dataclass(frozen=True)
class Check:
    """A correctness check run against every system before it is timed.

    kind "http":  GET path over HTTP/1.1, expect status and body.
    kind "h2":    GET path over h2c (nghttp), expect body.
    kind "grpc":  grpc-backend -check: unary and bidi echo round trips.
    kind "tcp":   a short run of the scenario's own tool must succeed.
    """

    kind: str
    path: str = "/"
    status: int = 200
    body: str | None = None
    routed_only: bool = False  # skip for "direct" (the backend answers every path)


@dataclass(frozen=True)
class Load:
    tool: str  # wrk | h2load | ghz | fortio | sockperf | iperf3 | idle (fmbench.idleconns)
    duration: float  # seconds
    params: dict = field(default_factory=dict)
    x: float | None = None  # sweep coordinate (QPS, connections)


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    topology: Topology
    listener: str  # the SUT listener the load goes to
    path: str  # request path (HTTP scenarios)
    direct_port: int  # where "direct" sends the same load
    points: tuple[Load, ...]
    checks: tuple[Check, ...]
    backends: frozenset[str]  # which backends must run: http, grpc, sockperf, iperf3
    unit: str = "req"  # what one "request" is: req, round trip, stream; "byte" for iperf3
    sweep: str | None = None  # axis name for sweep scenarios
    quick: bool = False  # part of --quick
    # After the timed points, one more run of the first point under `perf record` on the
    # system's processes, for the share of CPU in TLS (profile.py); not part of the timings.
    profile: bool = False

    def listener_port(self) -> int:
        for lst in self.topology.listeners:
            if lst.name == self.listener:
                return lst.port
        raise KeyError(f"scenario {self.name} has no listener {self.listener!r}")


# ---------------------------------------------------------------- topologies


def _services() -> tuple[Cluster, ...]:
    return tuple(Cluster(f"svc-{i}", HTTP_BACKEND_BASE + i) for i in range(N_SERVICES))


def ten_routes(h2: bool = False, policies: bool = False) -> Topology:
    """Issue 2's benchmark table: 10 prefix routes, each to its own cluster."""
    routes = tuple(Route("prefix", f"/svc{i}/", f"svc-{i}") for i in range(N_SERVICES))
    return Topology((Listener("web", SUT_HTTP_PORT, "http", routes, h2=h2),), _services(), policies)


THOUSAND_TARGET = 998  # a late route, and a regex one: every earlier route is tried first


def thousand_routes() -> Topology:
    """1,000 routes cycling exact / prefix / regex; route i goes to svc-(i % 10)."""
    routes = []
    for i in range(1000):
        cluster = f"svc-{i % N_SERVICES}"
        kind = ("exact", "prefix", "regex")[i % 3]
        value = {"exact": f"/r{i}/exact", "prefix": f"/r{i}/", "regex": f"^/r{i}/[0-9]+$"}[kind]
        routes.append(Route(kind, value, cluster))
    return Topology((Listener("web", SUT_HTTP_PORT, "http", tuple(routes)),), _services())


def grpc_topology() -> Topology:
    return Topology(
        (Listener("grpc", SUT_HTTP_PORT, "http", (Route("prefix", "/", "grpc"),), h2=True),),
        (Cluster("grpc", GRPC_BACKEND_PORT, "http2"),),
    )


def tcp_topology(name: str, port: int) -> Topology:
    return Topology((Listener(name, SUT_TCP_PORT, "tcp", cluster=name),), (Cluster(name, port, "tcp"),))


def mtls_pair(topo: Topology) -> tuple[Topology, Topology]:
    """The two nodes of an mTLS topology: (client node, server node).

    "tls": the client node keeps the listener's port and protocol and sends everything to the
    server node over mutual TLS; the server node serves the topology's own listener (its
    routes or its cluster) on HOP_PORT, requiring the client node's certificate.
    "hbone": the client node's tcp listener carries each connection through an HBONE tunnel
    to the server node's hbone listener, which delivers it to the backend the tunnel names.
    """
    if topo.mtls not in ("tls", "hbone") or len(topo.listeners) != 1:
        raise ValueError(f"mtls_pair needs one listener and mtls 'tls' or 'hbone', not {topo.mtls!r}")
    lst = topo.listeners[0]
    if topo.mtls == "hbone":
        backend = topo.cluster(lst.cluster)
        client = Topology(
            (Listener(lst.name, lst.port, "tcp", cluster=HOP_CLUSTER),),
            (Cluster(HOP_CLUSTER, backend.port, "tcp", tls=True, tunnel_port=HOP_PORT),),
        )
        return client, Topology((Listener(f"{lst.name}-in", HOP_PORT, "hbone", tls=True),), ())
    if lst.protocol == "tcp":
        front = Listener(lst.name, lst.port, "tcp", cluster=HOP_CLUSTER)
        hop = Cluster(HOP_CLUSTER, HOP_PORT, "tcp", tls=True)
    else:
        front = Listener(lst.name, lst.port, "http", (Route("prefix", "/", HOP_CLUSTER),), h2=lst.h2)
        hop = Cluster(HOP_CLUSTER, HOP_PORT, "http1", tls=True)
    server = Topology((replace(lst, port=HOP_PORT, tls=True),), topo.clusters, topo.policies)
    return Topology((front,), (hop,)), server


# ---------------------------------------------------------------- scenarios

TARGET = N_SERVICES - 1  # the 10-route scenarios hit the last route
TEN_PATH = f"/svc{TARGET}/item"
TEN_CHECKS = (
    Check("http", TEN_PATH, 200, svc_body(TARGET)),
    Check("http", "/svc3/other", 200, svc_body(3), routed_only=True),
    Check("http", NO_ROUTE_PATH, 404, None, routed_only=True),
)
FIXED_QPS = (1000, 2500, 5000, 10000, 15000)
IDLE_CONNECTIONS = 10_000
CONNECTIONS = (1, 2, 4, 8, 16, 32, 64)
WRK_CONNS = 32


def all_scenarios(scale: float = 1.0) -> list[Scenario]:
    """Every scenario; `scale` multiplies all durations (quick mode shortens them)."""

    def d(seconds: float) -> float:
        return max(1.0, round(seconds * scale, 1))

    thousand_path = f"/r{THOUSAND_TARGET}/42"
    return [
        Scenario(
            name="http1_keepalive",
            title="HTTP/1.1 keep-alive, 10 prefix routes (wrk, 32 connections)",
            topology=ten_routes(),
            listener="web",
            path=TEN_PATH,
            direct_port=HTTP_BACKEND_BASE + TARGET,
            points=(Load("wrk", d(10), {"connections": WRK_CONNS}),),
            checks=TEN_CHECKS,
            backends=frozenset({"http"}),
            quick=True,
        ),
        Scenario(
            # Issue 17's cost of resilience: the same load as http1_keepalive, with a circuit
            # breaker, outlier detection, active health checks, retries with backoff and a budget,
            # a rate limit, fault injection, mirroring, endpoint weights and slow start on every
            # route and cluster, none of them triggered. Judged on flatmesh's CPU per request
            # against its own http1_keepalive in the same run, and on req/s against Envoy with
            # the same features.
            name="http1_policies",
            title="HTTP/1.1 keep-alive, 10 routes, every resilience policy on, none triggered (wrk, 32 connections)",
            topology=ten_routes(policies=True),
            listener="web",
            path=TEN_PATH,
            direct_port=HTTP_BACKEND_BASE + TARGET,
            points=(Load("wrk", d(10), {"connections": WRK_CONNS}),),
            checks=TEN_CHECKS,
            backends=frozenset({"http"}),
        ),
        # Issue 22's cost of tracing: the same load as http1_keepalive with a span per sampled
        # request exported to a real Jaeger, at 1% and at 100%; then 100% to a collector that
        # accepts connections and never answers (back-pressure: the queue fills and drops).
        # Judged on flatmesh's CPU per request and p99 against its own http1_keepalive.
        *(
            Scenario(
                name=name,
                title=f"HTTP/1.1 keep-alive, 10 routes, tracing {title} (wrk, 32 connections)",
                topology=replace(ten_routes(), trace_sample=sample),
                listener="web",
                path=TEN_PATH,
                direct_port=HTTP_BACKEND_BASE + TARGET,
                points=(Load("wrk", d(10), {"connections": WRK_CONNS}),),
                checks=TEN_CHECKS,
                backends=frozenset({"http", collector}),
            )
            for name, title, sample, collector in (
                ("http1_tracing_1pct", "1% sampled to Jaeger", 0.01, "jaeger"),
                ("http1_tracing_100pct", "100% sampled to Jaeger", 1.0, "jaeger"),
                ("http1_tracing_stalled", "100% sampled to a collector that never answers", 1.0, "stalled_collector"),
            )
        ),
        Scenario(
            name="http1_1000_routes",
            title=f"HTTP/1.1 keep-alive, 1,000 routes (exact/prefix/regex), request hits route #{THOUSAND_TARGET} (regex)",
            topology=thousand_routes(),
            listener="web",
            path=thousand_path,
            direct_port=HTTP_BACKEND_BASE + THOUSAND_TARGET % N_SERVICES,
            points=(Load("wrk", d(10), {"connections": WRK_CONNS}),),
            checks=(
                Check("http", thousand_path, 200, svc_body(THOUSAND_TARGET % N_SERVICES)),
                Check("http", "/r0/exact", 200, svc_body(0), routed_only=True),
                Check("http", "/r0/exact/no", 404, None, routed_only=True),
                Check("http", "/r997/anything", 200, svc_body(7), routed_only=True),
                Check("http", "/r998/not-a-number", 404, None, routed_only=True),
            ),
            backends=frozenset({"http"}),
        ),
        Scenario(
            name="http1_new_connection",
            title="HTTP/1.1, a new connection per request (wrk, Connection: close, 16 connections)",
            topology=ten_routes(),
            listener="web",
            path=TEN_PATH,
            direct_port=HTTP_BACKEND_BASE + TARGET,
            points=(Load("wrk", d(6), {"connections": 16, "close": True}),),
            checks=TEN_CHECKS,
            backends=frozenset({"http"}),
        ),
        Scenario(
            name="http2",
            title="HTTP/2 (h2c), 16 connections x 10 streams (h2load)",
            topology=ten_routes(h2=True),
            listener="web",
            path=TEN_PATH,
            direct_port=H2C_BACKEND_BASE + TARGET,
            points=(Load("h2load", d(10), {"connections": 16, "streams": 10}),),
            checks=(Check("h2", TEN_PATH, 200, svc_body(TARGET)),),
            backends=frozenset({"http"}),
        ),
        Scenario(
            name="grpc_unary",
            title="gRPC unary, 16 connections (ghz)",
            topology=grpc_topology(),
            listener="grpc",
            path="/bench.Echo/Unary",
            direct_port=GRPC_BACKEND_PORT,
            points=(Load("ghz", d(10), {"call": "bench.Echo.Unary", "connections": 16, "concurrency": 16}),),
            checks=(Check("grpc"),),
            backends=frozenset({"grpc"}),
        ),
        Scenario(
            # The per-request latency the kernel tier's gRPC target is about (the eBPF L7 proxy
            # paper: nginx 1.58 ms -> 1.03 ms). grpc_unary saturates ghz, so its p50 is mostly
            # queueing in the client and the backend. One call at a time (closed loop, like
            # sockperf's ping-pong) has no queue and no pacing timer: its p50 is the path's.
            name="grpc_latency",
            title="gRPC unary latency, one call at a time on 1 connection (ghz -c 1)",
            topology=grpc_topology(),
            listener="grpc",
            path="/bench.Echo/Unary",
            direct_port=GRPC_BACKEND_PORT,
            points=(Load("ghz", d(10), {"call": "bench.Echo.Unary", "connections": 1, "concurrency": 1}),),
            checks=(Check("grpc"),),
            backends=frozenset({"grpc"}),
        ),
        Scenario(
            name="grpc_stream",
            title="gRPC bidi streaming, 10 messages per stream, 16 connections (ghz)",
            topology=grpc_topology(),
            listener="grpc",
            path="/bench.Echo/Bidi",
            direct_port=GRPC_BACKEND_PORT,
            points=(
                Load("ghz", d(10), {"call": "bench.Echo.Bidi", "connections": 16, "concurrency": 16, "messages": 10}),
            ),
            checks=(Check("grpc"),),
            backends=frozenset({"grpc"}),
            unit="stream",
        ),
        Scenario(
            # Issue 19, item 5: the memory a proxy spends on idle keep-alive connections. Each
            # connection sends one request (at most 64 being opened at once, so upstream pools
            # stay small), then all are held idle for a few seconds and the system's RSS is read.
            name="idle_connections",
            title=f"{IDLE_CONNECTIONS:,} idle HTTP/1.1 keep-alive connections, one request each (RSS while held)",
            topology=replace(ten_routes(), hold_connections=IDLE_CONNECTIONS),
            listener="web",
            path=TEN_PATH,
            direct_port=HTTP_BACKEND_BASE + TARGET,
            points=(Load("idle", d(5), {"connections": IDLE_CONNECTIONS, "concurrency": 64}),),
            checks=TEN_CHECKS,
            backends=frozenset({"http"}),
            unit="connection",
        ),
        Scenario(
            # The same over h2c: each connection keeps reading and answers PINGs, as an idle
            # gRPC client's does.
            name="idle_connections_h2",
            title=f"{IDLE_CONNECTIONS:,} idle h2c connections, one request each (RSS while held)",
            topology=replace(ten_routes(h2=True), hold_connections=IDLE_CONNECTIONS),
            listener="web",
            path=TEN_PATH,
            direct_port=H2C_BACKEND_BASE + TARGET,
            points=(Load("idle", d(5), {"connections": IDLE_CONNECTIONS, "concurrency": 64, "protocol": "h2"}),),
            checks=(Check("h2", TEN_PATH, 200, svc_body(TARGET)),),
            backends=frozenset({"http"}),
            unit="connection",
        ),
        Scenario(
            name="fixed_rate",
            title="Latency at fixed request rates, HTTP/1.1, 16 connections (fortio; FlatProxy Fig. 17)",
            topology=ten_routes(),
            listener="web",
            path=TEN_PATH,
            direct_port=HTTP_BACKEND_BASE + TARGET,
            points=tuple(Load("fortio", d(6), {"qps": q, "connections": 16}, x=q) for q in FIXED_QPS),
            checks=TEN_CHECKS,
            backends=frozenset({"http"}),
            sweep="offered load (req/s)",
        ),
        Scenario(
            name="connections",
            title="Throughput as concurrent connections grow, HTTP/1.1 keep-alive (wrk; FlatProxy Fig. 18b)",
            topology=ten_routes(),
            listener="web",
            path=TEN_PATH,
            direct_port=HTTP_BACKEND_BASE + TARGET,
            points=tuple(Load("wrk", d(4), {"connections": c}, x=c) for c in CONNECTIONS),
            checks=TEN_CHECKS,
            backends=frozenset({"http"}),
            sweep="concurrent connections",
        ),
        Scenario(
            name="tcp_pingpong",
            title="TCP ping-pong, 64 B messages (sockperf; latency is sockperf's half round trip)",
            topology=tcp_topology("sockperf", SOCKPERF_PORT),
            listener="sockperf",
            path="",
            direct_port=SOCKPERF_PORT,
            points=(Load("sockperf", d(10), {"msg_size": 64}),),
            checks=(Check("tcp"),),
            backends=frozenset({"sockperf"}),
            unit="round trip",
            quick=True,
        ),
        Scenario(
            name="tcp_throughput",
            title="TCP bulk throughput, one stream (iperf3)",
            topology=tcp_topology("iperf3", IPERF_PORT),
            listener="iperf3",
            path="",
            direct_port=IPERF_PORT,
            points=(Load("iperf3", d(6), {}),),
            checks=(Check("tcp"),),
            backends=frozenset({"iperf3"}),
            unit="byte",
        ),
        # Issue 16, "Speed": two proxies in a row (client node -> server node) over mutual TLS,
        # TLS 1.3 with the certificates of certs.py; both nodes on CPU 1.
        Scenario(
            name="mtls_bulk",
            title="mTLS between two nodes: bulk throughput, one stream (iperf3 -> client node -> mTLS -> server node -> iperf3)",
            topology=replace(tcp_topology("iperf3", IPERF_PORT), mtls="tls"),
            listener="iperf3",
            path="",
            direct_port=IPERF_PORT,
            points=(Load("iperf3", d(6), {}),),
            checks=(Check("tcp"),),
            backends=frozenset({"iperf3"}),
            unit="byte",
            profile=True,
        ),
        Scenario(
            name="mtls_http1",
            title="mTLS between two nodes: HTTP/1.1 keep-alive, 10 routes on the server node (wrk, 32 connections)",
            topology=replace(ten_routes(), mtls="tls"),
            listener="web",
            path=TEN_PATH,
            direct_port=HTTP_BACKEND_BASE + TARGET,
            points=(Load("wrk", d(10), {"connections": WRK_CONNS}),),
            checks=TEN_CHECKS,
            backends=frozenset({"http"}),
        ),
        Scenario(
            # tcp listeners: each client connection (wrk, Connection: close) is relayed over
            # its own new connection between the nodes, so every request is one new mTLS
            # handshake (an http listener would pool its connections to the server node).
            name="mtls_new_conn",
            title="mTLS between two nodes: a new mTLS connection per request (wrk, Connection: close, 16 connections, tcp relays)",
            topology=replace(tcp_topology("web", HTTP_BACKEND_BASE + TARGET), mtls="tls"),
            listener="web",
            path=TEN_PATH,
            direct_port=HTTP_BACKEND_BASE + TARGET,
            points=(Load("wrk", d(6), {"connections": 16, "close": True}),),
            checks=(Check("http", TEN_PATH, 200, svc_body(TARGET)),),
            backends=frozenset({"http"}),
            unit="connection",
        ),
        Scenario(
            name="mtls_hbone_bulk",
            title="HBONE between two nodes: bulk throughput, one stream, HTTP/2 CONNECT inside mTLS (iperf3; flatmesh only)",
            topology=replace(tcp_topology("iperf3", IPERF_PORT), mtls="hbone"),
            listener="iperf3",
            path="",
            direct_port=IPERF_PORT,
            points=(Load("iperf3", d(6), {}),),
            checks=(Check("tcp"),),
            backends=frozenset({"iperf3"}),
            unit="byte",
        ),
    ]


QUICK_SCALE = 0.3


def select(names: list[str] | None, quick: bool, scale: float | None = None) -> list[Scenario]:
    """The scenarios to run: the named ones, else all (or the quick ones with --quick)."""
    pool = all_scenarios(scale if scale is not None else (QUICK_SCALE if quick else 1.0))
    if not names:
        return [s for s in pool if s.quick] if quick else pool
    by_name = {s.name: s for s in pool}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(
            f"unknown scenario(s): {', '.join(unknown)}. Known: {', '.join(by_name)} (see bench/run --list)."
        )
    return [by_name[n] for n in names]
