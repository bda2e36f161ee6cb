//! A closed-loop load generator: each client keeps one request outstanding, on its own QNP
//! endpoint (own UDP port, so SO_REUSEPORT hashing spreads clients), for a fixed time.
//!
//! Workloads: PingPong (§5.2: a 128-byte request echoed) and key-value GETs with Zipf-distributed
//! keys (§5.3), keys named so that the rule file `examples/rules/kv.rules` splits 24 key ranges.

use crate::cpu_use::{CpuTimes, CpuUse};
use crate::LabError;
use flatmesh_qnp::apps::{kv, pingpong};
use flatmesh_qnp::transport::{Endpoint, OutReq, QnpConfig};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

pub mod pipelined;

/// Key ranges of the key-value workload (the paper's 24).
pub const KEY_RANGES: usize = 24;

/// What the clients send.
#[derive(Debug, Clone, PartialEq)]
pub enum Workload {
    /// 128-byte pings; `lanes` spreads them over that many dispatch values.
    PingPong { lanes: usize },
    /// GETs of `keys` keys with Zipf(`s`) popularity.
    KvGet { keys: usize, s: f64 },
    /// Requests of `app_id`/type 0 whose field 0 is one of `values`, picked uniformly, padded
    /// to 128 bytes. The server answers with its worker index; a response from another worker
    /// than `expect[i]` counts as misdispatched (the benchmark's proof that a mode ran the rules).
    Dispatch {
        app_id: u8,
        values: Arc<Vec<Vec<u8>>>,
        expect: Arc<Vec<u8>>,
    },
}

/// Bytes of a key, as in the paper's store (§5.1: 62-byte keys, 64-byte values).
pub const KEY_BYTES: usize = 62;

/// The key range (0..24) of key number `n` out of `keys`: keys are split evenly and in order.
pub fn key_range(n: usize, keys: usize) -> usize {
    (n * KEY_RANGES / keys.max(1)).min(KEY_RANGES - 1)
}

/// The key of key number `n` out of `keys`: its range's letter `a`..`x`, then the number,
/// zero-padded to [`KEY_BYTES`] bytes. Dispatch rules read the first byte.
pub fn kv_key(n: usize, keys: usize) -> String {
    let letter = char::from(b'a' + key_range(n, keys) as u8);
    format!("{letter}{n:0width$}", width = KEY_BYTES - 1)
}

/// The key numbers of range `r`: `start..end`.
pub fn range_keys(r: usize, keys: usize) -> std::ops::Range<usize> {
    let keys = keys.max(KEY_RANGES);
    let start = (r * keys).div_ceil(KEY_RANGES);
    let end = ((r + 1) * keys).div_ceil(KEY_RANGES);
    start..end
}

/// Bytes of a PingPong request (and response) on the wire, all headers included (§5.2): Ethernet,
/// IPv4, UDP and QNP take 64, the TLV payload the other 64.
pub const WIRE_BYTES: usize = 128;
/// Headers in front of the QNP payload: Ethernet, IPv4, UDP and the QNP header.
pub const FRAME_OVERHEAD: usize =
    flatmesh_qnp::header::L2_L4_HEADERS + flatmesh_qnp::header::HEADER_LEN;
/// PingPong's body: the payload minus the TLV fields `lane` (3 + 6), `body` (3) and `sent_ns` (3 + 8).
pub const PING_BODY: usize = WIRE_BYTES - FRAME_OVERHEAD - (3 + 6) - 3 - (3 + 8);

/// Zipf(s) over ranks 1..=n by inverse CDF. Hand-written: rand 0.9 has no Zipf and this is ten
/// lines; `rand_distr` would be a new dependency for one distribution.
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    pub fn new(n: usize, s: f64) -> Zipf {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (1..=n.max(1))
            .map(|k| {
                acc += 1.0 / (k as f64).powf(s);
                acc
            })
            .collect();
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf { cdf }
    }
    /// A rank in 0..n, 0 the most popular.
    pub fn sample(&self, rng: &mut impl Rng) -> usize {
        let u: f64 = rng.random();
        self.cdf.partition_point(|c| *c < u).min(self.cdf.len() - 1)
    }
}

/// Keys in the largest range: the Zipf ranks within a range.
pub fn keys_per_range(keys: usize) -> usize {
    (0..KEY_RANGES)
        .map(|r| range_keys(r, keys).len())
        .max()
        .unwrap_or(1)
}

