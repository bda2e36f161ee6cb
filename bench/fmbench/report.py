"""Turning raw records into medians, ratios to Envoy, a Markdown report, SVG plots and a terminal table."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from . import profile, svg, wire
from .scenarios import Scenario
from .systems import REFERENCE

LAT_KEYS = ("p50", "p90", "p99", "p999")
LAT_NAMES = {"p50": "p50", "p90": "p90", "p99": "p99", "p999": "p99.9"}


def _median(vals):
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def summarize(records: list[dict]) -> list[dict]:
    """Median over repeats per (scenario, x, system), with ratios to Envoy from the same run."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["scenario"], r["x"], r["system"])].append(r)
    rows = []
    for (scn, x, system), rs in groups.items():
        rows.append(
            {
                "scenario": scn,
                "x": x,
                "system": system,
                "repeats": len(rs),
                "rate": _median([r["rate"] for r in rs]),
                "lat_us": {k: _median([(r["lat_us"] or {}).get(k) for r in rs]) for k in LAT_KEYS},
                "cpu_per_unit": _median([r["cpu_per_unit"] for r in rs]),
                "host_cpu_per_unit": _median([r.get("host_cpu_per_unit") for r in rs]),
                "peak_rss_kb": _median([r["peak_rss_kb"] for r in rs]),
                "idle_rss_kb": _median([r["idle_rss_kb"] for r in rs]),
                "idle_anon_kb": _median([r.get("idle_anon_kb") for r in rs]),
                "held_rss_kb": _median([(r.get("raw") or {}).get("held_rss_kb") for r in rs]),
                "held": _median([(r.get("raw") or {}).get("held") for r in rs]),
                "errors": sum(r["errors"] for r in rs),
                "ops": sum(r["ops"] for r in rs),
                "hop_tls": merge_hop([r.get("hop_tls") for r in rs]),
                "profile": median_profile([r.get("profile") for r in rs]),
            }
        )
    ref = {(r["scenario"], r["x"]): r for r in rows if r["system"] == REFERENCE}
    direct = {(r["scenario"], r["x"]): r for r in rows if r["system"] == "direct"}
    for r in rows:
        e = ref.get((r["scenario"], r["x"]))
        r["rate_vs_envoy"] = _ratio(r["rate"], e["rate"] if e else None)
        r["p99_vs_envoy"] = _ratio(r["lat_us"]["p99"], e["lat_us"]["p99"] if e else None)
        r["cpu_vs_envoy"] = _ratio(r["cpu_per_unit"], e["cpu_per_unit"] if e else None)
        d = direct.get((r["scenario"], r["x"]))
        p50, dp50 = r["lat_us"]["p50"], (d["lat_us"]["p50"] if d else None)
        r["added_p50_us"] = (p50 - dp50) if (p50 is not None and dp50 is not None and r["system"] != "direct") else None
    return rows


def _ratio(a, b):
    return a / b if (a is not None and b) else None


def merge_hop(hops: list[dict | None]) -> dict | None:
    """The handshakes between two nodes over every repeat (wire.summarize's shape), or the
    reason they were not read."""
    seen = [h for h in hops if h and "error" not in h]
    if not seen:
        return next((h for h in hops if h), None)
    out: dict = {"handshakes": 0, "resumed": 0, "suites": {}, "versions": {}}
    for h in seen:
        out["handshakes"] += h["handshakes"]
        out["resumed"] += h["resumed"]
        for key in ("suites", "versions"):
            for k, v in h[key].items():
                out[key][k] = out[key].get(k, 0) + v
    return out


SHARES = ("tls", "kernel", "relay", "unresolved")


def median_profile(profiles: list[dict | None]) -> dict | None:
    """Median of each CPU share over the repeats (profile.shares), or why there is none."""
    seen = [p for p in profiles if p and "error" not in p]
    if not seen:
        return next((p for p in profiles if p), None)
    out = {k: _median([p.get(k, 0.0) for p in seen]) for k in SHARES}
    out["top_tls"] = seen[0].get("top_tls", [])
    return out




