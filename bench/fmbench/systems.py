"""Systems under test: each turns a scenario topology into its own config and a start command.

Adding a system (e.g. "flatmesh+kernel" or "flatmesh+shm" once those tiers exist)
means adding one entry to `registry()`: a `Flatmesh` with extra top-level config
keys and/or an environment for the load generator (an LD_PRELOAD for the
shared-memory path), or a new `System` subclass.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from . import paths
from .certs import CLIENT_ID, SERVER_ID, Certs
from .scenarios import HOP_PORT, HOST, OTLP_PORT, Listener, Scenario, Topology, mtls_pair

FLATMESH_ADMIN = 19000
ENVOY_ADMIN = 19001
# The server node's admin ports in the mTLS scenarios (the client node keeps the ones above).
FLATMESH_SERVER_ADMIN = 19002
ENVOY_SERVER_ADMIN = 19003
NGINX_STREAM_MODULE = "/usr/lib/nginx/modules/ngx_stream_module.so"


class SystemError_(RuntimeError):
    """A system cannot be set up; the message says what to do."""


@dataclass
class Launch:
    """How to start one process of a system: argv (without taskset), an optional readiness
    URL, env additions; `name` (its log file) and `ports` (where it listens) are filled in by
    `System.launches` when left empty."""

    argv: list[str]
    ready_url: str | None = None
    env: dict = field(default_factory=dict)
    name: str = ""
    ports: list[int] = field(default_factory=list)


class System:
    name: str = ""
    is_proxy: bool = True  # "direct" is the only non-proxy
    # Environment for the load generator (e.g. LD_PRELOAD of a shared-memory shim).
    client_env: dict = {}
    # The mTLS scenarios' certificates; the runner issues them once per run (certs.py).
    certs: Certs | None = None

    def supports(self, scenario: Scenario) -> tuple[bool, str]:
        return True, ""

    def available(self) -> tuple[bool, str]:
        return True, ""

    def target_port(self, scenario: Scenario) -> int:
        return scenario.listener_port()

    def launch(self, scenario: Scenario, workdir: Path) -> Launch | None:
        raise NotImplementedError

    def launches(self, scenario: Scenario, workdir: Path) -> list[Launch]:
        """Every process of the system, in start order (two nodes in the mTLS scenarios)."""
        launch = self.launch(scenario, workdir)
        if launch is None:
            return []
        launch.name = launch.name or self.name
        launch.ports = launch.ports or [lst.port for lst in scenario.topology.listeners]
        return [launch]

    def pair_certs(self) -> Certs:
        if self.certs is None:
            raise SystemError_(f"{self.name}: the mTLS scenarios need certificates; the runner issues them (certs.issue)")
        return self.certs

    def after_ready(self, workdir: Path) -> None:
        """Checks run once the system is ready, before its correctness checks (raise
        SystemError_ to refuse measuring it)."""


# ---------------------------------------------------------------- direct


class Direct(System):
    name = "direct"
    is_proxy = False

    def target_port(self, scenario: Scenario) -> int:
        return scenario.direct_port

    def supports(self, scenario: Scenario) -> tuple[bool, str]:
        if scenario.topology.hold_connections:
            return False, "no proxy: the backend holds the connections, and there is no system process whose memory to read"
        return True, ""

    def launch(self, scenario: Scenario, workdir: Path) -> Launch | None:
        return None


def connection_cap(topo: Topology, usual: int) -> int:
    """A system's cap on open connections: its usual one, or room for the connections the
    scenario holds (plus the checks and the upstream pools)."""
    return max(usual, (topo.hold_connections or 0) + 1000)


# ---------------------------------------------------------------- flatmesh


def _yaml_scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    # JSON strings are valid YAML double-quoted scalars.
    return json.dumps(str(v))


def to_yaml(obj, indent: int = 0) -> str:
    """A small YAML emitter for plain dicts/lists/scalars, so the generated config reads like the docs."""
    pad = "  " * indent
    lines: list[str] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, (dict, list)) and v:
                lines.append(f"{pad}{k}:")
                lines.append(to_yaml(v, indent + 1))
            elif isinstance(v, (dict, list)):
                lines.append(f"{pad}{k}: {'{}' if isinstance(v, dict) else '[]'}")
            else:
                lines.append(f"{pad}{k}: {_yaml_scalar(v)}")
    elif isinstance(obj, list):
        for item in obj:
            if isinstance(item, (dict, list)) and item:
                body = to_yaml(item, indent + 1).lstrip()
                lines.append(f"{pad}- {body}")
            else:
                lines.append(f"{pad}- {_yaml_scalar(item)}")
    else:
        lines.append(f"{pad}{_yaml_scalar(obj)}")
    return "\n".join(lines)


# ---------------------------------------------------------------- the policies scenario
#
# Issue 17's resilience policies, each set so that nothing triggers: the limits are far above
# the load, the rate limit far above any req/s here, the faults and the mirror at 0 percent, the
# health check passes (the backend answers every path), outlier detection never sees a 5xx, and
# slow start's window is over long before the timed run (the node is warmed up first). The same
# set for flatmesh and Envoy; HAProxy and nginx have no like-for-like config for all of it and
# sit this scenario out.

MIRROR_CLUSTER = "svc-0"
BREAKER = {"max_connections": 1024, "max_pending": 1024, "max_requests": 1024, "max_retries": 3}
RATE_PER_S = 10_000_000


def flatmesh_route_policies() -> dict:
    return {
        "retries": {
            "attempts": 2,
            "on": ["connect-failure", "gateway-error"],
            "per_try_timeout": "5s",
            "backoff": {"base": "25ms", "max": "250ms"},
            "budget": {"ratio": 0.2, "min_per_s": 10},
        },
        "rate_limit": {"requests_per_s": RATE_PER_S, "burst": RATE_PER_S},
        "fault": {"abort": {"status": 503, "percent": 0}, "delay": {"duration": "1s", "percent": 0}},
        "mirror": {"cluster": MIRROR_CLUSTER, "percent": 0},
    }


def flatmesh_cluster_policies() -> dict:
    return {
        "circuit_breaker": dict(BREAKER),
        "outlier_detection": {
            "consecutive_5xx": 5,
            "consecutive_connect_failures": 5,
            "interval": "10s",
            "base_ejection_time": "30s",
            "max_ejection_percent": 34,
        },
        "health_check": {
            "http": {"path": "/healthz"},
            "interval": "5s",
            "timeout": "1s",
            "unhealthy_threshold": 3,
            "healthy_threshold": 2,
        },
        "slow_start": {"window": "1s"},
    }


def _envoy_percent(value: int) -> dict:
    return {"numerator": value, "denominator": "HUNDRED"}


def envoy_route_policies() -> dict:
    """The route action's share of the policies (retries and the mirror)."""
    return {
        "retry_policy": {
            "retry_on": "connect-failure,gateway-error",
            "num_retries": 2,
            "per_try_timeout": "5s",
            "retry_back_off": {"base_interval": "0.025s", "max_interval": "0.25s"},
        },
        "request_mirror_policies": [
            {"cluster": MIRROR_CLUSTER, "runtime_fraction": {"default_value": _envoy_percent(0)}}
        ],
    }


