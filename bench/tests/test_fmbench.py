"""Unit tests of the harness: tool-output parsers, config generators, summaries and charts.

Run: python3 -m unittest discover -s bench/tests -v
They need no tools installed; tool outputs are captured fixtures from real runs.
"""

import json
import sys
import unittest
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from fmbench import loadgen, report, scenarios, svg, systems

FX = HERE / "fixtures"


class ParserTests(unittest.TestCase):
    def test_wrk_reads_the_report_line(self):
        r = loadgen.parse_wrk((FX / "wrk.txt").read_text())
        self.assertEqual(r.ops, 9863)
        self.assertAlmostEqual(r.duration_s, 1.028)
        self.assertAlmostEqual(r.rate, 9863 / 1.028)
        self.assertEqual(r.lat_us, {"p50": 55.0, "p90": 4468.0, "p99": 8770.0, "p999": 11452.0})
        self.assertEqual(r.errors, 0)

    def test_wrk_counts_every_error_kind(self):
        line = (
            'WRKJSON {"requests":10,"duration_us":1000000,"bytes":1,'
            '"errors":{"connect":1,"read":2,"write":3,"status":4,"timeout":5},'
            '"lat_us":{"p50":1,"p90":2,"p99":3,"p999":4,"mean":1,"max":9}}'
        )
        self.assertEqual(loadgen.parse_wrk(line).errors, 15)

    def test_wrk_failure_is_an_error(self):
        with self.assertRaises(loadgen.LoadError):
            loadgen.parse_wrk("unable to connect to 127.0.0.1:19080 Connection refused", rc=1)

    def test_h2load_uses_the_per_request_log_for_percentiles(self):
        log = (FX / "h2load-log.txt").read_text()
        r = loadgen.parse_h2load((FX / "h2load.txt").read_text(), log)
        self.assertEqual(r.ops, 8163)
        self.assertAlmostEqual(r.rate, 8163.0)
        samples = sorted(float(line.split()[2]) for line in log.splitlines())
        self.assertEqual(r.lat_us["p50"], samples[len(samples) // 2 - 1])
        self.assertEqual(r.errors, 0)

    def test_h2load_counts_failures_and_4xx_5xx(self):
        out = (FX / "h2load.txt").read_text()
        out = out.replace("0 failed, 0 errored, 0 timeout", "2 failed, 1 errored, 0 timeout")
        out = out.replace("0 4xx, 0 5xx", "3 4xx, 4 5xx")
        self.assertEqual(loadgen.parse_h2load(out, "").errors, 10)

    def test_sockperf_uses_the_valid_window(self):
        r = loadgen.parse_sockperf((FX / "sockperf.txt").read_text())
        self.assertEqual(r.ops, 6096)
        self.assertAlmostEqual(r.duration_s, 0.549)
        self.assertEqual(r.lat_us["p50"], 9.202)
        self.assertEqual(r.lat_us["p99"], 1525.101)
        self.assertEqual(r.lat_us["p999"], 5987.038)
        self.assertEqual(r.raw["avg_us"], 45.017)

    def test_sockperf_garbage_is_an_error(self):
        with self.assertRaises(loadgen.LoadError):
            loadgen.parse_sockperf("sockperf: ERROR: connect() failed", rc=1)

    def test_fortio_percentiles_in_microseconds(self):
        r = loadgen.parse_fortio((FX / "fortio.json").read_text())
        self.assertEqual(r.ops, 200)
        self.assertEqual(r.errors, 0)
        self.assertAlmostEqual(r.lat_us["p50"], 597.375, places=2)
        self.assertIsNotNone(r.lat_us["p999"])

    def test_ghz_ignores_its_own_shutdown_errors(self):
        r = loadgen.parse_ghz((FX / "ghz.json").read_text())
        self.assertEqual(r.ops, 4)
        # one Canceled by ghz's own shutdown is ignored; the Unavailable counts
        self.assertEqual(r.errors, 1)
        self.assertEqual(r.raw["client_shutdown_errors"], 1)
        self.assertEqual(r.lat_us["p50"], 2000.0)  # from OK details only, in microseconds
        self.assertEqual(r.lat_us["p999"], 4000.0)

    def test_iperf3_reports_bits_and_bytes(self):
        r = loadgen.parse_iperf3((FX / "iperf3.json").read_text())
        d = json.loads((FX / "iperf3.json").read_text())["end"]["sum_received"]
        self.assertEqual(r.ops, d["bytes"])
        self.assertAlmostEqual(r.rate, d["bits_per_second"])
        self.assertIsNone(r.lat_us)

    def test_iperf3_error_field_is_an_error(self):
        with self.assertRaises(loadgen.LoadError):
            loadgen.parse_iperf3('{"error": "unable to connect to server: Connection refused"}', rc=1)

    def test_percentiles_nearest_rank(self):
        p = loadgen.percentiles([float(i) for i in range(1, 1001)])
        self.assertEqual(p, {"p50": 500.0, "p90": 900.0, "p99": 990.0, "p999": 999.0})
        self.assertEqual(loadgen.percentiles([7.0])["p999"], 7.0)
        self.assertIsNone(loadgen.percentiles([])["p50"])


def scenario(name):
    return {s.name: s for s in scenarios.all_scenarios()}[name]


class ConfigTests(unittest.TestCase):
    def test_flatmesh_yaml_shape(self):
        topo = scenarios.Topology(
            (
                scenarios.Listener("web", 19080, "http", (scenarios.Route("prefix", "/a/", "a"),)),
                scenarios.Listener("db", 19100, "tcp", cluster="b"),
            ),
            (scenarios.Cluster("a", 18080), scenarios.Cluster("b", 18100, "http2")),
        )
        text = systems.to_yaml(systems.flatmesh_config(topo))
        expected = """admin: "127.0.0.1:19000"
workers: 1
listeners:
  - name: "web"
    address: "127.0.0.1:19080"
    protocol: "http"
    routes:
      - match:
          path:
            prefix: "/a/"
        cluster: "a"
  - name: "db"
    address: "127.0.0.1:19100"
    protocol: "tcp"
    cluster: "b"
clusters:
  - name: "a"
    endpoints:
      - "127.0.0.1:18080"
  - name: "b"
    endpoints:
      - "127.0.0.1:18100"
    protocol: "http2\""""
        self.assertEqual(text, expected)

    def test_flatmesh_extra_keys_for_future_tiers(self):
        cfg = systems.flatmesh_config(scenario("tcp_pingpong").topology, {"kernel": {"sockmap": True}})
        self.assertEqual(cfg["kernel"], {"sockmap": True})
        self.assertEqual(cfg["workers"], 1)

    def test_thousand_routes_mix_and_target(self):
        s = scenario("http1_1000_routes")
        routes = s.topology.listeners[0].routes
        self.assertEqual(len(routes), 1000)
        self.assertEqual({r.kind for r in routes}, {"exact", "prefix", "regex"})
        target = routes[scenarios.THOUSAND_TARGET]
        self.assertEqual(target.kind, "regex")
        self.assertEqual(target.cluster, f"svc-{scenarios.THOUSAND_TARGET % 10}")
        # the request path matches the target route and no earlier route
        import re

        def matches(r, path):
            if r.kind == "exact":
                return path == r.value
            if r.kind == "prefix":
                return path.startswith(r.value)
            return re.fullmatch(r.value.strip("^$"), path) is not None

        first = next(i for i, r in enumerate(routes) if matches(r, s.path))
        self.assertEqual(first, scenarios.THOUSAND_TARGET)

    def test_envoy_config_routes_and_h2_upstream(self):
        cfg = systems.envoy_config(scenario("http1_1000_routes").topology)
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
        self.assertEqual(len(routes), 1000)
        self.assertEqual(routes[0]["match"], {"path": "/r0/exact"})
        self.assertEqual(routes[1]["match"], {"prefix": "/r1/"})
        self.assertEqual(routes[2]["match"], {"safe_regex": {"regex": "^/r2/[0-9]+$"}})
        grpc = systems.envoy_config(scenario("grpc_unary").topology)["static_resources"]["clusters"][0]
        self.assertIn("envoy.extensions.upstreams.http.v3.HttpProtocolOptions", grpc["typed_extension_protocol_options"])
        tcp = systems.envoy_config(scenario("tcp_pingpong").topology)["static_resources"]["listeners"][0]
        self.assertEqual(tcp["filter_chains"][0]["filters"][0]["name"], "envoy.filters.network.tcp_proxy")

    def test_policies_scenario_sets_every_policy_on_flatmesh_and_envoy(self):
        s = scenario("http1_policies")
        cfg = systems.flatmesh_config(s.topology)
        route = cfg["listeners"][0]["routes"][0]
        for key in ("retries", "rate_limit", "fault", "mirror"):
            self.assertIn(key, route)
        self.assertEqual(route["fault"]["abort"]["percent"], 0)
        cluster = cfg["clusters"][0]
        for key in ("circuit_breaker", "outlier_detection", "health_check", "slow_start"):
            self.assertIn(key, cluster)
        self.assertEqual(cluster["endpoints"][0]["weight"], 1)
        plain = systems.flatmesh_config(scenario("http1_keepalive").topology)
        self.assertNotIn("retries", plain["listeners"][0]["routes"][0])
        env = systems.envoy_config(s.topology)["static_resources"]
        hcm = env["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        names = [f["name"] for f in hcm["http_filters"]]
        self.assertEqual(names, ["envoy.filters.http.local_ratelimit", "envoy.filters.http.fault", "envoy.filters.http.router"])
        action = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
        self.assertIn("retry_policy", action)
        self.assertIn("request_mirror_policies", action)
        for key in ("circuit_breakers", "outlier_detection", "health_checks", "round_robin_lb_config"):
            self.assertIn(key, env["clusters"][0])
        self.assertFalse(systems.Haproxy().supports(s)[0])
        self.assertFalse(systems.Nginx().supports(s)[0])
        self.assertTrue(systems.Haproxy().supports(scenario("http1_keepalive"))[0])

    def test_haproxy_config(self):
        text = systems.haproxy_config(scenario("http1_1000_routes").topology)
        self.assertIn("  nbthread 1", text)
        self.assertEqual(text.count("  acl r"), 1000)
        self.assertEqual(text.count("  use_backend "), 1000)
        self.assertIn("acl r2 path_reg ^/r2/[0-9]+$", text)
        self.assertIn("acl r0 path /r0/exact", text)
        self.assertIn("http-request return status 404", text)
        self.assertIn("proto h2", systems.haproxy_config(scenario("grpc_unary").topology))
        tcp = systems.haproxy_config(scenario("tcp_pingpong").topology)
        self.assertIn("mode tcp", tcp)
        self.assertNotIn("no_route", tcp)

    def test_nginx_proxy_config(self):
        work = Path("/tmp/fmbench-test")
        text = systems.nginx_proxy_config(scenario("http1_1000_routes").topology, work)
        self.assertIn("worker_processes 1;", text)
        self.assertIn("location = /r0/exact", text)
        self.assertIn("location ^~ /r1/", text)
        self.assertIn("location ~ ^/r2/[0-9]+$", text)
        self.assertIn('location / { return 404 "no route matched\\n"; }', text)
        grpc = systems.nginx_proxy_config(scenario("grpc_unary").topology, work)
        self.assertIn("grpc_pass grpc://grpc;", grpc)
        self.assertIn("listen 127.0.0.1:19080 http2;", grpc)
        tcp = systems.nginx_proxy_config(scenario("tcp_pingpong").topology, work)
        self.assertIn("stream {", tcp)
        self.assertIn("load_module", tcp)
        self.assertNotIn("http {", tcp)

    def test_direct_targets_the_backend_of_the_route(self):
        d = systems.Direct()
        self.assertEqual(d.target_port(scenario("http1_keepalive")), scenarios.HTTP_BACKEND_BASE + 9)
        self.assertEqual(d.target_port(scenario("http2")), scenarios.H2C_BACKEND_BASE + 9)
        self.assertEqual(systems.Envoy().target_port(scenario("http2")), scenarios.SUT_HTTP_PORT)

    def test_quick_selection(self):
        names = [s.name for s in scenarios.select(None, quick=True)]
        self.assertEqual(names, ["http1_keepalive", "tcp_pingpong"])
        with self.assertRaises(SystemExit):
            scenarios.select(["nope"], quick=False)


def rec(system, scn, rate, p50, p99, cpu=1.0, idle=None, x=None, errors=0):
    return {
        "system": system, "scenario": scn, "repeat": 0, "x": x, "rate": rate,
        "lat_us": {"p50": p50, "p90": p99, "p99": p99, "p999": p99}, "cpu_per_unit": cpu,
        "peak_rss_kb": 1000, "idle_rss_kb": idle, "errors": errors, "ops": 100,
    }


class ReportTests(unittest.TestCase):
    def test_median_and_ratio_to_envoy(self):
        rows = report.summarize(
            [
                rec("envoy", "http1_keepalive", 10_000, 1000, 3000),
                rec("envoy", "http1_keepalive", 20_000, 1000, 3000),
                rec("envoy", "http1_keepalive", 30_000, 1000, 3000),
                rec("flatmesh", "http1_keepalive", 60_000, 300, 1000, cpu=0.25),
            ]
        )
        fm = next(r for r in rows if r["system"] == "flatmesh")
        env = next(r for r in rows if r["system"] == "envoy")
        self.assertEqual(env["rate"], 20_000)
        self.assertEqual(env["repeats"], 3)
        self.assertAlmostEqual(fm["rate_vs_envoy"], 3.0)
        self.assertAlmostEqual(fm["p99_vs_envoy"], 1 / 3)
        self.assertAlmostEqual(fm["cpu_vs_envoy"], 0.25)

    def test_targets_pass_and_fail(self):
        recs = [
            rec("envoy", "http1_keepalive", 10_000, 1000, 3000, idle=64 * 1024),
            rec("haproxy", "http1_keepalive", 30_000, 500, 2000),
            rec("flatmesh", "http1_keepalive", 26_000, 300, 1400, idle=12 * 1024),
            rec("direct", "tcp_pingpong", 1, 4.0, 5.0),
            rec("envoy", "tcp_pingpong", 1, 36.0, 50.0),
            rec("flatmesh", "tcp_pingpong", 1, 21.0, 30.0),
        ]
        t = {x["target"].split(" (")[0]: x["status"] for x in report.targets(report.summarize(recs))}
        self.assertEqual(t["req/s ≥ 2.5× Envoy"], "pass")  # 2.6x
        self.assertEqual(t["p99 ≤ ½ Envoy's"], "pass")  # 1.4 ms <= 1.5 ms
        self.assertEqual(t["req/s ≥ HAProxy"], "FAIL")
        self.assertEqual(t["idle RSS ≤ 15 MB"], "pass")
        self.assertEqual(t["sockperf added p50 ≤ ½ Envoy's added p50"], "FAIL")  # +17 µs > +32 µs / 2

    def test_policies_targets_compare_with_flatmesh_without_them_and_envoy_with_them(self):
        recs = [
            rec("flatmesh", "http1_keepalive", 80_000, 300, 1000, cpu=0.100),
            rec("flatmesh", "http1_policies", 76_000, 300, 1000, cpu=0.108),
            rec("envoy", "http1_policies", 30_000, 900, 3000, cpu=0.300),
        ]
        t = {x["target"]: x["status"] for x in report.targets(report.summarize(recs))}
        self.assertEqual(t["policies: CPU per request ≤ 1.10× without them (flatmesh, HTTP/1.1 keep-alive)"], "pass")
        self.assertEqual(t["policies: req/s ≥ 2× Envoy's with the same policies"], "pass")
        recs[1] = rec("flatmesh", "http1_policies", 50_000, 300, 1000, cpu=0.120)
        t = {x["target"]: x["status"] for x in report.targets(report.summarize(recs))}
        self.assertEqual(t["policies: CPU per request ≤ 1.10× without them (flatmesh, HTTP/1.1 keep-alive)"], "FAIL")
        self.assertEqual(t["policies: req/s ≥ 2× Envoy's with the same policies"], "FAIL")

    def test_added_latency_is_over_direct(self):
        rows = report.summarize([rec("direct", "tcp_pingpong", 1, 4.0, 5.0), rec("envoy", "tcp_pingpong", 1, 36.5, 50.0)])
        env = next(r for r in rows if r["system"] == "envoy")
        self.assertAlmostEqual(env["added_p50_us"], 32.5)

    def test_kernel_tier_targets(self):
        recs = [
            rec("direct", "tcp_pingpong", 1, 4.0, 5.0),
            rec("envoy", "tcp_pingpong", 1, 36.7, 50.0),
            rec("flatmesh+kernel", "tcp_pingpong", 1, 6.0, 9.0),
            rec("envoy", "tcp_throughput", 13e9, None, None),
            rec("flatmesh+kernel", "tcp_throughput", 28e9, None, None),
            rec("nginx", "grpc_latency", 200, 1360.0, 3000.0),
            rec("flatmesh+kernel", "grpc_latency", 200, 700.0, 2000.0),
            rec("nginx", "grpc_unary", 9000, 1360.0, 3000.0),
            rec("flatmesh+kernel", "grpc_unary", 15000, 1300.0, 2000.0),
        ]
        t = {x["target"]: x["status"] for x in report.targets(report.summarize(recs))}
        self.assertEqual(t["tier K: sockperf added p50 ≤ 10% of Envoy's added p50 (TCP, 64 B)"], "pass")  # +2.0 <= 3.27
        self.assertEqual(t["tier K: iperf3 throughput ≥ 2× Envoy's tcp_proxy"], "pass")  # 2.15x
        # Judged on the light fixed-rate run (49% lower); the saturated run is only reported.
        self.assertEqual(t["tier K: gRPC unary p50 ≥ 35% lower than nginx grpc_pass (grpc_latency)"], "pass")
        self.assertEqual(t["tier K: gRPC unary p50 ≥ 35% lower than nginx grpc_pass (grpc_unary)"], "n/a")
        recs[6] = rec("flatmesh+kernel", "grpc_latency", 200, 1000.0, 2000.0)
        t = {x["target"]: x["status"] for x in report.targets(report.summarize(recs))}
        self.assertEqual(t["tier K: gRPC unary p50 ≥ 35% lower than nginx grpc_pass (grpc_latency)"], "FAIL")  # 26%
        recs[2] = rec("flatmesh+kernel", "tcp_pingpong", 1, 8.0, 9.0)
        t = {x["target"]: x["status"] for x in report.targets(report.summarize(recs))}
        self.assertEqual(t["tier K: sockperf added p50 ≤ 10% of Envoy's added p50 (TCP, 64 B)"], "FAIL")

    def test_kernel_system_config_and_host_cpu_column(self):
        k = systems.registry()["flatmesh+kernel"]
        cfg = systems.flatmesh_config(scenario("grpc_unary").topology, k.extra)
        self.assertEqual(cfg["kernel"], {"pin_dir": systems.KERNEL_PIN_DIR, "redirect": True, "l7_dispatch": True})
        # A tcp-only scenario has no http listener to dispatch: the node would refuse l7_dispatch.
        tcp = systems.flatmesh_config(scenario("tcp_pingpong").topology, k.extra)
        self.assertEqual(tcp["kernel"], {"pin_dir": systems.KERNEL_PIN_DIR, "redirect": True})
        rows = report.summarize([dict(rec("flatmesh+kernel", "tcp_pingpong", 100, 5.0, 9.0), host_cpu_per_unit=0.5)])
        table = "\n".join(report.scenario_table(scenario("tcp_pingpong"), rows, ["flatmesh+kernel"]))
        self.assertIn("host CPU s / 10k round trips", table)
        self.assertIn("0.500", table)

    def test_targets_without_flatmesh_are_not_applicable(self):
        t = report.targets(report.summarize([rec("envoy", "http1_keepalive", 1, 1, 1)]))
        self.assertTrue(all(x["status"] == "n/a" for x in t))


class SvgTests(unittest.TestCase):
    def test_line_chart_is_valid_svg_with_labels(self):
        doc = svg.line_chart(
            [("envoy p99", "#1f77b4", [(1000, 3.0), (5000, 9.0)], ""), ("direct", "#777", [(1000, 0.5), (5000, 0.6)], "5,4")],
            "Latency vs offered load", "offered load (requests/s)", "latency (ms, log scale)", log_y=True,
        )
        root = ET.fromstring(doc)
        texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
        self.assertIn("offered load (requests/s)", texts)
        self.assertIn("latency (ms, log scale)", texts)
        self.assertIn("envoy p99", texts)
        self.assertEqual(len(list(root.iter("{http://www.w3.org/2000/svg}polyline"))), 2)

    def test_bar_chart_is_valid_svg(self):
        doc = svg.bar_chart(["a", "b"], [("envoy", "#111", [1.0, None]), ("flatmesh", "#222", [0.5, 0.2])], "t", "y (s)", "x")
        root = ET.fromstring(doc)
        self.assertEqual(len(list(root.iter("{http://www.w3.org/2000/svg}rect"))), 1 + 3)  # background + 3 bars

    def test_empty_chart_is_skipped(self):
        self.assertEqual(svg.line_chart([], "t", "x", "y"), "")

    def test_nice_ticks(self):
        self.assertEqual(svg.nice_ticks(0, 100), [0, 20, 40, 60, 80, 100])
        self.assertEqual(svg.log_ticks(0.1, 10), [0.1, 0.2, 0.5, 1, 2, 5, 10])


if __name__ == "__main__":
    unittest.main()
