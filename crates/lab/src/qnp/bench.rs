//! The dispatch benchmark (`flatmesh qnp bench`): every mode side by side on the same cores, in
//! the dimensions of the paper's evaluation (§5.1–5.2):
//!
//! - the headline: the key-value GET service on RocksDB under Zipf(0.9) load, per mode;
//! - Figs. 15/18: throughput and latency against the number of skip-and-checks per rule
//!   (1–48; [`BenchConfig::fixed_rules`] rules, the paper's 32);
//! - Figs. 16/19: throughput and latency against the number of rules (up to 508, which with
//!   [`BenchConfig::fixed_checks`] = 4 skip-and-checks fill the 512-entry image);
//! - Table 1: the cost of one dispatch decision against the number of skip-and-checks (CAM
//!   lookups of the image, the kernel program's run time, the software matcher's time).
//!
//! Every run pins the server's threads (workers, dispatchers) to the same server CPUs and the
//! load generator to the same load CPUs, whatever the mode, and records how busy both CPU sets
//! were (from `/proc/stat`, softirq included) besides the server threads' own CPU time. Every
//! point runs the modes one after the other, and the whole set `repeats` times, so that a noisy
//! neighbour hits all modes alike; the report gives the median and the spread (min–max).

use crate::qnp::load::{run_mode, ModeResult, RunSpec, Workload};
use crate::svg::{line_chart, Scale, Series};
use crate::LabError;
use flatmesh_qnp::cpu::pin_current_thread;
use flatmesh_qnp::dispatch::{Handler, Mode, Rsd, Stash, STASH_DEPTH};
use flatmesh_qnp::image::Image;
use flatmesh_qnp::rules::{Decision, RuleSet};
use flatmesh_qnp::transport::{segment, OutReq, QnpConfig, Request};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

/// The app id of the benchmark's dispatch workload.
pub const BENCH_APP: u8 = 9;
/// Bytes one skip-and-check of the benchmark's rules compares (the paper's default, §5.2).
pub const MATCHED_BYTES: usize = 5;
/// Rules while skip-and-checks vary (the paper's default, §5 footnote 4).
pub const FIXED_RULES: usize = 32;
/// Skip-and-checks per rule while rules vary (the paper's default).
pub const FIXED_CHECKS: usize = 4;

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub modes: Vec<Mode>,
    pub spec: RunSpec,
    /// Runs of every point.
    pub repeats: usize,
    /// Skip-and-checks per rule for the Figs. 15/18 sweep and Table 1 (empty: skip both).
    pub checks: Vec<usize>,
    /// Rule counts for the Figs. 16/19 sweep (empty: skip it).
    pub rules: Vec<usize>,
    /// Rules during the skip-and-check sweep.
    pub fixed_rules: usize,
    /// Skip-and-checks per rule during the rule sweep.
    pub fixed_checks: usize,
    /// Run the key-value headline.
    pub headline: bool,
    /// Keys pre-loaded into the headline's RocksDB store.
    pub keys: usize,
}

/// The median and spread of repeated measurements.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(v: &[f64]) -> Spread {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        let median = match v.len() {
            0 => 0.0,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        };
        Spread {
            median,
            min: v.first().copied().unwrap_or(0.0),
            max: v.last().copied().unwrap_or(0.0),
        }
    }
}

/// One mode at one point of a sweep, over the repeats.
#[derive(Debug, Clone)]
pub struct Point {
    pub mode: Mode,
    /// The swept value (skip-and-checks or rules; 0 for the headline).
    pub x: usize,
    pub rps: Spread,
    pub p50_us: Spread,
    pub p99_us: Spread,
    /// Timeouts over all repeats.
    pub errors: u64,
    /// Responses from the wrong worker over all repeats (meaningless for `Reuseport`).
    pub misdispatched: u64,
    /// The kernel program's mean run time per packet, if `kernel.bpf_stats_enabled` was on.
    pub kernel_ns: Option<f64>,
    /// Server threads' CPU µs per request.
    pub cpu_us: Spread,
    /// Busy µs of the server CPUs per request (`/proc/stat`: softirq and other processes too).
    pub server_cpus_us: Spread,
    /// Server CPUs busy, in percent.
    pub server_busy: Spread,
    /// Load generator CPUs busy, in percent.
    pub load_busy: Spread,
    /// Load generator idle (polls that found nothing), in percent; `None` for the endpoint
    /// generator.
    pub load_idle: Option<Spread>,
}