/// Results of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadReport {
    pub requests: u64,
    pub errors: u64,
    /// Responses of [`Workload::Dispatch`] from another worker than the rules say.
    pub misdispatched: u64,
    pub seconds: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// The pipelined generator: the share of its time spent in polls that found no response,
    /// its spare capacity (near 0: the generator, not the server, limited the run).
    pub idle_fraction: Option<f64>,
}

impl LoadReport {
    pub fn rps(&self) -> f64 {
        self.requests as f64 / self.seconds.max(1e-9)
    }
}

/// A request of `w` and, for [`Workload::Dispatch`], the worker that must answer it.
fn request(
    w: &Workload,
    zipf: Option<&Zipf>,
    rng: &mut StdRng,
) -> Result<(OutReq, Option<u8>), LabError> {
    let req = match w {
        Workload::PingPong { lanes } => {
            let lane = rng.random_range(0..(*lanes).max(1));
            OutReq::from_message(&pingpong::Ping {
                body: vec![0x5a; PING_BODY],
                lane: format!("lane{lane:02}"),
                sent_ns: 0,
            })
        }
        Workload::KvGet { keys, .. } => {
            // As in the paper (§5.1): a key range picked uniformly, and within it a key by
            // Zipf popularity (rank 0, the range's first key, the most popular).
            let range = range_keys(rng.random_range(0..KEY_RANGES), *keys);
            let rank = zipf.map_or(0, |z| z.sample(rng));
            let n = (range.start + rank).min(range.end.saturating_sub(1));
            OutReq::from_message(&kv::Get {
                key: kv_key(n, *keys),
                flags: 0,
            })
        }
        Workload::Dispatch {
            app_id,
            values,
            expect,
        } => {
            let i = rng.random_range(0..values.len().max(1));
            let value = values.get(i).map_or(&[][..], Vec::as_slice);
            let mut payload = Vec::with_capacity(WIRE_BYTES);
            flatmesh_qnp::tlv::put_bytes(&mut payload, 0, value)?;
            let dispatch_len = payload.len();
            // Pad to 128 bytes on the wire, as the PingPong app, where the value leaves room.
            let pad = WIRE_BYTES.saturating_sub(FRAME_OVERHEAD + dispatch_len + 3);
            flatmesh_qnp::tlv::put_bytes(&mut payload, 1, &vec![0x5a; pad])?;
            return Ok((
                OutReq {
                    app_id: *app_id,
                    req_type: 0,
                    payload: payload.into(),
                    dispatch_len,
                },
                expect.get(i).copied(),
            ));
        }
    };
    Ok((req?, None))
}

/// Runs `clients` closed-loop clients against `target` for `duration`.
pub async fn run(
    target: SocketAddr,
    clients: usize,
    duration: Duration,
    workload: Workload,
    cfg: QnpConfig,
) -> Result<LoadReport, LabError> {
    let zipf = match workload {
        Workload::KvGet { keys, s } => Some(Arc::new(Zipf::new(keys_per_range(keys), s))),
        Workload::PingPong { .. } | Workload::Dispatch { .. } => None,
    };
    let bind = SocketAddr::new(target.ip(), 0);
    let start = Instant::now();
    let deadline = start + duration;
    let mut tasks = Vec::new();
    for c in 0..clients.max(1) {
        let sock = tokio::net::UdpSocket::bind(bind)
            .await
            .map_err(|e| LabError::io(format!("binding a load client on {bind}"), e))?;
        let (zipf, workload) = (zipf.clone(), workload.clone());
        tasks.push(tokio::spawn(async move {
            let ep = Endpoint::new(sock, cfg)?;
            let mut rng = StdRng::seed_from_u64(c as u64);
            let (mut lat, mut errors, mut wrong) = (Vec::new(), 0u64, 0u64);
            while Instant::now() < deadline {
                let (req, expect) = request(&workload, zipf.as_deref(), &mut rng)?;
                let t0 = Instant::now();
                match ep.send_req(target, &req).await {
                    Ok(resp) => {
                        lat.push(t0.elapsed().as_nanos() as u64);
                        if expect.is_some_and(|q| resp.payload.first() != Some(&q)) {
                            wrong += 1;
                        }
                    }
                    Err(flatmesh_qnp::QnpError::Timeout { .. }) => errors += 1,
                    Err(e) => return Err(e.into()),
                }
            }
            Ok::<_, LabError>((lat, errors, wrong))
        }));
    }
    let (mut lat, mut errors, mut misdispatched) = (Vec::new(), 0, 0);
    for t in tasks {
        let (l, e, w) = t
            .await
            .map_err(|e| LabError::io("a load client failed", std::io::Error::other(e)))??;
        lat.extend(l);
        errors += e;
        misdispatched += w;
    }
    let seconds = start.elapsed().as_secs_f64();
    Ok(report(lat, errors, misdispatched, seconds))
}