def envoy_policy_filters() -> list[dict]:
    """The HTTP filters ahead of the router: the rate limit and fault injection."""
    return [
        {
            "name": "envoy.filters.http.local_ratelimit",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
                "stat_prefix": "rate_limit",
                "token_bucket": {"max_tokens": RATE_PER_S, "tokens_per_fill": RATE_PER_S, "fill_interval": "1s"},
                "filter_enabled": {"runtime_key": "rl_enabled", "default_value": _envoy_percent(100)},
                "filter_enforced": {"runtime_key": "rl_enforced", "default_value": _envoy_percent(100)},
            },
        },
        {
            "name": "envoy.filters.http.fault",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault",
                "abort": {"http_status": 503, "percentage": _envoy_percent(0)},
                "delay": {"fixed_delay": "1s", "percentage": _envoy_percent(0)},
            },
        },
    ]


def envoy_cluster_policies() -> dict:
    return {
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": BREAKER["max_connections"],
                    "max_pending_requests": BREAKER["max_pending"],
                    "max_requests": BREAKER["max_requests"],
                    "max_retries": BREAKER["max_retries"],
                    "retry_budget": {"budget_percent": {"value": 20.0}, "min_retry_concurrency": 10},
                }
            ]
        },
        "outlier_detection": {
            "consecutive_5xx": 5,
            "consecutive_local_origin_failure": 5,
            "split_external_local_origin_errors": True,
            "interval": "10s",
            "base_ejection_time": "30s",
            "max_ejection_percent": 34,
        },
        "health_checks": [
            {
                "timeout": "1s",
                "interval": "5s",
                "unhealthy_threshold": 3,
                "healthy_threshold": 2,
                "http_health_check": {"path": "/healthz"},
            }
        ],
        "round_robin_lb_config": {"slow_start_config": {"slow_start_window": "1s"}},
    }