fn point(mode: Mode, x: usize, runs: &[ModeResult]) -> Point {
    let col = |f: &dyn Fn(&ModeResult) -> f64| Spread::of(&runs.iter().map(f).collect::<Vec<_>>());
    let ns: Vec<f64> = runs.iter().filter_map(|r| r.kernel_ns_per_packet).collect();
    Point {
        mode,
        x,
        rps: col(&|r| r.report.rps()),
        p50_us: col(&|r| r.report.p50_us),
        p99_us: col(&|r| r.report.p99_us),
        errors: runs.iter().map(|r| r.report.errors).sum(),
        misdispatched: runs.iter().map(|r| r.report.misdispatched).sum(),
        kernel_ns: (!ns.is_empty()).then(|| Spread::of(&ns).median),
        cpu_us: col(&|r| r.server_cpu_us_per_req),
        server_cpus_us: col(&|r| r.server_cpus_us_per_req()),
        server_busy: col(&|r| 100.0 * r.server_cpus.busy_fraction),
        load_busy: col(&|r| 100.0 * r.load_cpus.busy_fraction),
        load_idle: runs
            .iter()
            .map(|r| r.report.idle_fraction.map(|f| 100.0 * f))
            .collect::<Option<Vec<f64>>>()
            .map(|v| Spread::of(&v)),
    }
}

/// Table 1's row for one number of skip-and-checks.
#[derive(Debug, Clone, PartialEq)]
pub struct DecisionCost {
    pub checks: usize,
    /// CAM lookups the Matcher's image takes for the benchmark's request (the paper's cycles
    /// grow the same way: 6 cycles per skip-and-check).
    pub lookups: usize,
    /// The software matcher's time per decision (header parse, field lookup, rule scan), in ns.
    pub software_ns: f64,
    /// The kernel program's run time per packet under load, in ns (needs bpf_stats_enabled).
    pub kernel_ns: Option<f64>,
}

/// Everything measured.
#[derive(Debug, Clone, Default)]
pub struct BenchReport {
    pub headline: Vec<Point>,
    pub by_checks: Vec<Point>,
    pub by_rules: Vec<Point>,
    pub decision_cost: Vec<DecisionCost>,
}

/// The benchmark's rules, a request value for each rule, and the queue each must reach.
#[derive(Debug, Clone)]
pub struct DispatchWorkload {
    pub rules: RuleSet,
    pub values: Vec<Vec<u8>>,
    pub expect: Vec<u8>,
}

/// The benchmark's rules and requests, as the paper builds them (§5): `rules` rules on field 0
/// of [`BENCH_APP`], each of `checks` skip-and-checks (skip one byte, compare
/// [`MATCHED_BYTES`]); rule *i* sends to queue *i* mod `workers`. Returns the rules, for each
/// rule a value that passes all of its checks, and the queue it must reach: every request goes
/// through all `checks` skip-and-checks and hits exactly one rule.
///
/// The rules differ only in their last skip-and-check. The image shares the others (one state
/// each) and tells the rules apart in one CAM lookup, so a request costs `checks + 1` lookups
/// whatever the number of rules, and 508 rules of 4 skip-and-checks fill the 512 entries
/// (1 start + 3 shared + 508). The software matcher scans the rules in order (the paper's
/// straw man), comparing each rule's checks until one fails, so its cost grows with both.
pub fn dispatch_workload(
    checks: usize,
    rules: usize,
    workers: usize,
) -> Result<DispatchWorkload, LabError> {
    let (checks, rules, workers) = (checks.max(1), rules.max(1), workers.clamp(1, 256));
    // Check k compares `tag_lo b c d tag_hi`: tag 60000 + k for the shared checks, the rule's
    // number for the last, so the last check is distinct for every rule.
    let check = |k: usize, r: usize| {
        let tag = if k + 1 == checks { r } else { 60_000 + k };
        [(tag % 256) as u8, b'b', b'c', b'd', (tag / 256) as u8]
    };
    let mut src = String::new();
    let (mut values, mut expect) = (Vec::new(), Vec::new());
    for r in 0..rules {
        let (mut pattern, mut value) = (String::new(), Vec::new());
        for k in 0..checks {
            pattern.push('.');
            value.push(b'-');
            for b in check(k, r) {
                let _ = write!(pattern, "\\x{b:02x}");
                value.push(b);
            }
        }
        let queue = (r % workers) as u8;
        let _ = writeln!(src, "rule {BENCH_APP} 0 0 \"{pattern}\" -> {queue}");
        values.push(value);
        expect.push(queue);
    }
    Ok(DispatchWorkload {
        rules: RuleSet::parse("bench", &src)?,
        values,
        expect,
    })
}