/// Folds request latencies (ns) and counts into a report.
fn report(mut lat: Vec<u64>, errors: u64, misdispatched: u64, seconds: f64) -> LoadReport {
    lat.sort_unstable();
    let pct = |p: f64| {
        lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1)))
            .map_or(0.0, |ns| *ns as f64 / 1000.0)
    };
    LoadReport {
        requests: lat.len() as u64,
        errors,
        misdispatched,
        seconds,
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        idle_fraction: None,
    }
}

/// Where a run's threads execute. DESIGN.md ("Measuring"): the system under test on CPU 1, the
/// load generator on CPU 0. Empty lists leave threads unpinned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pinning {
    pub server: Vec<usize>,
    pub load: Vec<usize>,
}

/// Which load generator drives a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Generator {
    /// [`run`]: each client a full QNP endpoint with one request outstanding (the demo).
    Endpoint,
    /// [`pipelined::run`]: each client a socket with `window` requests outstanding, batched
    /// system calls (the benchmark: cheap enough to load a server core from one core).
    Pipelined { window: usize },
}

/// The setup shared by every mode of a comparison.
#[derive(Debug, Clone)]
pub struct RunSpec {
    pub generator: Generator,
    /// Worker threads.
    pub workers: usize,
    /// Dispatcher threads of the software modes.
    pub dispatchers: usize,
    /// Closed-loop clients (sockets of the pipelined generator).
    pub clients: usize,
    /// Measured time per mode.
    pub duration: Duration,
    pub pinning: Pinning,
}

/// One mode's results.
#[derive(Debug, Clone)]
pub struct ModeResult {
    pub mode: flatmesh_qnp::dispatch::Mode,
    pub report: LoadReport,
    /// Requests answered by each worker.
    pub per_worker: Vec<u64>,
    /// Packets the software dispatchers dropped.
    pub dropped: u64,
    /// Kernel mode with `kernel.bpf_stats_enabled` on: the dispatcher program's mean run time.
    pub kernel_ns_per_packet: Option<f64>,
    /// CPU time of the worker and dispatcher threads per answered request, in µs. On loopback
    /// the receive path of a request (and the kernel dispatcher) runs in the sender's system
    /// call, so it is charged to the load generator, not here.
    pub server_cpu_us_per_req: f64,
    /// How busy the server's CPUs were (all CPUs when the server is unpinned), from
    /// `/proc/stat`: every process and the kernel's softirq work on them count.
    pub server_cpus: CpuUse,
    /// How busy the load generator's CPUs were (zero when it is unpinned).
    pub load_cpus: CpuUse,
}

impl ModeResult {
    /// Busy time of the server's CPUs per answered request, in µs (softirq included).
    pub fn server_cpus_us_per_req(&self) -> f64 {
        self.server_cpus.busy_secs * 1e6 / self.report.requests.max(1) as f64
    }
}

/// Keys of the demo's key-value store.
pub const DEMO_KEYS: usize = 24_000;
/// Ping lanes of the demo.
pub const DEMO_LANES: usize = 16;