def flatmesh_listener_tls(certs: Certs) -> dict:
    """The server node's listener: its SVID; the client node's certificate required."""
    return {
        "cert": str(certs.cert("server")),
        "key": str(certs.key("server")),
        "client_ca": str(certs.ca),
        "allow": [CLIENT_ID],
    }


def flatmesh_cluster_tls(certs: Certs) -> dict:
    """The client node's cluster of the server node: the server node's ID checked, the
    client node's SVID presented."""
    return {
        "ca": str(certs.ca),
        "cert": str(certs.cert("client")),
        "key": str(certs.key("client")),
        "server_ids": [SERVER_ID],
    }


def flatmesh_config(
    topo: Topology, extra: dict | None = None, admin: int = FLATMESH_ADMIN, certs: Certs | None = None
) -> dict:
    needs_tls = any(lst.tls for lst in topo.listeners) or any(c.tls for c in topo.clusters)
    if needs_tls and certs is None:
        raise SystemError_("this topology speaks mTLS: flatmesh_config needs the certificates")
    listeners = []
    for lst in topo.listeners:
        entry: dict = {"name": lst.name, "address": f"{HOST}:{lst.port}", "protocol": lst.protocol}
        if lst.tls:
            entry["tls"] = flatmesh_listener_tls(certs)
        if lst.protocol == "hbone":
            pass  # tunnels name their destination; the default allows loopback only
        elif lst.protocol == "tcp":
            entry["cluster"] = lst.cluster
        else:
            entry["routes"] = [{"match": {"path": {r.kind: r.value}}, "cluster": r.cluster} for r in lst.routes]
            if topo.policies:
                for route in entry["routes"]:
                    route.update(flatmesh_route_policies())
        listeners.append(entry)
    clusters = []
    for c in topo.clusters:
        entry = {"name": c.name, "endpoints": [f"{HOST}:{c.port}"]}
        if c.protocol == "http2":
            entry["protocol"] = "http2"
        if c.tunnel_port is not None:
            entry["tunnel"] = "hbone"
            entry["tunnel_port"] = c.tunnel_port
        if c.tls:
            entry["tls"] = flatmesh_cluster_tls(certs)
        if topo.policies:
            entry["endpoints"] = [{"address": f"{HOST}:{c.port}", "weight": 1}]
            entry.update(flatmesh_cluster_policies())
        clusters.append(entry)
    cfg: dict = {"admin": f"{HOST}:{admin}", "workers": 1}
    if topo.hold_connections:
        cfg["limits"] = {"max_connections": connection_cap(topo, 10_000)}
    if topo.trace_sample is not None:
        cfg["tracing"] = {"otlp": f"{HOST}:{OTLP_PORT}", "sample": topo.trace_sample, "service_name": "flatmesh-bench"}
    cfg.update(extra or {})
    kernel = cfg.get("kernel")
    if kernel and kernel.get("l7_dispatch") and not any(lst.protocol == "http" for lst in topo.listeners):
        # L7 dispatch needs an http listener (the node refuses the config otherwise); a tcp-only
        # scenario measures the rest of tier K.
        cfg["kernel"] = {k: v for k, v in kernel.items() if k != "l7_dispatch"}
    cfg["listeners"] = listeners
    cfg["clusters"] = clusters
    return cfg


def find_flatmesh() -> Path | None:
    """The release binary: $FLATMESH_BIN, else $CARGO_TARGET_DIR/release, else target/release."""
    candidates = []
    if os.environ.get("FLATMESH_BIN"):
        candidates.append(Path(os.environ["FLATMESH_BIN"]))
    if os.environ.get("CARGO_TARGET_DIR"):
        candidates.append(Path(os.environ["CARGO_TARGET_DIR"]) / "release" / "flatmesh")
    candidates.append(paths.REPO / "target" / "release" / "flatmesh")
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    return None