/// The benchmark's service: answers with the index of the worker that got the request.
pub fn worker_echo() -> Handler {
    Arc::new(|w, req: &Request| OutReq {
        app_id: req.app_id,
        req_type: req.req_type,
        payload: vec![w as u8].into(),
        dispatch_len: 0,
    })
}

/// Runs `modes` on one workload, `repeats` times round-robin, and folds the runs into points.
fn sweep_point(
    rt: &tokio::runtime::Runtime,
    cfg: &BenchConfig,
    x: usize,
    rules: &RuleSet,
    workload: &Workload,
    handler: &Handler,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<Point>, LabError> {
    let mut runs: Vec<Vec<ModeResult>> = vec![Vec::new(); cfg.modes.len()];
    for rep in 0..cfg.repeats.max(1) {
        for (i, &mode) in cfg.modes.iter().enumerate() {
            let r = run_mode(rt, mode, &cfg.spec, rules, workload, handler)?;
            progress(&format!(
                "  x={x} run {} {}: {:.0} req/s p50 {:.1} µs, server CPUs {:.0} % busy, load CPUs {:.0} % busy, generator idle {}",
                rep + 1,
                mode_name(mode),
                r.report.rps(),
                r.report.p50_us,
                100.0 * r.server_cpus.busy_fraction,
                100.0 * r.load_cpus.busy_fraction,
                r.report
                    .idle_fraction
                    .map_or("n/a".to_string(), |f| format!("{:.0} %", 100.0 * f)),
            ));
            runs[i].push(r);
        }
    }
    Ok(cfg
        .modes
        .iter()
        .zip(&runs)
        .map(|(&m, r)| point(m, x, r))
        .collect())
}

/// The software matcher's mean time per decision on the benchmark's first packets, measured on
/// a thread pinned to `cpus` (the server's).
fn software_decision_ns(
    rules: &RuleSet,
    values: &[Vec<u8>],
    cpus: &[usize],
) -> Result<f64, LabError> {
    let rsd = Rsd::new(rules.clone());
    let mut pkts = Vec::new();
    for v in values {
        let mut payload = Vec::new();
        flatmesh_qnp::tlv::put_bytes(&mut payload, 0, v)?;
        let req = OutReq {
            app_id: BENCH_APP,
            req_type: 0,
            dispatch_len: payload.len(),
            payload: payload.into(),
        };
        pkts.extend(
            segment(&req, 1, None, &QnpConfig::default())?
                .into_iter()
                .take(1),
        );
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            pin_current_thread(cpus)?;
            let peer = SocketAddr::from(([127, 0, 0, 1], 9));
            let mut stash = Stash::new(STASH_DEPTH);
            let iters = 200_000usize;
            let start = Instant::now();
            let mut hits = 0usize;
            for i in 0..iters {
                let p = &pkts[i % pkts.len()];
                hits += usize::from(rsd.decide(p, peer, &mut stash) != Decision::Drop);
            }
            let ns = start.elapsed().as_nanos() as f64 / iters as f64;
            if hits != iters {
                return Err(LabError::Internal(
                    "the benchmark's requests did not all match their rules; this is a bug in bench.rs"
                        .into(),
                ));
            }
            Ok(ns)
        })
        .join()
        .unwrap_or_else(|_| Err(LabError::Internal("the matcher timing thread panicked".into())))
    })
}