# ---------------------------------------------------------------- formatting


def f_lat(us) -> str:
    if us is None:
        return "–"
    return f"{us:.1f} µs" if us < 1000 else f"{us / 1000:.2f} ms"


def f_rate(v, unit: str) -> str:
    if v is None:
        return "–"
    if unit == "byte":
        return f"{v / 1e9:.2f} Gbit/s"
    return f"{v:,.0f}"


def f_x(v) -> str:
    return "–" if v is None else f"{v:.2f}×"


def f_mb(kb) -> str:
    return "–" if kb is None else f"{kb / 1024:.1f}"


def f_idle(r: dict) -> str:
    """Idle VmRSS, with the anonymous part (what the system allocated) beside it when known."""
    anon = r.get("idle_anon_kb")
    return f_mb(r["idle_rss_kb"]) + ("" if anon is None else f" ({f_mb(anon)})")


def f_cpu(v) -> str:
    return "–" if v is None else f"{v:.3f}"


def rate_header(s: Scenario) -> str:
    return {"byte": "throughput", "round trip": "round trips/s", "stream": "streams/s", "connection": "connections/s"}.get(s.unit, "req/s")


def cpu_header(s: Scenario) -> str:
    return "CPU s / GB" if s.unit == "byte" else f"CPU s / 10k {s.unit}s" if s.unit != "req" else "CPU s / 10k req"


def _order(systems: list[str], present: set[str]) -> list[str]:
    return [s for s in systems if s in present]