class Flatmesh(System):
    def __init__(self, name: str = "flatmesh", extra: dict | None = None, client_env: dict | None = None):
        self.name = name
        self.extra = extra or {}
        self.client_env = client_env or {}
        self.binary: Path | None = None

    def available(self) -> tuple[bool, str]:
        if self.binary is None:
            self.binary = find_flatmesh()
        if self.binary is None:
            return False, (
                "flatmesh release binary not found; build it with `cargo build --release -p flatmesh`, "
                "or pass --flatmesh PATH / set FLATMESH_BIN"
            )
        return True, str(self.binary)

    def supports(self, scenario: Scenario) -> tuple[bool, str]:
        if scenario.topology.mtls and self.name != "flatmesh":
            return False, "the mTLS scenarios compare the plain user-space nodes (tier K never decides a TLS listener)"
        return True, ""

    def _write(self, scenario: Scenario, workdir: Path, suffix: str, cfg: dict) -> Path:
        path = workdir / f"{self.name.replace('+', '-')}{suffix}.yaml"
        path.write_text(f"# generated by bench/run for scenario {scenario.name}\n" + to_yaml(cfg) + "\n")
        return path

    def _node(self, path: Path, admin: int, name: str, ports: list[int]) -> Launch:
        return Launch([str(self.binary), "node", "--config", str(path)], f"http://{HOST}:{admin}/ready", name=name, ports=ports)

    def launch(self, scenario: Scenario, workdir: Path) -> Launch:
        cfg = self._write(scenario, workdir, "", flatmesh_config(scenario.topology, self.extra))
        return Launch([str(self.binary), "node", "--config", str(cfg)], f"http://{HOST}:{FLATMESH_ADMIN}/ready")

    def launches(self, scenario: Scenario, workdir: Path) -> list[Launch]:
        if not scenario.topology.mtls:
            return super().launches(scenario, workdir)
        certs = self.pair_certs()
        client, server = mtls_pair(scenario.topology)
        s = self._write(scenario, workdir, "-server-node", flatmesh_config(server, None, FLATMESH_SERVER_ADMIN, certs))
        c = self._write(scenario, workdir, "-client-node", flatmesh_config(client, None, FLATMESH_ADMIN, certs))
        return [
            self._node(s, FLATMESH_SERVER_ADMIN, f"{self.name}-server-node", [HOP_PORT]),
            self._node(c, FLATMESH_ADMIN, f"{self.name}-client-node", [lst.port for lst in client.listeners]),
        ]


# ---------------------------------------------------------------- Envoy


def _envoy_route(r, policies: bool = False) -> dict:
    if r.kind == "exact":
        m = {"path": r.value}
    elif r.kind == "prefix":
        m = {"prefix": r.value}
    else:
        m = {"safe_regex": {"regex": r.value}}
    action = {"cluster": r.cluster}
    if policies:
        action.update(envoy_route_policies())
    return {"match": m, "route": action}


# The mTLS scenarios' TLS for Envoy: TLS 1.3 only. BoringSSL has no setting for the TLS 1.3
# suites (`cipher_suites` applies to TLS 1.2 and below, so it names the AES-128-GCM ones only
# to keep the intent plain); with AES instructions it picks TLS_AES_128_GCM_SHA256. The run
# reads the suite and the resumptions of every handshake between the nodes off the wire
# (wire.py), for both systems.
#
# Session resumption: flatmesh has no setting to turn it off (rustls's defaults: the client
# node keeps up to 256 sessions, the server node sends two TLS 1.3 tickets per connection), so
# Envoy keeps it on too, with as many sessions kept as rustls keeps (its default of 1 would
# make most of its new connections full handshakes where flatmesh's are resumed).
ENVOY_MAX_SESSION_KEYS = 256
ENVOY_TLS_PARAMS = {
    "tls_minimum_protocol_version": "TLSv1_3",
    "tls_maximum_protocol_version": "TLSv1_3",
    "cipher_suites": ["ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-RSA-AES128-GCM-SHA256"],
}


def _envoy_common_tls(certs: Certs, node: str, peer_id: str, alpn: list[str]) -> dict:
    ctx = {
        "tls_params": dict(ENVOY_TLS_PARAMS),
        "tls_certificates": [
            {"certificate_chain": {"filename": str(certs.cert(node))}, "private_key": {"filename": str(certs.key(node))}}
        ],
        "validation_context": {
            "trusted_ca": {"filename": str(certs.ca)},
            "match_typed_subject_alt_names": [{"san_type": "URI", "matcher": {"exact": peer_id}}],
        },
    }
    if alpn:
        ctx["alpn_protocols"] = alpn
    return ctx