/// Runs the benchmark; `progress` gets one line per run.
pub fn run(cfg: &BenchConfig, progress: &mut dyn FnMut(&str)) -> Result<BenchReport, LabError> {
    let rt = crate::qnp::load::load_runtime()?;
    let mut report = BenchReport::default();
    let workers = cfg.spec.workers.max(1);
    if cfg.headline {
        progress(&format!(
            "headline: key-value GETs on RocksDB ({} keys), Zipf(0.9) within 24 key ranges",
            cfg.keys
        ));
        let handler = crate::qnp::load::kv_handler(cfg.keys)?;
        let rules = RuleSet::parse(
            "demo",
            &crate::qnp::services::demo_rules(workers, crate::qnp::load::DEMO_LANES),
        )?;
        let load = Workload::KvGet {
            keys: cfg.keys,
            s: 0.9,
        };
        report.headline = sweep_point(&rt, cfg, 0, &rules, &load, &handler, progress)?;
    }
    let handler = worker_echo();
    for &checks in &cfg.checks {
        progress(&format!(
            "{checks} skip-and-checks per rule, {} rules",
            cfg.fixed_rules
        ));
        let DispatchWorkload {
            rules,
            values,
            expect,
        } = dispatch_workload(checks, cfg.fixed_rules, workers)?;
        let img = Image::compile(&rules)?;
        let (_, lookups) = img.run(BENCH_APP, 0, |_| Some(&values[0][..]));
        let software_ns = software_decision_ns(&rules, &values, &cfg.spec.pinning.server)?;
        let load = Workload::Dispatch {
            app_id: BENCH_APP,
            values: Arc::new(values),
            expect: Arc::new(expect),
        };
        let points = sweep_point(&rt, cfg, checks, &rules, &load, &handler, progress)?;
        report.decision_cost.push(DecisionCost {
            checks,
            lookups,
            software_ns,
            kernel_ns: points.iter().find_map(|p| p.kernel_ns),
        });
        report.by_checks.extend(points);
    }
    for &n in &cfg.rules {
        progress(&format!(
            "{n} rules of {} skip-and-checks",
            cfg.fixed_checks
        ));
        let DispatchWorkload {
            rules,
            values,
            expect,
        } = dispatch_workload(cfg.fixed_checks, n, workers)?;
        Image::compile(&rules)?;
        let load = Workload::Dispatch {
            app_id: BENCH_APP,
            values: Arc::new(values),
            expect: Arc::new(expect),
        };
        report
            .by_rules
            .extend(sweep_point(&rt, cfg, n, &rules, &load, &handler, progress)?);
    }
    Ok(report)
}

/// The targets over one set of points: throughput ratios with the target and whether
/// this run met it, and the same comparison by server CPU per request (the cost side of "L7
/// dispatch at L4 cost", less sensitive to noise).
fn ratios(points: &[Point]) -> String {
    let get = |m: Mode| points.iter().find(|p| p.mode == m);
    let mut out = String::new();
    for (other, target) in [
        (Mode::Reuseport, Some(0.90)),
        (Mode::SoftwareUds, Some(3.0)),
        (Mode::SoftwareQueue, None),
    ] {
        if let (Some(k), Some(o)) = (get(Mode::Kernel), get(other)) {
            let ratio = k.rps.median / o.rps.median.max(1e-9);
            let verdict = target.map_or(String::new(), |t| {
                format!(
                    " (target ≥ {t:.2}: {})",
                    if ratio >= t { "met" } else { "missed" }
                )
            });
            let _ = writeln!(
                out,
                "- kernel / {}: throughput **{ratio:.2}**{verdict}; server CPU per request, {} / kernel: threads **{:.2}**, server CPUs **{:.2}**",
                mode_name(other),
                mode_name(other),
                o.cpu_us.median / k.cpu_us.median.max(1e-9),
                o.server_cpus_us.median / k.server_cpus_us.median.max(1e-9),
            );
            // On loopback the kernel program runs in the sender's system call; a NIC-less
            // server would run it on its own core, so charge it there too.
            if let Some(ns) = k.kernel_ns {
                let _ = writeln!(
                    out,
                    "  - charging the kernel program's {ns:.0} ns/packet to the server threads: {} / kernel: **{:.2}**",
                    mode_name(other),
                    o.cpu_us.median / (k.cpu_us.median + ns / 1000.0).max(1e-9),
                );
            }
        }
    }
    out.push_str(&overheads(points));
    out
}