/// Serves `handler` under `rules` in `mode` on `spec`'s server CPUs and drives it with
/// `workload` from the calling thread, pinned to `spec`'s load CPUs, on `rt`. The calling
/// thread stays pinned afterwards.
pub fn run_mode(
    rt: &tokio::runtime::Runtime,
    mode: flatmesh_qnp::dispatch::Mode,
    spec: &RunSpec,
    rules: &flatmesh_qnp::rules::RuleSet,
    workload: &Workload,
    handler: &flatmesh_qnp::dispatch::Handler,
) -> Result<ModeResult, LabError> {
    use flatmesh_qnp::dispatch::{DispatchServer, Rsd};
    flatmesh_qnp::cpu::pin_current_thread(&spec.pinning.load)?;
    let cfg = QnpConfig::default();
    let server = DispatchServer::start_on(
        &spec.pinning.server,
        mode,
        SocketAddr::from(([127, 0, 0, 1], 0)),
        spec.workers,
        spec.dispatchers,
        Arc::new(Rsd::new(rules.clone())),
        cfg,
        Arc::clone(handler),
    )?;
    let before = CpuTimes::now()?;
    let report = match spec.generator {
        Generator::Endpoint => rt.block_on(run(
            server.addr(),
            spec.clients,
            spec.duration,
            workload.clone(),
            cfg,
        ))?,
        Generator::Pipelined { window } => {
            pipelined::run(server.addr(), spec.clients, window, spec.duration, workload)?
        }
    };
    let after = CpuTimes::now()?;
    let per_worker = server.handled();
    let dropped = server.dispatched_dropped().1;
    let kernel_ns_per_packet = server
        .kernel_run_stats()
        .filter(|(_, runs)| *runs > 0)
        .map(|(ns, runs)| ns as f64 / runs as f64);
    let cpu = server.stop().cpu;
    Ok(ModeResult {
        mode,
        server_cpu_us_per_req: cpu.as_secs_f64() * 1e6 / report.requests.max(1) as f64,
        report,
        per_worker,
        dropped,
        kernel_ns_per_packet,
        server_cpus: after.since(&before, &spec.pinning.server),
        load_cpus: if spec.pinning.load.is_empty() {
            CpuUse::default()
        } else {
            after.since(&before, &spec.pinning.load)
        },
    })
}

/// A current-thread runtime for the load generator.
pub fn load_runtime() -> Result<tokio::runtime::Runtime, LabError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| LabError::io("starting the load generator's runtime", e))
}

/// A mode and how its run went (an error: the mode could not run).
pub type ModeOutcome = (flatmesh_qnp::dispatch::Mode, Result<ModeResult, LabError>);

/// The demo's applications.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DemoApp {
    /// GETs on a RocksDB store of `keys` pre-loaded keys, Zipf(0.9) within 24 key ranges.
    Kv { keys: usize },
    /// PingPong, 128 bytes on the wire, over [`DEMO_LANES`] lanes.
    PingPong,
}

impl std::str::FromStr for DemoApp {
    type Err = LabError;
    fn from_str(s: &str) -> Result<DemoApp, LabError> {
        match s {
            "kv" => Ok(DemoApp::Kv { keys: DEMO_KEYS }),
            "pingpong" => Ok(DemoApp::PingPong),
            other => Err(LabError::InvalidOption(format!(
                "unknown workload `{other}`; use kv or pingpong"
            ))),
        }
    }
}

/// The demo: serves `app` in each mode in turn, with the same workers, cores and rules
/// ([`crate::qnp::services::demo_rules`]). A mode that cannot run (kernel mode without root) gets its
/// error and the others still run.
pub fn compare_modes(
    modes: &[flatmesh_qnp::dispatch::Mode],
    app: DemoApp,
    spec: &RunSpec,
) -> Result<Vec<ModeOutcome>, LabError> {
    let (load, handler) = match app {
        DemoApp::Kv { keys } => (Workload::KvGet { keys, s: 0.9 }, kv_handler(keys)?),
        DemoApp::PingPong => (
            Workload::PingPong { lanes: DEMO_LANES },
            crate::qnp::services::pingpong_service(),
        ),
    };
    let rules = flatmesh_qnp::rules::RuleSet::parse(
        "demo",
        &crate::qnp::services::demo_rules(spec.workers, DEMO_LANES),
    )?;
    let rt = load_runtime()?;
    Ok(modes
        .iter()
        .map(|&mode| (mode, run_mode(&rt, mode, spec, &rules, &load, &handler)))
        .collect())
}

/// The key-value GET service on a fresh RocksDB store with `keys` keys pre-loaded.
#[cfg(feature = "kv")]
pub fn kv_handler(keys: usize) -> Result<flatmesh_qnp::dispatch::Handler, LabError> {
    let store = crate::qnp::kv_store::KvStore::temporary()?;
    store.preload(keys)?;
    Ok(crate::qnp::services::kv_service(Arc::new(store)))
}

/// Without the `kv` feature there is no store: the error says how to build one.
#[cfg(not(feature = "kv"))]
pub fn kv_handler(_keys: usize) -> Result<flatmesh_qnp::dispatch::Handler, LabError> {
    Err(LabError::KvNotBuilt)
}