def envoy_downstream_tls(certs: Certs, http: bool) -> dict:
    """The server node's listener: its SVID; the client node's certificate required, by SPIFFE ID."""
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            "require_client_certificate": True,
            "common_tls_context": _envoy_common_tls(certs, "server", CLIENT_ID, ["h2", "http/1.1"] if http else []),
        },
    }


def envoy_upstream_tls(certs: Certs, http: bool) -> dict:
    """The client node's cluster of the server node: the server node's SPIFFE ID checked."""
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "common_tls_context": _envoy_common_tls(certs, "client", SERVER_ID, ["http/1.1"] if http else []),
            "max_session_keys": ENVOY_MAX_SESSION_KEYS,
        },
    }


OTLP_CLUSTER = "otlp-collector"


def envoy_tracing(sample: float) -> dict:
    """The HCM's tracing: Envoy's OpenTelemetry tracer, OTLP/gRPC to the same collector as
    flatmesh's, sampling the same share of requests."""
    return {
        "random_sampling": {"value": sample * 100},
        "provider": {
            "name": "envoy.tracers.opentelemetry",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
                "grpc_service": {"envoy_grpc": {"cluster_name": OTLP_CLUSTER}, "timeout": "1s"},
                "service_name": "envoy-bench",
            },
        },
    }


def _envoy_listener(
    lst: Listener, policies: bool = False, certs: Certs | None = None, trace_sample: float | None = None
) -> dict:
    addr = {"socket_address": {"address": HOST, "port_value": lst.port}}
    if lst.protocol == "tcp":
        flt = {
            "name": "envoy.filters.network.tcp_proxy",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                "stat_prefix": lst.name,
                "cluster": lst.cluster,
            },
        }
    else:
        flt = {
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": lst.name,
                "codec_type": "AUTO",
                "route_config": {
                    "name": lst.name,
                    "virtual_hosts": [
                        {"name": "all", "domains": ["*"], "routes": [_envoy_route(r, policies) for r in lst.routes]}
                    ],
                },
                "http_filters": (envoy_policy_filters() if policies else []) + [
                    {
                        "name": "envoy.filters.http.router",
                        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
                    }
                ],
            },
        }
        if trace_sample is not None:
            flt["typed_config"]["tracing"] = envoy_tracing(trace_sample)
    chain: dict = {"filters": [flt]}
    if lst.tls:
        chain["transport_socket"] = envoy_downstream_tls(certs, http=lst.protocol == "http")
    return {"name": lst.name, "address": addr, "filter_chains": [chain]}


def envoy_config(topo: Topology, admin: int = ENVOY_ADMIN, certs: Certs | None = None) -> dict:
    if topo.mtls == "hbone" or any(lst.protocol == "hbone" for lst in topo.listeners):
        raise SystemError_(NO_ENVOY_HBONE)
    needs_tls = any(lst.tls for lst in topo.listeners) or any(c.tls for c in topo.clusters)
    if needs_tls and certs is None:
        raise SystemError_("this topology speaks mTLS: envoy_config needs the certificates")
    clusters = []
    for c in topo.clusters:
        entry = {
            "name": c.name,
            "type": "STATIC",
            "connect_timeout": "2s",
            "load_assignment": {
                "cluster_name": c.name,
                "endpoints": [
                    {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": HOST, "port_value": c.port}}}}]}
                ],
            },
        }
        if topo.policies:
            entry["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["load_balancing_weight"] = 1
            entry.update(envoy_cluster_policies())
        if c.tls:
            entry["transport_socket"] = envoy_upstream_tls(certs, http=c.protocol != "tcp")
        if c.protocol == "http2":
            entry["typed_extension_protocol_options"] = {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}},
                }
            }
        clusters.append(entry)
    if topo.trace_sample is not None:
        clusters.append(
            {
                "name": OTLP_CLUSTER,
                "type": "STATIC",
                "connect_timeout": "2s",
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                        "explicit_http_config": {"http2_protocol_options": {}},
                    }
                },
                "load_assignment": {
                    "cluster_name": OTLP_CLUSTER,
                    "endpoints": [
                        {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": HOST, "port_value": OTLP_PORT}}}}]}
                    ],
                },
            }
        )
    return {
        "admin": {"address": {"socket_address": {"address": HOST, "port_value": admin}}},
        "static_resources": {
            "listeners": [_envoy_listener(lst, topo.policies, certs, topo.trace_sample) for lst in topo.listeners],
            "clusters": clusters,
        },
    }