/// The target that does not depend on the core count (issue 21, "Speed"): what dispatching
/// costs per request over plain SO_REUSEPORT, which does no L7 work. Counted on the server's
/// CPUs, plus the kernel program's own run time (on loopback it runs in the sender's system call,
/// on the load CPUs, so the server's CPUs alone would leave it out): the kernel's overhead must
/// be at most a third of the software dispatcher's.
fn overheads(points: &[Point]) -> String {
    let get = |m: Mode| points.iter().find(|p| p.mode == m);
    let (Some(plain), Some(kernel)) = (get(Mode::Reuseport), get(Mode::Kernel)) else {
        return String::new();
    };
    let Some(program_ns) = kernel.kernel_ns else {
        return "- dispatch overhead over reuseport: n/a (the kernel program's run time was not measured: run with --bpf-stats)\n".to_string();
    };
    let base = plain.server_cpus_us.median;
    let kernel_overhead = kernel.server_cpus_us.median + program_ns / 1000.0 - base;
    let mut out = String::new();
    for software in [Mode::SoftwareUds, Mode::SoftwareQueue] {
        let Some(s) = get(software) else { continue };
        let software_overhead = s.server_cpus_us.median - base;
        let verdict = if software_overhead <= 0.0 {
            "not measurable: the software dispatcher cost no more than reuseport in this run"
                .to_string()
        } else {
            let ratio = kernel_overhead / software_overhead;
            format!(
                "kernel / {} = **{ratio:.2}** (target ≤ 0.33: {})",
                mode_name(software),
                if ratio <= 1.0 / 3.0 { "met" } else { "missed" }
            )
        };
        let _ = writeln!(
            out,
            "- dispatch overhead over reuseport, server CPUs µs per request (+ the kernel program's {program_ns:.0} ns): kernel {kernel_overhead:.2}, {} {software_overhead:.2}; {verdict}",
            mode_name(software),
        );
    }
    out
}

fn fmt_spread(s: &Spread, digits: usize) -> String {
    format!("{:.d$} ({:.d$}–{:.d$})", s.median, s.min, s.max, d = digits)
}

/// The name of a mode on the command line and in reports.
pub fn mode_name(m: Mode) -> &'static str {
    match m {
        Mode::Reuseport => "reuseport",
        Mode::Kernel => "kernel",
        Mode::SoftwareQueue => "software-queue",
        Mode::SoftwareUds => "software-uds",
    }
}