/// The demo's result table, one row per mode, as aligned text.
pub fn demo_table(results: &[ModeOutcome]) -> String {
    let mut rows = vec![[
        "mode",
        "req/s",
        "p50 µs",
        "p99 µs",
        "timeouts",
        "requests per worker",
        "dispatcher drops",
    ]
    .map(String::from)
    .to_vec()];
    let mut notes = String::new();
    for (mode, r) in results {
        let name = crate::qnp::bench::mode_name(*mode).to_string();
        match r {
            Ok(r) => rows.push(vec![
                name,
                format!("{:.0}", r.report.rps()),
                format!("{:.1}", r.report.p50_us),
                format!("{:.1}", r.report.p99_us),
                r.report.errors.to_string(),
                format!("{:?}", r.per_worker),
                r.dropped.to_string(),
            ]),
            Err(e) => {
                rows.push(vec![name.clone(), "skipped".into()]);
                notes.push_str(&format!("{name}: {e}\n"));
            }
        }
    }
    let cols = rows[0].len();
    let width: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in &rows {
        let cells: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(c, s)| format!("{s:<w$}", w = width[c]))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out + &notes
}

#[cfg(test)]
mod tests {
    use super::*;
    use flatmesh_qnp::QnpMessage as _;

    #[test]
    fn zipf_prefers_low_ranks_and_stays_in_range() {
        let z = Zipf::new(1000, 0.9);
        let mut rng = StdRng::seed_from_u64(1);
        let mut counts = vec![0u32; 1000];
        for _ in 0..20_000 {
            counts[z.sample(&mut rng)] += 1;
        }
        assert!(
            counts[0] > counts[9] && counts[9] > counts[500],
            "{:?}",
            &counts[..10]
        );
        assert!(
            counts[0] > 1000,
            "rank 1 of Zipf(0.9) over 1000 keys has ~10% of the mass"
        );
    }

    #[test]
    fn keys_are_62_bytes_in_24_ranges() {
        let k = kv_key(0, 24_000);
        assert_eq!(k.len(), KEY_BYTES);
        assert!(k.starts_with("a000") && k.ends_with("0000"));
        assert!(
            kv_key(23_999, 24_000).starts_with('x') && kv_key(23_999, 24_000).ends_with("23999")
        );
        assert!(kv_key(1_000, 24_000).starts_with('b'));
        for keys in [24, 100, 24_000, 3_140_000] {
            let mut total = 0;
            for r in 0..KEY_RANGES {
                let range = range_keys(r, keys);
                total += range.len();
                assert!(
                    range.clone().all(|n| key_range(n, keys) == r),
                    "{keys} keys, range {r}"
                );
            }
            assert_eq!(total, keys);
        }
    }

    #[test]
    fn kv_gets_spread_over_the_ranges_and_are_zipf_within_each() {
        let keys = 24_000;
        let z = Zipf::new(keys_per_range(keys), 0.9);
        let mut rng = StdRng::seed_from_u64(3);
        let w = Workload::KvGet { keys, s: 0.9 };
        let (mut per_range, mut first_keys) = (vec![0u32; KEY_RANGES], 0u32);
        let n = 24_000;
        for _ in 0..n {
            let (r, _) = request(&w, Some(&z), &mut rng).unwrap();
            let get = kv::Get::decode(&r.payload).unwrap();
            let num: usize = get.key[1..].parse().unwrap();
            per_range[key_range(num, keys)] += 1;
            first_keys += u32::from(range_keys(key_range(num, keys), keys).start == num);
        }
        // Uniform over ranges: each near 1000.
        assert!(
            per_range.iter().all(|c| (800..1200).contains(c)),
            "{per_range:?}"
        );
        // Zipf(0.9) over 1000 keys gives rank 1 1/H = 9.8 % of a range's requests.
        assert!((2_050..2_650).contains(&first_keys), "{first_keys}");
    }

    #[test]
    fn ping_is_128_bytes_on_the_wire() {
        let mut rng = StdRng::seed_from_u64(0);
        let (r, _) = request(&Workload::PingPong { lanes: 4 }, None, &mut rng).unwrap();
        assert_eq!(FRAME_OVERHEAD + r.payload.len(), 128);
        let w = Workload::Dispatch {
            app_id: 9,
            values: Arc::new(vec![b"12345".to_vec()]),
            expect: Arc::new(vec![0]),
        };
        let (r, _) = request(&w, None, &mut rng).unwrap();
        assert_eq!(FRAME_OVERHEAD + r.payload.len(), 128);
    }
}