NO_ENVOY_HBONE = (
    "not configured for Envoy: its HBONE client is tcp_proxy tunneling_config (crates/xds/tests/envoy_hbone.rs), "
    "but the server side (CONNECT termination into an internal listener) is not set up here, so this is flatmesh "
    "only and not like for like"
)


class Envoy(System):
    name = "envoy"

    def supports(self, scenario: Scenario) -> tuple[bool, str]:
        return (False, NO_ENVOY_HBONE) if scenario.topology.mtls == "hbone" else (True, "")

    def available(self) -> tuple[bool, str]:
        b = paths.envoy_bin()
        return (b.exists(), str(b) if b.exists() else "envoy not installed; run bench/run without --no-install")

    def _launch(self, cfg: dict, path: Path, admin: int) -> Launch:
        path.write_text(json.dumps(cfg, indent=1))
        argv = [
            str(paths.envoy_bin()),
            "-c", str(path),
            "--concurrency", "1",
            "--disable-hot-restart",
            "--log-level", "warning",
        ]
        return Launch(argv, f"http://{HOST}:{admin}/ready")

    def launch(self, scenario: Scenario, workdir: Path) -> Launch:
        return self._launch(envoy_config(scenario.topology), workdir / "envoy.json", ENVOY_ADMIN)

    def launches(self, scenario: Scenario, workdir: Path) -> list[Launch]:
        if not scenario.topology.mtls:
            return super().launches(scenario, workdir)
        certs = self.pair_certs()
        client, server = mtls_pair(scenario.topology)
        s = self._launch(envoy_config(server, ENVOY_SERVER_ADMIN, certs), workdir / "envoy-server-node.json", ENVOY_SERVER_ADMIN)
        s.name, s.ports = "envoy-server-node", [HOP_PORT]
        c = self._launch(envoy_config(client, ENVOY_ADMIN, certs), workdir / "envoy-client-node.json", ENVOY_ADMIN)
        c.name, c.ports = "envoy-client-node", [lst.port for lst in client.listeners]
        return [s, c]

    def stats_urls(self, scenario: Scenario) -> list[str]:
        """The admin stats of every node, for the TLS counters of the mTLS scenarios."""
        admins = [ENVOY_SERVER_ADMIN, ENVOY_ADMIN] if scenario.topology.mtls else [ENVOY_ADMIN]
        return [f"http://{HOST}:{a}/stats?filter=ssl" for a in admins]


# ---------------------------------------------------------------- HAProxy


def haproxy_config(topo: Topology) -> str:
    out = [
        "# generated by bench/run",
        "global",
        "  nbthread 1",
        f"  maxconn {connection_cap(topo, 8000)}",
        # HAProxy reserves two descriptors per connection and by default refuses to start when
        # the limit is below that; idle client connections share a few server ones, so holding
        # them needs one each (a machine whose hard limit is 20,000 holds 10,000).
        *(["  no strict-limits"] if topo.hold_connections else []),
        "defaults",
        "  timeout connect 2s",
        "  timeout client 60s",
        "  timeout server 60s",
        "  timeout http-keep-alive 60s",
    ]
    backends_mode = {}
    for lst in topo.listeners:
        if lst.protocol == "tcp":
            c = topo.cluster(lst.cluster)
            out += [f"listen {lst.name}", "  mode tcp", f"  bind {HOST}:{lst.port}", f"  server s1 {HOST}:{c.port}"]
            continue
        out += [f"frontend {lst.name}", "  mode http", f"  bind {HOST}:{lst.port}"]
        for i, r in enumerate(lst.routes):
            fetch = {"exact": "path", "prefix": "path_beg", "regex": "path_reg"}[r.kind]
            out.append(f"  acl r{i} {fetch} {r.value}")
        for i, r in enumerate(lst.routes):
            out.append(f"  use_backend {r.cluster} if r{i}")
            backends_mode[r.cluster] = "http"
        out.append("  default_backend no_route")
    for name in backends_mode:
        c = topo.cluster(name)
        proto = " proto h2" if c.protocol == "http2" else ""
        out += [f"backend {name}", "  mode http", f"  server s1 {HOST}:{c.port}{proto}"]
    if backends_mode:
        out += [
            "backend no_route",
            "  mode http",
            '  http-request return status 404 content-type text/plain string "no route matched"',
        ]
    return "\n".join(out) + "\n"


