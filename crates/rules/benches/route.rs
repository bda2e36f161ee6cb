//! Executor lookup cost: `cargo bench -p flatmesh-rules --bench route`.
//!
//! Tables of 10 and 1,000 routes mixing exact, prefix and regex paths (plus method and header
//! conditions). Requests hit the first route, the last route, a regex route, a header route and
//! nothing. `route_linear` on the last route shows what a linear scan would cost.
//!
//! Time is the benchmark thread's CPU time (CLOCK_THREAD_CPUTIME_ID), not wall time: the
//! machines here have 2 cores shared by many jobs, and wall time mostly measures the waiting.

use criterion::measurement::{Measurement, ValueFormatter};
use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use flatmesh_config::Config;
use flatmesh_rules::{compile, Request};
use http::{HeaderMap, HeaderValue, Method};

/// CPU time consumed by the calling thread, in nanoseconds.
struct ThreadCpu;

fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant the kernel knows.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl Measurement for ThreadCpu {
    type Intermediate = u64;
    type Value = u64;
    fn start(&self) -> u64 {
        thread_cpu_ns()
    }
    fn end(&self, start: u64) -> u64 {
        thread_cpu_ns().saturating_sub(start)
    }
    fn add(&self, a: &u64, b: &u64) -> u64 {
        a + b
    }
    fn zero(&self) -> u64 {
        0
    }
    fn to_f64(&self, v: &u64) -> f64 {
        *v as f64
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        &CpuNs
    }
}

/// Values are always shown in CPU nanoseconds.
struct CpuNs;

impl ValueFormatter for CpuNs {
    fn scale_values(&self, _typical: f64, _values: &mut [f64]) -> &'static str {
        "ns(cpu)"
    }
    fn scale_throughputs(&self, _typical: f64, t: &Throughput, values: &mut [f64]) -> &'static str {
        if let Throughput::Elements(n) = t {
            for v in values.iter_mut() {
                *v = *n as f64 * 1e9 / *v;
            }
        }
        "elem/s(cpu)"
    }
    fn scale_for_machines(&self, _values: &mut [f64]) -> &'static str {
        "ns(cpu)"
    }
}

fn config(n: usize) -> Config {
    let mut routes = String::new();
    for i in 0..n {
        let m = match i % 5 {
            0 => format!("path: {{ exact: /svc{i}/get }}"),
            1 => format!("path: {{ prefix: /svc{i}/ }}, method: GET"),
            2 => format!("path: {{ regex: \"/r{i}/[0-9]+/items\" }}"),
            3 => format!(
                "path: {{ prefix: /api/v{i}/ }}, headers: [ {{ name: x-canary, exact: \"1\" }} ]"
            ),
            _ => format!("path: {{ prefix: /p{i}/ }}"),
        };
        routes.push_str(&format!(
            "      - match: {{ {m} }}\n        cluster: c{}\n",
            i % 3
        ));
    }
    let yaml = format!(
        "listeners:\n  - name: web\n    address: 127.0.0.1:8080\n    protocol: http\n    routes:\n{routes}\
         clusters:\n  - {{ name: c0, endpoints: [127.0.0.1:1] }}\n  - {{ name: c1, endpoints: [127.0.0.1:2] }}\n  - {{ name: c2, endpoints: [127.0.0.1:3] }}\n"
    );
    match serde_norway::from_str(&yaml) {
        Ok(cfg) => cfg,
        Err(e) => panic!("bench config does not parse: {e}"),
    }
}

fn bench(c: &mut Criterion<ThreadCpu>) {
    let mut headers = HeaderMap::new();
    headers.insert("x-canary", HeaderValue::from_static("1"));
    headers.insert("user-agent", HeaderValue::from_static("bench"));
    for n in [10usize, 1000] {
        let program = match compile(&config(n)) {
            Ok(p) => p,
            Err(e) => panic!("bench config does not compile: {e}"),
        };
        let web = program.listener_id("web").unwrap_or(0);
        // (label, path, the route that must win)
        let cases = [
            ("first_exact", "/svc0/get".to_string(), Some(0)),
            ("last_prefix", format!("/p{}/x", n - 1), Some(n - 1)),
            ("regex", format!("/r{}/42/items", n - 3), Some(n - 3)),
            (
                "header_prefix",
                format!("/api/v{}/users", n - 2),
                Some(n - 2),
            ),
            ("miss", "/nothing/here".to_string(), None),
        ];
        for (label, path, want) in &cases {
            let req = Request {
                method: &Method::GET,
                host: Some("api.local"),
                path,
                query: None,
                headers: (&headers).into(),
                message: None,
            };
            let got = program.route(web, &req).map(|r| r.id);
            assert_eq!(got, *want, "bench case {label} routed wrong");
            assert_eq!(got, program.route_linear(web, &req).map(|r| r.id));
            c.bench_function(&format!("route/{n}/{label}"), |b| {
                b.iter(|| black_box(program.route(web, black_box(&req)).map(|r| r.id)))
            });
        }
        let path = format!("/p{}/x", n - 1);
        let req = Request {
            method: &Method::GET,
            host: Some("api.local"),
            path: &path,
            query: None,
            headers: (&headers).into(),
            message: None,
        };
        c.bench_function(&format!("route_linear/{n}/last_prefix"), |b| {
            b.iter(|| black_box(program.route_linear(web, black_box(&req)).map(|r| r.id)))
        });
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().with_measurement(ThreadCpu);
    targets = bench
}
criterion_main!(benches);