impl BenchReport {
    /// The report as Markdown tables.
    pub fn markdown(&self, cfg: &BenchConfig) -> String {
        let mut out = String::new();
        let cpus = |v: &[usize]| {
            if v.is_empty() {
                "unpinned".to_string()
            } else {
                format!("{v:?}")
            }
        };
        let _ = writeln!(
            out,
            "{} workers, {} dispatcher(s) (software modes), {} client sockets, load generator {:?}, {:.1} s per run, {} runs per point. Every mode: server threads on CPUs {}, load generator on CPUs {}. Cells: median (min–max).\n",
            cfg.spec.workers,
            cfg.spec.dispatchers,
            cfg.spec.clients,
            cfg.spec.generator,
            cfg.spec.duration.as_secs_f64(),
            cfg.repeats,
            cpus(&cfg.spec.pinning.server),
            cpus(&cfg.spec.pinning.load),
        );
        out.push_str("CPU columns: *threads* is the CPU time of the server's worker and dispatcher threads per request; *server CPUs* is the busy time (user, system, irq, softirq; `/proc/stat`) of the server's CPUs per request, and the busy % columns say how loaded each side's CPUs were. The pipelined load generator busy-polls, so its CPUs always look busy: *load generator idle %* is the share of its time spent in polls that found no response, its spare capacity. A mode is limited by the server when the server CPUs are ~100 % busy and the generator still idles; near 0 % idle, the generator limited the run and the req/s of the modes cannot be compared. On loopback a request's receive path (UDP, socket lookup, the kernel dispatcher) runs in the sender's `sendmmsg`, on the load CPUs.\n\n");
        let header = "| mode | req/s | p50 µs | p99 µs | threads CPU µs/req | server CPUs µs/req | server CPUs busy % | load CPUs busy % | load generator idle % | timeouts |";
        let sep = "|---|---|---|---|---|---|---|---|---|---|";
        let row = |p: &Point| {
            format!(
                "| {} | {} | {} | {} | {} | {} | {:.0} | {:.0} | {} | {} |",
                mode_name(p.mode),
                fmt_spread(&p.rps, 0),
                fmt_spread(&p.p50_us, 1),
                fmt_spread(&p.p99_us, 1),
                fmt_spread(&p.cpu_us, 2),
                fmt_spread(&p.server_cpus_us, 2),
                p.server_busy.median,
                p.load_busy.median,
                p.load_idle
                    .map_or("n/a".to_string(), |s| format!("{:.0}", s.median)),
                p.errors
            )
        };
        if !self.headline.is_empty() {
            let _ = writeln!(
                out,
                "### Key-value GETs on RocksDB ({} keys of 62 bytes, Zipf 0.9 within 24 key ranges)\n",
                cfg.keys
            );
            let _ = writeln!(out, "{header}\n{sep}");
            for p in &self.headline {
                let _ = writeln!(out, "{}", row(p));
            }
            out.push('\n');
            out.push_str(&ratios(&self.headline));
            out.push('\n');
        }
        if !self.decision_cost.is_empty() {
            let _ = writeln!(
                out,
                "### Cost of one dispatch decision (Table 1), {} rules\n",
                cfg.fixed_rules
            );
            out.push_str("| skip-and-checks | CAM lookups (image) | kernel program ns/packet | software matcher ns/decision |\n|---|---|---|---|\n");
            for c in &self.decision_cost {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {:.0} |",
                    c.checks,
                    c.lookups,
                    c.kernel_ns
                        .map_or("n/a (bpf_stats off)".to_string(), |n| format!("{n:.0}")),
                    c.software_ns
                );
            }
            out.push('\n');
        }
        for (title, points, what) in [
            (
                format!(
                    "Throughput and latency against skip-and-checks per rule, {} rules (Figs. 15, 18)",
                    cfg.fixed_rules
                ),
                &self.by_checks,
                "skip-and-checks",
            ),
            (
                format!(
                    "Throughput and latency against the number of rules, {} skip-and-checks each (Figs. 16, 19)",
                    cfg.fixed_checks
                ),
                &self.by_rules,
                "rules",
            ),
        ] {
            if points.is_empty() {
                continue;
            }
            let _ = writeln!(out, "### {title}\n");
            let _ = writeln!(
                out,
                "| {what} {}| misdispatched |\n|---{sep}---|",
                header.trim_end_matches('|')
            );
            for p in points {
                let _ = writeln!(
                    out,
                    "| {} {} {} |",
                    p.x,
                    row(p),
                    if p.mode == Mode::Reuseport {
                        "n/a (no L7)".to_string()
                    } else {
                        p.misdispatched.to_string()
                    }
                );
            }
            out.push('\n');
            let mut xs: Vec<usize> = points.iter().map(|p| p.x).collect();
            xs.dedup();
            for x in xs {
                let at: Vec<Point> = points.iter().filter(|p| p.x == x).cloned().collect();
                for line in ratios(&at).lines() {
                    match line.strip_prefix("- ") {
                        Some(l) => {
                            let _ = writeln!(out, "- {what} {x}: {l}");
                        }
                        None => {
                            let _ = writeln!(out, "{line}");
                        }
                    }
                }
            }
            out.push('\n');
        }
        out
    }

    /// SVG plots: `(file name, contents)`.
    pub fn svgs(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for (name, points, xlabel) in [
            ("qnp-checks", &self.by_checks, "skip-and-checks per rule"),
            ("qnp-rules", &self.by_rules, "rules"),
        ] {
            if points.is_empty() {
                continue;
            }
            let series = |f: fn(&Point) -> f64| -> Vec<Series> {
                let mut modes: Vec<Mode> = Vec::new();
                for p in points.iter() {
                    if !modes.contains(&p.mode) {
                        modes.push(p.mode);
                    }
                }
                modes
                    .iter()
                    .map(|&m| {
                        Series::full(
                            mode_name(m),
                            points
                                .iter()
                                .filter(|p| p.mode == m)
                                .map(|p| (p.x as f64, f(p))),
                        )
                    })
                    .collect()
            };
            out.push((
                format!("{name}-throughput.svg"),
                line_chart(
                    &format!("Throughput against {xlabel} (median)"),
                    xlabel,
                    "requests/s",
                    &series(|p| p.rps.median),
                    Scale::Linear,
                ),
            ));
            out.push((
                format!("{name}-cpu.svg"),
                line_chart(
                    &format!("Server CPU per request against {xlabel} (median)"),
                    xlabel,
                    "µs CPU / request",
                    &series(|p| p.cpu_us.median),
                    Scale::Linear,
                ),
            ));
            out.push((
                format!("{name}-latency.svg"),
                line_chart(
                    &format!("p50 latency against {xlabel} (median)"),
                    xlabel,
                    "µs",
                    &series(|p| p.p50_us.median),
                    Scale::Linear,
                ),
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workload_values_reach_their_rules_in_every_matcher() {
        for (checks, rules) in [(1, 511), (4, 508), (48, FIXED_RULES), (FIXED_CHECKS, 3)] {
            let DispatchWorkload {
                rules: set,
                values,
                expect,
            } = dispatch_workload(checks, rules, 2).unwrap();
            let img = Image::compile(&set).unwrap();
            let fast = flatmesh_qnp::rules::FastMatcher::new(&set);
            for (v, q) in values.iter().zip(&expect) {
                let want = Decision::Queue(*q);
                assert_eq!(set.eval(BENCH_APP, 0, |_| Some(v)), want);
                assert_eq!(fast.eval(BENCH_APP, 0, |_| Some(v)), want);
                let (d, lookups) = img.run(BENCH_APP, 0, |_| Some(v));
                assert_eq!(d, want);
                assert_eq!(
                    lookups,
                    checks + 1,
                    "every request takes every skip-and-check"
                );
            }
            assert!(set
                .rules
                .iter()
                .all(|r| flatmesh_qnp::image::skip_and_checks(r) == checks));
            assert_eq!(values.len(), rules);
        }
        // 508 rules of 4 skip-and-checks fill the image exactly.
        let full = dispatch_workload(4, 508, 2).unwrap();
        assert_eq!(Image::compile(&full.rules).unwrap().cam.len(), 512);
        let over = dispatch_workload(4, 509, 2).unwrap();
        assert!(Image::compile(&over.rules).is_err());
    }

    #[test]
    fn the_report_has_every_table_and_a_verdict_for_each_target() {
        let spread = |v: f64| Spread::of(&[v]);
        let pt = |mode, x, rps: f64| Point {
            mode,
            x,
            rps: spread(rps),
            p50_us: spread(10.0),
            p99_us: spread(20.0),
            errors: 0,
            misdispatched: 0,
            kernel_ns: (mode == Mode::Kernel).then_some(400.0),
            cpu_us: spread(8.0),
            server_cpus_us: spread(9.0),
            server_busy: spread(100.0),
            load_busy: spread(80.0),
            load_idle: Some(spread(30.0)),
        };
        let modes = [
            Mode::Reuseport,
            Mode::Kernel,
            Mode::SoftwareQueue,
            Mode::SoftwareUds,
        ];
        let set = |x| {
            modes
                .iter()
                .zip([100.0, 95.0, 60.0, 30.0])
                .map(|(&m, r)| pt(m, x, r))
                .collect::<Vec<_>>()
        };
        let report = BenchReport {
            headline: set(0),
            by_checks: [set(1), set(48)].concat(),
            by_rules: set(508),
            decision_cost: vec![DecisionCost {
                checks: 1,
                lookups: 2,
                software_ns: 100.0,
                kernel_ns: None,
            }],
        };
        let cfg = BenchConfig {
            modes: modes.to_vec(),
            spec: RunSpec {
                generator: crate::qnp::load::Generator::Pipelined { window: 8 },
                workers: 2,
                dispatchers: 1,
                clients: 8,
                duration: std::time::Duration::from_secs(2),
                pinning: crate::qnp::load::Pinning {
                    server: vec![1],
                    load: vec![0],
                },
            },
            repeats: 3,
            checks: vec![1, 48],
            rules: vec![508],
            fixed_rules: FIXED_RULES,
            fixed_checks: FIXED_CHECKS,
            headline: true,
            keys: 24_000,
        };
        let md = report.markdown(&cfg);
        assert!(
            md.contains("server threads on CPUs [1], load generator on CPUs [0]"),
            "{md}"
        );
        assert!(
            md.contains("kernel / reuseport: throughput **0.95** (target ≥ 0.90: met)"),
            "{md}"
        );
        assert!(
            md.contains("kernel / software-uds: throughput **3.17** (target ≥ 3.00: met)"),
            "{md}"
        );
        assert!(
            md.contains("- skip-and-checks 48: kernel / reuseport"),
            "{md}"
        );
        // Every mode at 9 µs of server CPUs; the kernel program adds 0.4 µs: no software
        // overhead to compare against.
        assert!(
            md.contains("kernel 0.40, software-uds 0.00; not measurable"),
            "{md}"
        );
        assert!(
            md.contains("against the number of rules, 4 skip-and-checks each"),
            "{md}"
        );
        assert!(md.contains("| 508 | kernel | 95 (95–95) |"), "{md}");
        // Every table row has as many cells as its header.
        for table in md.split("\n\n").filter(|t| t.starts_with('|')) {
            let cells: Vec<usize> = table.lines().map(|l| l.matches('|').count()).collect();
            assert!(cells.iter().all(|c| *c == cells[0]), "{table}");
        }
        assert_eq!(report.svgs().len(), 6);
    }

    #[test]
    fn the_dispatch_overhead_is_compared_over_reuseport() {
        let pt = |mode, server: f64, ns: Option<f64>| Point {
            mode,
            x: 0,
            rps: Spread::of(&[1.0]),
            p50_us: Spread::of(&[1.0]),
            p99_us: Spread::of(&[1.0]),
            errors: 0,
            misdispatched: 0,
            kernel_ns: ns,
            cpu_us: Spread::of(&[1.0]),
            server_cpus_us: Spread::of(&[server]),
            server_busy: Spread::of(&[1.0]),
            load_busy: Spread::of(&[1.0]),
            load_idle: None,
        };
        let points = [
            pt(Mode::Reuseport, 10.0, None),
            pt(Mode::Kernel, 10.5, Some(500.0)),
            pt(Mode::SoftwareUds, 14.0, None),
        ];
        let text = overheads(&points);
        assert!(
            text.contains("kernel 1.00, software-uds 4.00; kernel / software-uds = **0.25** (target ≤ 0.33: met)"),
            "{text}"
        );
        let unmeasured = [
            pt(Mode::Reuseport, 10.0, None),
            pt(Mode::Kernel, 10.5, None),
        ];
        assert!(overheads(&unmeasured).contains("run with --bpf-stats"));
    }

    #[test]
    fn spreads_take_the_median() {
        let s = Spread::of(&[3.0, 1.0, 2.0]);
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        assert_eq!(Spread::of(&[1.0, 2.0]).median, 1.5);
    }
}