NO_POLICIES = "no like-for-like config for every resilience policy (rate limit, fault injection, mirroring, retry budget)"
NO_MTLS = "the mTLS pair scenarios (issue 16) compare flatmesh with Envoy only"
NO_TRACING = "the tracing scenarios (issue 22) compare flatmesh with Envoy only (both export OTLP/gRPC spans)"


class Haproxy(System):
    name = "haproxy"

    def supports(self, scenario: Scenario) -> tuple[bool, str]:
        if scenario.topology.mtls:
            return False, NO_MTLS
        if scenario.topology.trace_sample is not None:
            return False, NO_TRACING
        return (False, NO_POLICIES) if scenario.topology.policies else (True, "")

    def available(self) -> tuple[bool, str]:
        b = shutil.which("haproxy")
        return (b is not None, b or "haproxy not installed (apt-get install haproxy)")

    def launch(self, scenario: Scenario, workdir: Path) -> Launch:
        cfg = workdir / "haproxy.cfg"
        cfg.write_text(haproxy_config(scenario.topology))
        # -db: stay in the foreground as one process (no master/worker, no daemon).
        return Launch(["haproxy", "-db", "-f", str(cfg)])


# ---------------------------------------------------------------- nginx (as a proxy)


def _nginx_location(r, grpc: bool) -> str:
    head = {"exact": f"location = {r.value}", "prefix": f"location ^~ {r.value}", "regex": f"location ~ {r.value}"}[r.kind]
    if grpc:
        body = f"grpc_pass grpc://{r.cluster};"
    else:
        body = f'proxy_pass http://{r.cluster}; proxy_http_version 1.1; proxy_set_header Connection "";'
    return f"    {head} {{ {body} }}"


def nginx_common(workdir: Path) -> list[str]:
    return [
        "worker_processes 1;",
        "daemon off;",
        f"pid {workdir}/nginx.pid;",
        f"error_log {workdir}/nginx-error.log warn;",
    ]


def nginx_http_tmp(workdir: Path) -> list[str]:
    t = workdir / "nginx-tmp"
    return [
        f"  client_body_temp_path {t}/body;",
        f"  proxy_temp_path {t}/proxy;",
        f"  fastcgi_temp_path {t}/fastcgi;",
        f"  uwsgi_temp_path {t}/uwsgi;",
        f"  scgi_temp_path {t}/scgi;",
    ]


def nginx_proxy_config(topo: Topology, workdir: Path) -> str:
    http_listeners = [lst for lst in topo.listeners if lst.protocol == "http"]
    tcp_listeners = [lst for lst in topo.listeners if lst.protocol == "tcp"]
    out = ["# generated by bench/run"]
    if tcp_listeners:
        out.append(f"load_module {NGINX_STREAM_MODULE};")
    out += nginx_common(workdir)
    cap = connection_cap(topo, 8192)
    if topo.hold_connections:
        out.append(f"worker_rlimit_nofile {cap + 1024};")
    out.append(f"events {{ worker_connections {cap}; }}")
    if http_listeners:
        out += ["http {", "  access_log off;", "  keepalive_requests 10000000;"] + nginx_http_tmp(workdir)
        used = {r.cluster for lst in http_listeners for r in lst.routes}
        for c in topo.clusters:
            if c.name in used:
                out.append(
                    f"  upstream {c.name} {{ server {HOST}:{c.port}; keepalive 64; keepalive_requests 10000000; }}"
                )
        for lst in http_listeners:
            grpc = any(topo.cluster(r.cluster).protocol == "http2" for r in lst.routes)
            h2 = " http2" if (lst.h2 or grpc) else ""
            out += ["  server {", f"    listen {HOST}:{lst.port}{h2};", "    default_type text/plain;"]
            out += [_nginx_location(r, grpc) for r in lst.routes]
            if not any(r.kind == "prefix" and r.value == "/" for r in lst.routes):
                out.append('    location / { return 404 "no route matched\\n"; }')
            out.append("  }")
        out.append("}")
    if tcp_listeners:
        out.append("stream {")
        for lst in tcp_listeners:
            c = topo.cluster(lst.cluster)
            out.append(f"  server {{ listen {HOST}:{lst.port}; proxy_pass {HOST}:{c.port}; }}")
        out.append("}")
    return "\n".join(out) + "\n"