def scenario_table(s: Scenario, rows: list[dict], systems: list[str]) -> list[str]:
    rs = {r["system"]: r for r in rows if r["scenario"] == s.name}
    if not rs:
        return []
    if s.sweep:
        return sweep_table(s, rows, systems)
    if s.topology.hold_connections:
        return held_table(s, rows, systems)
    cols = [rate_header(s), "× Envoy", *(LAT_NAMES[k] for k in LAT_KEYS), "p99 × Envoy", cpu_header(s), "CPU × Envoy", "host " + cpu_header(s), "peak RSS MB", "idle RSS (anon) MB", "errors"]
    if s.name == "tcp_pingpong":
        cols.insert(6, "added p50 vs direct")
    out = ["| system | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name in _order(systems, set(rs)):
        r = rs[name]
        cells = [
            f_rate(r["rate"], s.unit),
            f_x(r["rate_vs_envoy"]),
            *(f_lat(r["lat_us"][k]) for k in LAT_KEYS),
            f_x(r["p99_vs_envoy"]),
            f_cpu(r["cpu_per_unit"]),
            f_x(r["cpu_vs_envoy"]),
            f_cpu(r.get("host_cpu_per_unit")),
            f_mb(r["peak_rss_kb"]),
            f_idle(r),
            str(r["errors"]),
        ]
        if s.name == "tcp_pingpong":
            cells.insert(6, f_lat(r["added_p50_us"]))
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def held_memory_per_connection_kb(r: dict) -> float | None:
    """What each held connection costs the system: (RSS while held - idle RSS) / connections."""
    held, idle, n = r.get("held_rss_kb"), r.get("idle_rss_kb"), r.get("held")
    if held is None or idle is None or not n:
        return None
    return (held - idle) / n


def held_table(s: Scenario, rows: list[dict], systems: list[str]) -> list[str]:
    """The idle_connections scenario: memory while the connections are held, per connection."""
    rs = {r["system"]: r for r in rows if r["scenario"] == s.name}
    per = {name: held_memory_per_connection_kb(r) for name, r in rs.items()}
    envoy = per.get(REFERENCE)
    cols = ["connections held", "idle RSS MB", "RSS held MB", "KiB per connection", "× Envoy", "opened/s", "p99 first request", cpu_header(s), "errors"]
    out = ["| system | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name in _order(systems, set(rs)):
        r = rs[name]
        kib = per[name]
        cells = [
            f"{r['held']:,.0f}" if r.get("held") is not None else "–",
            f_mb(r["idle_rss_kb"]),
            f_mb(r.get("held_rss_kb")),
            "–" if kib is None else f"{kib:.1f}",
            f_x(_ratio(kib, envoy)),
            f_rate(r["rate"], s.unit),
            f_lat(r["lat_us"]["p99"]),
            f_cpu(r["cpu_per_unit"]),
            str(r["errors"]),
        ]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def sweep_table(s: Scenario, rows: list[dict], systems: list[str]) -> list[str]:
    xs = sorted({r["x"] for r in rows if r["scenario"] == s.name})
    by = {(r["system"], r["x"]): r for r in rows if r["scenario"] == s.name}
    present = {r["system"] for r in rows if r["scenario"] == s.name}
    out = []
    if s.name == "fixed_rate":
        out.append("p50 / p99 latency at each offered rate (achieved rate below):")
        out.append("")
        head = [f"{x:,.0f}/s" for x in xs]
        out += ["| system | " + " | ".join(head) + " |", "|---" * (len(xs) + 1) + "|"]
        for name in _order(systems, present):
            cells = []
            for x in xs:
                r = by.get((name, x))
                cells.append("–" if not r else f"{f_lat(r['lat_us']['p50'])} / {f_lat(r['lat_us']['p99'])}")
            out.append(f"| {name} | " + " | ".join(cells) + " |")
        out += ["", "| achieved req/s | " + " | ".join(head) + " |", "|---" * (len(xs) + 1) + "|"]
        for name in _order(systems, present):
            cells = [f_rate(by[(name, x)]["rate"], s.unit) if (name, x) in by else "–" for x in xs]
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    else:
        out.append("req/s (p99) at each number of concurrent connections:")
        out.append("")
        head = [f"{x:g}" for x in xs]
        out += ["| system | " + " | ".join(head) + " |", "|---" * (len(xs) + 1) + "|"]
        for name in _order(systems, present):
            cells = []
            for x in xs:
                r = by.get((name, x))
                cells.append("–" if not r else f"{f_rate(r['rate'], s.unit)} ({f_lat(r['lat_us']['p99'])})")
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


# ---------------------------------------------------------------- issue-2 targets


MB15_KB = 15 * 1024


def targets(rows: list[dict]) -> list[dict]:
    """The issue-2 and issue-4 targets, each with the measured value and pass / FAIL / n/a."""

    def get(scn, system):
        for r in rows:
            if r["scenario"] == scn and r["system"] == system and r["x"] is None:
                return r
        return None

    fm, env, hap = get("http1_keepalive", "flatmesh"), get("http1_keepalive", "envoy"), get("http1_keepalive", "haproxy")
    out = []

    def add(name, ok, measured):
        out.append({"target": name, "status": "n/a" if ok is None else ("pass" if ok else "FAIL"), "measured": measured})

    if fm and env:
        x = fm["rate"] / env["rate"]
        add("req/s ≥ 2.5× Envoy (HTTP/1.1 keep-alive, 10 routes)", x >= 2.5, f"{fm['rate']:,.0f} vs {env['rate']:,.0f} req/s = {x:.2f}×")
        p, pe = fm["lat_us"]["p99"], env["lat_us"]["p99"]
        add("p99 ≤ ½ Envoy's", p <= pe / 2 if p and pe else None, f"{f_lat(p)} vs {f_lat(pe)} = {p / pe:.2f}×" if p and pe else "–")
    else:
        add("req/s ≥ 2.5× Envoy (HTTP/1.1 keep-alive, 10 routes)", None, "flatmesh or Envoy not measured")
        add("p99 ≤ ½ Envoy's", None, "flatmesh or Envoy not measured")
    if fm and hap:
        add("req/s ≥ HAProxy", fm["rate"] >= hap["rate"], f"{fm['rate']:,.0f} vs {hap['rate']:,.0f} req/s = {fm['rate'] / hap['rate']:.2f}×")
    else:
        add("req/s ≥ HAProxy", None, "flatmesh or HAProxy not measured")
    if fm and fm["idle_rss_kb"]:
        anon = f", {fm['idle_anon_kb'] / 1024:.1f} MB of it anonymous" if fm.get("idle_anon_kb") else ""
        add("idle RSS ≤ 15 MB", fm["idle_rss_kb"] <= MB15_KB, f"{fm['idle_rss_kb'] / 1024:.1f} MB{anon}" + (f" (Envoy {env['idle_rss_kb'] / 1024:.1f} MB)" if env and env["idle_rss_kb"] else ""))
    else:
        add("idle RSS ≤ 15 MB", None, "flatmesh not measured")
    fp, ep = get("tcp_pingpong", "flatmesh"), get("tcp_pingpong", "envoy")
    if fp and ep and fp["added_p50_us"] is not None and ep["added_p50_us"] is not None:
        a, b = fp["added_p50_us"], ep["added_p50_us"]
        add("sockperf added p50 ≤ ½ Envoy's added p50 (TCP, 64 B)", a <= b / 2, f"+{a:.1f} µs vs +{b:.1f} µs over direct")
    else:
        add("sockperf added p50 ≤ ½ Envoy's added p50 (TCP, 64 B)", None, "flatmesh, Envoy or direct not measured")
    # Issue 17: what the resilience policies cost, none of them triggered.
    pol, pol_env = get("http1_policies", "flatmesh"), get("http1_policies", "envoy")
    name = "policies: CPU per request ≤ 1.10× without them (flatmesh, HTTP/1.1 keep-alive)"
    if pol and fm and pol["cpu_per_unit"] and fm["cpu_per_unit"]:
        x = pol["cpu_per_unit"] / fm["cpu_per_unit"]
        add(name, x <= 1.10, f"{f_cpu(pol['cpu_per_unit'])} vs {f_cpu(fm['cpu_per_unit'])} = {x:.3f}×")
    else:
        add(name, None, "http1_policies or http1_keepalive not measured for flatmesh")
    name = "policies: req/s ≥ 2× Envoy's with the same policies"
    if pol and pol_env and pol_env["rate"]:
        x = pol["rate"] / pol_env["rate"]
        add(name, x >= 2, f"{pol['rate']:,.0f} vs {pol_env['rate']:,.0f} req/s = {x:.2f}× (CPU per request {f_cpu(pol['cpu_per_unit'])} vs {f_cpu(pol_env['cpu_per_unit'])})")
    else:
        add(name, None, "flatmesh or Envoy not measured on http1_policies")
    # Issue 4 (tier K): flatmesh+kernel against Envoy's tcp_proxy and nginx grpc_pass.
    kp = get("tcp_pingpong", "flatmesh+kernel")
    name = "tier K: sockperf added p50 ≤ 10% of Envoy's added p50 (TCP, 64 B)"
    if kp and ep and kp["added_p50_us"] is not None and ep["added_p50_us"] is not None:
        a, b = kp["added_p50_us"], ep["added_p50_us"]
        add(name, a <= b / 10, f"{a:+.1f} µs vs +{b:.1f} µs over direct")
    else:
        add(name, None, "flatmesh+kernel, Envoy or direct not measured")
    kt, et = get("tcp_throughput", "flatmesh+kernel"), get("tcp_throughput", "envoy")
    name = "tier K: iperf3 throughput ≥ 2× Envoy's tcp_proxy"
    if kt and et and kt["rate"] and et["rate"]:
        x = kt["rate"] / et["rate"]
        add(name, x >= 2, f"{kt['rate'] / 1e9:.2f} vs {et['rate'] / 1e9:.2f} Gbit/s = {x:.2f}×")
    else:
        add(name, None, "flatmesh+kernel or Envoy not measured")
    # The target is a per-request latency: judged on grpc_latency (light fixed rate) when it
    # ran. grpc_unary saturates the client, so its p50 is mostly queueing; it is reported too.
    for scenario in ("grpc_latency", "grpc_unary"):
        kg, ng = get(scenario, "flatmesh+kernel"), get(scenario, "nginx")
        name = f"tier K: gRPC unary p50 ≥ 35% lower than nginx grpc_pass ({scenario})"
        if kg and ng and kg["lat_us"]["p50"] and ng["lat_us"]["p50"]:
            a, b = kg["lat_us"]["p50"], ng["lat_us"]["p50"]
            ok = a <= 0.65 * b if scenario == "grpc_latency" else None
            note = "" if ok is not None else " (saturated: informational, the target is judged on grpc_latency)"
            add(name, ok, f"{f_lat(a)} vs {f_lat(b)} = {100 * (1 - a / b):.0f}% lower{note}")
        elif scenario == "grpc_latency":
            add(name, None, "flatmesh+kernel or nginx not measured")
    out += mtls_targets(rows)
    out += tracing_targets(rows)
    return out


def tracing_targets(rows: list[dict]) -> list[dict]:
    """Issue 22's "Speed" targets: what tracing costs flatmesh on HTTP/1.1 keep-alive, against
    its own run without tracing; Envoy's cost with its OpenTelemetry tracer beside it."""
    out = []

    def get(scn, system):
        return next((r for r in rows if r["scenario"] == scn and r["system"] == system and r["x"] is None), None)

    def add(name, ok, measured):
        out.append({"target": name, "status": "n/a" if ok is None else ("pass" if ok else "FAIL"), "measured": measured})

    def cost(system, scn):
        base, traced = get("http1_keepalive", system), get(scn, system)
        if base and traced and base["cpu_per_unit"] and traced["cpu_per_unit"]:
            return traced["cpu_per_unit"] / base["cpu_per_unit"], base, traced
        return None

    for scn, share, limit in (("http1_tracing_1pct", "1%", 1.03), ("http1_tracing_100pct", "100%", 1.15)):
        name = f"tracing {share}: CPU per request ≤ {limit:.2f}× without tracing (flatmesh, HTTP/1.1 keep-alive)"
        fm = cost("flatmesh", scn)
        if fm is None:
            add(name, None, f"{scn} or http1_keepalive not measured for flatmesh")
            continue
        x, base, traced = fm
        env = cost("envoy", scn)
        beside = f"; Envoy {env[0]:.3f}× its own" if env else ""
        add(name, x <= limit, f"{f_cpu(traced['cpu_per_unit'])} vs {f_cpu(base['cpu_per_unit'])} = {x:.3f}×{beside}")
    # Back-pressure: 100% sampled to a collector that never answers, against the same sampling
    # to a live Jaeger. Export waiting on the collector would show as added latency here.
    live, stalled = get("http1_tracing_100pct", "flatmesh"), get("http1_tracing_stalled", "flatmesh")
    name = "tracing: a collector that never answers adds no latency (p99 ≤ 1.10× with a live Jaeger, 100% sampled)"
    if live and stalled and live["lat_us"]["p99"] and stalled["lat_us"]["p99"]:
        a, b = stalled["lat_us"]["p99"], live["lat_us"]["p99"]
        add(name, a <= 1.10 * b, f"{f_lat(a)} vs {f_lat(b)} = {a / b:.2f}× (req/s {stalled['rate']:,.0f} vs {live['rate']:,.0f})")
    else:
        add(name, None, "http1_tracing_stalled or http1_tracing_100pct not measured for flatmesh")
    return out


MTLS_SUITE = "TLS_AES_128_GCM_SHA256"
MTLS_LIKE_FOR_LIKE = ("mtls_bulk", "mtls_http1", "mtls_new_conn")  # mtls_hbone_bulk is flatmesh only


def mtls_targets(rows: list[dict]) -> list[dict]:
    """Issue 16's "Speed" targets: two nodes over mTLS, flatmesh's pair against Envoy's."""
    out = []

    def add(name, ok, measured):
        status = "n/a" if ok is None else ("info" if ok == "info" else ("pass" if ok else "FAIL"))
        out.append({"target": name, "status": status, "measured": measured})

    def pair(scn):
        fm = next((r for r in rows if r["scenario"] == scn and r["system"] == "flatmesh" and r["x"] is None), None)
        env = next((r for r in rows if r["scenario"] == scn and r["system"] == "envoy" and r["x"] is None), None)
        return fm, env

    # The same cipher on both pairs, as read off the wire.
    name = f"mTLS: both pairs negotiate TLS 1.3 {MTLS_SUITE}"
    suites = {}
    for scn in MTLS_LIKE_FOR_LIKE:
        for r in pair(scn):
            h = r and r.get("hop_tls")
            if h and "error" not in h:
                for k, v in h["suites"].items():
                    suites.setdefault(r["system"], {}).setdefault(k, 0)
                    suites[r["system"]][k] += v
    if "flatmesh" in suites and "envoy" in suites:
        ok = all(set(suites[s]) == {MTLS_SUITE} for s in ("flatmesh", "envoy"))
        add(name, ok, "; ".join(f"{s}: " + ", ".join(f"{k} ×{v}" for k, v in suites[s].items()) for s in ("flatmesh", "envoy")))
    else:
        add(name, None, "the handshakes between the nodes were not read for both systems")

    def ratio_target(name, scn, key, want, fmt):
        fm, env = pair(scn)
        a = fm and (fm["lat_us"]["p99"] if key == "p99" else fm[key])
        b = env and (env["lat_us"]["p99"] if key == "p99" else env[key])
        if not a or not b:
            add(name, None, f"flatmesh or Envoy not measured on {scn}")
            return
        x = a / b
        ok = x >= want if key == "rate" else x <= want
        add(name, ok, f"{fmt(a)} vs {fmt(b)} = {x:.2f}×")

    gbit = lambda v: f"{v / 1e9:.2f} Gbit/s"  # noqa: E731
    ratio_target("mTLS bulk throughput ≥ 1.5× Envoy's pair (iperf3)", "mtls_bulk", "rate", 1.5, gbit)
    ratio_target("mTLS CPU per GB ≤ 0.7× Envoy's (both nodes)", "mtls_bulk", "cpu_per_unit", 0.7, lambda v: f"{v:.3f} s/GB")
    ratio_target("mTLS HTTP/1.1 keep-alive req/s ≥ 2× Envoy's", "mtls_http1", "rate", 2.0, lambda v: f"{v:,.0f} req/s")
    ratio_target("mTLS HTTP/1.1 keep-alive p99 ≤ ½ Envoy's", "mtls_http1", "p99", 0.5, f_lat)
    n = len(out)
    ratio_target("mTLS new connections/s ≥ Envoy's", "mtls_new_conn", "rate", 1.0, lambda v: f"{v:,.0f}/s")
    fm, env = pair("mtls_new_conn")
    if fm and env and len(out) > n and out[-1]["status"] != "n/a":
        # Neither side can be kept from resuming sessions (BENCHMARKS.md): say how often each did.
        out[-1]["measured"] += f" (between the nodes: flatmesh {wire.describe(fm.get('hop_tls'))}; Envoy {wire.describe(env.get('hop_tls'))})"

    fm, env = pair("mtls_bulk")
    name = "mTLS bulk: TLS share of the pair's CPU (perf), beside the relay's"
    if fm and fm.get("profile"):
        ok = None if "error" in fm["profile"] else "info"
        text = f"flatmesh: {profile.describe(fm['profile'])}"
        if env and env.get("profile"):
            text += f"; Envoy: {profile.describe(env['profile'])}"
        add(name, ok, text)
    else:
        add(name, None, "flatmesh not measured on mtls_bulk")
    return out


# ---------------------------------------------------------------- plots


def plots(outdir: Path, scenarios: list[Scenario], rows: list[dict], systems: list[str]) -> list[str]:
    written = []
    present = _order(systems, {r["system"] for r in rows})
    names = {s.name for s in scenarios}

    if "fixed_rate" in names:
        series = []
        for i, name in enumerate(present):
            pts99 = [(r["x"], r["lat_us"]["p99"] / 1000) for r in rows if r["scenario"] == "fixed_rate" and r["system"] == name and r["lat_us"]["p99"]]
            pts50 = [(r["x"], r["lat_us"]["p50"] / 1000) for r in rows if r["scenario"] == "fixed_rate" and r["system"] == name and r["lat_us"]["p50"]]
            if pts99:
                series.append((f"{name} p99", svg.color(name, i), pts99, ""))
                series.append((f"{name} p50", svg.color(name, i), pts50, "5,4"))
        doc = svg.line_chart(series, "Latency vs offered load (HTTP/1.1, fortio)", "offered load (requests/s)", "latency (ms, log scale)", log_y=True)
        if doc:
            (outdir / "latency_vs_qps.svg").write_text(doc)
            written.append("latency_vs_qps.svg")

    if "connections" in names:
        series = []
        for i, name in enumerate(present):
            pts = [(r["x"], r["rate"]) for r in rows if r["scenario"] == "connections" and r["system"] == name]
            if pts:
                series.append((name, svg.color(name, i), pts, ""))
        doc = svg.line_chart(series, "Throughput vs concurrent connections (HTTP/1.1 keep-alive, wrk)", "concurrent connections (log2 scale)", "throughput (requests/s)", log_x=True)
        if doc:
            (outdir / "throughput_vs_connections.svg").write_text(doc)
            written.append("throughput_vs_connections.svg")

    cpu_scn = [s for s in scenarios if not s.sweep and s.unit != "byte"]
    groups, bars = [], []
    proxies = [n for n in present if n != "direct"]
    for s in cpu_scn:
        if any(r["scenario"] == s.name and r["cpu_per_unit"] is not None for r in rows):
            groups.append(s.name)
    for i, name in enumerate(proxies):
        vals = []
        for g in groups:
            r = next((r for r in rows if r["scenario"] == g and r["system"] == name and r["x"] is None), None)
            vals.append(r["cpu_per_unit"] if r else None)
        bars.append((name, svg.color(name, i), vals))
    doc = svg.bar_chart(groups, bars, "CPU cost of the proxy per request (lower is better)", "CPU seconds per 10k requests", "scenario (gRPC stream: per 10k streams; TCP: per 10k round trips)")
    if doc:
        (outdir / "cpu_per_request.svg").write_text(doc)
        written.append("cpu_per_request.svg")
    return written


# ---------------------------------------------------------------- outputs


def markdown(meta: dict, scenarios: list[Scenario], rows: list[dict], systems: list[str], outcome, plot_files: list[str]) -> str:
    out = [
        f"# flatmesh side-by-side benchmark — {meta['date']}",
        "",
        f"- machine: {meta['nproc']} CPUs, {meta['cpu_model']}, kernel {meta['kernel']}",
        f"- command: `{meta['command']}`",
        f"- repeats: {meta['repeats']} (median reported); system under test on CPU 1, load generator and backends on CPU 0",
        f"- idle CPUs: {meta.get('idle', 'halt when idle (kernel default)')}",
        "- versions: " + "; ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        "",
        "## targets",
        "",
        "| target | measured | status |",
        "|---|---|---|",
    ]
    for t in targets(rows):
        out.append(f"| {t['target']} | {t['measured']} | {t['status']} |")
    for s in scenarios:
        table = scenario_table(s, rows, systems)
        if table:
            out += ["", f"## {s.name}: {s.title}", ""] + table
    out += mtls_section(scenarios, rows, systems)
    if plot_files:
        out += ["", "## plots", ""] + [f"![{p}]({p})" for p in plot_files]
    if outcome.failures:
        out += ["", "## failures", ""] + [f"- {f['system']} / {f['scenario']} (repeat {f['repeat']}, {f['stage']}): {f['error']}" for f in outcome.failures]
    if outcome.skipped:
        out += ["", "## skipped", ""] + [f"- {s['system']} / {s['scenario']}: {s['why']}" for s in outcome.skipped]
    return "\n".join(out) + "\n"


MTLS_NOTES = [
    "Two nodes of each system in a row, both on CPU 1; the certificates are flatmesh's (`flatmesh ca init` "
    "and `ca issue`, ECDSA P-256), the same files for both systems. CPU is the sum of both nodes.",
    "Handshakes are read off the wire (the server node's TLS 1.3 ServerHellos on loopback) from start-up "
    "through the checks and the warm-up, not during the timed run.",
    "Session resumption is on for both: flatmesh has no setting to turn it off (rustls's defaults), so Envoy "
    "keeps it on too, with `max_session_keys: 256` (rustls's client cache size).",
    "Envoy's TLS 1.3 suite cannot be configured (BoringSSL); `tls_params` pins TLS 1.3. flatmesh has no "
    "cipher setting either: both prefer TLS_AES_128_GCM_SHA256, and the suite each pair negotiated is "
    "read off the wire (the target row checks it).",
    "ztunnel and Linkerd's proxy are not in this comparison: neither is on crates.io, PyPI or Debian, and "
    "prebuilt binaries cannot be downloaded here.",
]


def mtls_section(scenarios: list[Scenario], rows: list[dict], systems: list[str]) -> list[str]:
    """The handshakes between the nodes and the CPU profile, per mTLS scenario and system."""
    names = [s.name for s in scenarios if s.topology.mtls]
    found = [r for n in names for name in systems for r in rows if r["scenario"] == n and r["system"] == name and r["x"] is None]
    found = [r for r in found if r["system"] != "direct"]
    if not found:
        return []
    out = ["", "## mTLS between the nodes (issue 16)", ""] + [f"- {n}" for n in MTLS_NOTES]
    out += ["", "| scenario | system | handshakes between the nodes | CPU of both nodes (perf) |", "|---|---|---|---|"]
    for r in found:
        prof = profile.describe(r.get("profile")) if r.get("profile") else "–"
        out.append(f"| {r['scenario']} | {r['system']} | {wire.describe(r.get('hop_tls'))} | {prof} |")
    return out


def terminal(scenarios: list[Scenario], rows: list[dict], systems: list[str]) -> str:
    head = f"{'scenario':<22} {'system':<10} {'rate':>14} {'xEnvoy':>7} {'p50':>10} {'p99':>10} {'p99.9':>10} {'cpu/unit':>9} {'peakMB':>7} {'err':>5}"
    lines = [head, "-" * len(head)]
    for s in scenarios:
        for name in systems:
            for r in sorted((r for r in rows if r["scenario"] == s.name and r["system"] == name), key=lambda r: r["x"] or 0):
                label = s.name if r["x"] is None else f"{s.name}@{r['x']:g}"
                lines.append(
                    f"{label:<22} {name:<10} {f_rate(r['rate'], s.unit):>14} {f_x(r['rate_vs_envoy']):>7} "
                    f"{f_lat(r['lat_us']['p50']):>10} {f_lat(r['lat_us']['p99']):>10} {f_lat(r['lat_us']['p999']):>10} "
                    f"{f_cpu(r['cpu_per_unit']):>9} {f_mb(r['peak_rss_kb']):>7} {r['errors']:>5}"
                )
    return "\n".join(lines)


def write_all(outdir: Path, meta: dict, scenarios: list[Scenario], systems: list[str], outcome) -> tuple[list[dict], str]:
    rows = summarize(outcome.records)
    plot_files = plots(outdir, scenarios, rows, systems)
    doc = {
        "meta": meta,
        "summary": rows,
        "targets": targets(rows),
        "records": outcome.records,
        "failures": outcome.failures,
        "skipped": outcome.skipped,
    }
    (outdir / "results.json").write_text(json.dumps(doc, indent=1))
    md = markdown(meta, scenarios, rows, systems, outcome, plot_files)
    (outdir / "results.md").write_text(md)
    return rows, md