class Nginx(System):
    name = "nginx"

    def available(self) -> tuple[bool, str]:
        b = shutil.which("nginx")
        return (b is not None, b or "nginx not installed (apt-get install nginx)")

    def supports(self, scenario: Scenario) -> tuple[bool, str]:
        if scenario.topology.mtls:
            return False, NO_MTLS
        if scenario.topology.policies:
            return False, NO_POLICIES
        if scenario.topology.trace_sample is not None:
            return False, NO_TRACING
        tcp = any(lst.protocol == "tcp" for lst in scenario.topology.listeners)
        if tcp and not os.path.exists(NGINX_STREAM_MODULE):
            return False, "nginx stream module missing (apt-get install libnginx-mod-stream)"
        return True, ""

    def launch(self, scenario: Scenario, workdir: Path) -> Launch:
        (workdir / "nginx-tmp").mkdir(exist_ok=True)
        cfg = workdir / "nginx-proxy.conf"
        cfg.write_text(nginx_proxy_config(scenario.topology, workdir))
        return Launch(["nginx", "-c", str(cfg), "-p", str(workdir)])


# ---------------------------------------------------------------- registry


class FlatmeshShm(Flatmesh):
    """flatmesh with the hetero-socket library (crates/shm, docs/shm.md) preloaded into the node
    and the load generator: the client-to-node hop runs over shared memory. (Statically linked
    load tools, ghz and fortio, ignore LD_PRELOAD and stay on TCP; the node-to-backend hop stays
    TCP unless the backends are preloaded too.)"""

    def __init__(self):
        super().__init__("flatmesh+shm")
        self.library: Path | None = None

    def available(self) -> tuple[bool, str]:
        ok, why = super().available()
        if not ok:
            return ok, why
        candidates = [Path(os.environ["FLATMESH_SHM_LIB"])] if os.environ.get("FLATMESH_SHM_LIB") else []
        candidates.append(self.binary.parent / "libflatmesh_shm.so")
        self.library = next((c for c in candidates if c.is_file()), None)
        if self.library is None:
            return False, "libflatmesh_shm.so not found; build it with `cargo build --release -p flatmesh-shm` or set FLATMESH_SHM_LIB"
        self.client_env = {"LD_PRELOAD": str(self.library)}
        return True, f"{self.binary} + {self.library}"

    def launch(self, scenario: Scenario, workdir: Path) -> Launch:
        launch = super().launch(scenario, workdir)
        launch.env = {"LD_PRELOAD": str(self.library)}
        return launch


KERNEL_PIN_DIR = "/sys/fs/bpf/fmbench"


class FlatmeshKernel(Flatmesh):
    """flatmesh with tier K (crates/kernel, docs/kernel.md): tcp listeners go socket direct
    (the client's and the backend's sockets exchange payload through sk_msg, the node keeps
    the connections and their FIN/RST), and the http listener's first request is decided in
    the kernel (HTTP/1.1 request line, gRPC :path) and then handed to the kernel too. Needs
    root. The kernel does the moving in the sender's context, so the node's own CPU column
    is small by design: compare the host CPU column (every process and the kernel)."""

    def __init__(self):
        super().__init__(
            "flatmesh+kernel",
            extra={"kernel": {"pin_dir": KERNEL_PIN_DIR, "redirect": True, "l7_dispatch": True}},
        )

    def available(self) -> tuple[bool, str]:
        if os.geteuid() != 0:
            return False, "flatmesh+kernel attaches eBPF programs: run bench/run as root"
        return super().available()

    def after_ready(self, workdir: Path) -> None:
        """A node that could not attach tier K runs on the user tiers: refuse to measure it."""
        import subprocess

        p = subprocess.run(
            [str(self.binary), "kernel", "status", "--pin-dir", KERNEL_PIN_DIR],
            capture_output=True, text=True, timeout=10,
        )
        if "attached by pid" not in p.stdout:
            log = "\n".join(
                line for f in workdir.glob("*.log") for line in f.read_text(errors="replace").splitlines()
                if "tier K" in line
            )
            raise SystemError_(f"tier K is not attached, so this would measure the user tiers: {p.stdout.strip()} {log}")


def registry() -> dict[str, System]:
    """Every known system, in report order. Envoy is the reference for ratios."""
    systems: list[System] = [
        Flatmesh(),
        FlatmeshKernel(),
        FlatmeshShm(),
        Envoy(),
        Haproxy(),
        Nginx(),
        Direct(),
    ]
    return {s.name: s for s in systems}


DEFAULT_SYSTEMS = ["flatmesh", "envoy", "haproxy", "nginx", "direct"]
QUICK_SYSTEMS = ["flatmesh", "envoy", "direct"]
REFERENCE = "envoy"
