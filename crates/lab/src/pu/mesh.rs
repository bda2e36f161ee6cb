//! `flatmesh pu demo --mesh`: HeteroK8s-Mesh-All (papers/004 §5, Fig. 6-8). A client and a server
//! microservice run on the host PU (CPU 0); the mesh's node proxy, the real `flatmesh node`, runs
//! either on the host too or on the DPU PU (CPU 1). The client calls a service address; the split
//! namespace's interception rules capture the call and deliver it to the node proxy wherever it
//! runs, with `SO_ORIGINAL_DST` intact; the node routes it (an HTTP listener, one route) to the
//! server, which it reaches over `127.0.0.1` (the reverse mapping carries it back to the host).
//!
//! Three placements, measured in interleaved rounds, like the paper's Fig. 8:
//!
//! - `host`: the proxy on the host CPU, every hop loopback TCP (Istio's sidecar-less baseline,
//!   "IstioCPU");
//! - `dpu-veth`: the proxy on the DPU, both hops over the PUs' veth link;
//! - `dpu-shm`: the proxy on the DPU, client, proxy and server with the hetero-socket library
//!   preloaded, so both hops move to shared memory between the PUs (docs/shm.md "Between PUs").
//!
//! Each round starts the node on the placement's PU, runs the closed-loop HTTP/1.1 load for a
//! fixed time from a separate client process, and reads the CPU time every process used.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use flatmesh_pu::cleanup;
use flatmesh_pu::config::SplitConfig;
use flatmesh_pu::pod::Pod;

use crate::{LabError, Result};

/// The address the client calls: no such host exists; interception delivers it to the proxy.
pub const SERVICE: &str = "10.96.1.10:80";
const PROXY_PORT: u16 = 15006;
const NODE_ADMIN: u16 = 15000;
/// The server for the placements over TCP, and the preloaded one for `dpu-shm`.
const SERVER_TCP: u16 = 8080;
const SERVER_SHM: u16 = 8081;
/// The agents' poll interval during the scenario.
const POLL_MS: u64 = 500;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    Host,
    DpuVeth,
    DpuShm,
}

impl Placement {
    pub const ALL: [Placement; 3] = [Placement::Host, Placement::DpuVeth, Placement::DpuShm];

    pub fn label(self) -> &'static str {
        match self {
            Placement::Host => "(a) proxy on host CPU, loopback",
            Placement::DpuVeth => "(b) proxy on DPU, veth",
            Placement::DpuShm => "(c) proxy on DPU, shared memory",
        }
    }

    /// For chart axes.
    pub fn short_label(self) -> &'static str {
        match self {
            Placement::Host => "(a) host, loopback",
            Placement::DpuVeth => "(b) DPU, veth",
            Placement::DpuShm => "(c) DPU, shm",
        }
    }

    fn pu(self) -> &'static str {
        match self {
            Placement::Host => "host",
            Placement::DpuVeth | Placement::DpuShm => "dpu",
        }
    }

    fn shared_memory(self) -> bool {
        self == Placement::DpuShm
    }
}

pub struct MeshOptions {
    pub namespace: String,
    pub state_dir: PathBuf,
    /// The flatmesh binary (the node proxy, the client and the server are all it).
    pub flatmesh: PathBuf,
    /// `libflatmesh_shm.so`, preloaded for `dpu-shm`.
    pub library: PathBuf,
    pub rounds: usize,
    pub seconds: u64,
    pub connections: usize,
    /// Hold every CPU out of its idle states for the run (`/dev/cpu_dma_latency` = 0).
    pub cpus_awake: bool,
}

/// Keeps the CPUs out of deep idle states while it lives: a request of 0 µs wake-up latency on
/// `/dev/cpu_dma_latency`, which holds as long as the file stays open. On a VM whose idle vCPUs
/// halt, waking a process on the other CPU costs 70-150 µs, which would measure the hypervisor;
/// a DPU's cores signalled over PCIe do not pay that.
pub struct CpusAwake(#[allow(dead_code)] std::fs::File);

impl CpusAwake {
    pub fn hold() -> Result<CpusAwake> {
        use std::io::Write as _;
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/cpu_dma_latency")
            .map_err(|e| {
                LabError::io(
                    "cannot open /dev/cpu_dma_latency (root, a kernel with PM QoS)",
                    e,
                )
            })?;
        file.write_all(&0i32.to_ne_bytes())
            .map_err(|e| LabError::io("cannot write /dev/cpu_dma_latency", e))?;
        Ok(CpusAwake(file))
    }
}

/// What one placement measured, summed over its rounds.
#[derive(Debug, Clone)]
pub struct PlacementResult {
    pub placement: Placement,
    /// Medians over the rounds of each round's p50 and p99.
    pub p50_us: f64,
    pub p99_us: f64,
    pub requests: u64,
    pub errors: u64,
    pub seconds: f64,
    /// CPU time of the processes on each PU, per answered request.
    pub host_cpu_us: f64,
    pub dpu_cpu_us: f64,
    /// Connections that moved to shared memory, as the libraries count them at exit: the
    /// client's, and the node proxy's (its accepted and its upstream connections together).
    pub shm_connections: u64,
    pub shm_node_connections: u64,
}

impl PlacementResult {
    pub fn requests_per_second(&self) -> f64 {
        self.requests as f64 / self.seconds.max(f64::MIN_POSITIVE)
    }
}

/// One load run, as `flatmesh pu app load` prints it (one JSON line).
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct LoadLine {
    pub ok: u64,
    pub errors: u64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub elapsed_s: f64,
    /// The client's own CPU time (user + system).
    pub cpu_s: f64,
}

fn config(opts: &MeshOptions) -> Result<SplitConfig> {
    let dpu_cpu = if std::thread::available_parallelism().map_or(1, |n| n.get()) > 1 {
        "1"
    } else {
        "0"
    };
    // `proxy_uid`: with the proxy on the host, the host's own apps are intercepted too (the
    // proxy's uid would be exempt; the node only dials loopback, which is never intercepted).
    // A slow agent poll: a pass costs milliseconds of CPU (BENCHMARKS.md, "Split network
    // namespace across PUs"), which at the usual 20-50 ms would take a visible share of the
    // CPUs being measured. The bind hook claims the node's ports at bind() all the same.
    let text = format!(
        "namespace: {ns}\nstate_dir: {dir}\npoll_interval_ms: {POLL_MS}\npus:\n  - {{ name: host, cpus: \"0\" }}\n  - {{ name: dpu, cpus: \"{dpu_cpu}\" }}\nuplink: dpu\nintercept:\n  - {{ proxy_port: {PROXY_PORT}, ports: [80], proxy_uid: 1337 }}\n",
        ns = opts.namespace,
        dir = opts.state_dir.display()
    );
    Ok(SplitConfig::parse(&text, "mesh demo config")?)
}

fn node_yaml(server_port: u16) -> String {
    format!(
        "admin: 127.0.0.1:{NODE_ADMIN}
workers: 1
listeners:
  - name: mesh
    address: 127.0.0.1:{PROXY_PORT}
    protocol: http
    routes:
      - match: {{ path: {{ prefix: / }} }}
        cluster: app
clusters:
  - name: app
    endpoints: [ 127.0.0.1:{server_port} ]
"
    )
}

/// `flatmesh ARGS` on PU `pu`, dying with this process, with the library preloaded if
/// `library` is given (its exit report appended to `stats`).
fn flatmesh_on(
    pod: &Pod,
    opts: &MeshOptions,
    pu: &str,
    args: &[&str],
    library: Option<&Path>,
    stats: Option<&Path>,
) -> Result<Command> {
    let mut command = pod
        .backend
        .command(pod.pu(pu)?, opts.flatmesh.as_os_str())?;
    command.args(args).stdin(Stdio::null());
    if let Some(library) = library {
        command.env("LD_PRELOAD", library);
    }
    if let Some(stats) = stats {
        command.env("FLATMESH_SHM_STATS", stats);
    }
    crate::pu::demo::die_with_parent(&mut command);
    Ok(command)
}

fn spawn(mut command: Command, what: &str) -> Result<Child> {
    command
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| LabError::io(format!("cannot start {what}"), e))
}

/// Stops a node with SIGTERM (so its library writes its exit report), SIGKILL after 5 s.
fn stop(mut child: Child) {
    // SAFETY: kill takes a pid and a signal, no memory.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    for _ in 0..250 {
        if matches!(child.try_wait(), Ok(Some(_))) {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The `accelerated` counts of every exit report in `path` (docs/shm.md "Observability").
fn accelerated(path: &Path) -> u64 {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("flatmesh-shm pid "))
        .filter_map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            let at = words.iter().position(|w| *w == "accelerated")?;
            words.get(at + 1)?.parse::<u64>().ok()
        })
        .sum()
}

/// One round of one placement: the node up on its PU, the load, the node down.
fn round(
    pod: &Pod,
    opts: &MeshOptions,
    placement: Placement,
    server_pids: &[u32],
) -> Result<Round> {
    let dir = pod.config.table_dir();
    let library = placement.shared_memory().then_some(opts.library.as_path());
    let server_port = if placement.shared_memory() {
        SERVER_SHM
    } else {
        SERVER_TCP
    };
    let node_config = dir.join("mesh-node.yaml");
    std::fs::write(&node_config, node_yaml(server_port))
        .map_err(|e| LabError::io("cannot write the node proxy config", e))?;
    let node_log = std::fs::File::create(dir.join("mesh-node.log"))
        .map_err(|e| LabError::io("cannot create the node proxy log", e))?;
    let config_arg = node_config.to_string_lossy().into_owned();
    let node_stats = dir.join("mesh-node.stats");
    let _ = std::fs::remove_file(&node_stats);
    let mut node = flatmesh_on(
        pod,
        opts,
        placement.pu(),
        &["node", "--config", &config_arg],
        library,
        Some(&node_stats),
    )?;
    node.stderr(node_log);
    let node = spawn(node, "the node proxy")?;
    let node_pid = node.id();
    // Ready when the proxy's port is its PU's and the other PU's rules follow.
    let pu = placement.pu();
    let ready = pod.wait_for_table(Duration::from_secs(10), |s| {
        s.ports.get(&PROXY_PORT).map(String::as_str) == Some(pu)
    });
    if !ready {
        stop(node);
        return Err(LabError::Demo {
            what: format!("{}: the node proxy", placement.label()),
            message: format!(
                "port {PROXY_PORT} never became PU {pu}'s; see {}",
                dir.join("mesh-node.log").display()
            ),
        });
    }
    let client_stats = dir.join("mesh-client.stats");
    let _ = std::fs::remove_file(&client_stats);
    let (connections, seconds) = (opts.connections.to_string(), opts.seconds.to_string());
    let mut client = flatmesh_on(
        pod,
        opts,
        "host",
        &[
            "pu",
            "app",
            "load",
            "--target",
            SERVICE,
            "--connections",
            &connections,
            "--seconds",
            &seconds,
        ],
        library,
        Some(&client_stats),
    )?;
    let cpu = |pids: &[u32]| {
        pids.iter()
            .map(|p| crate::cpu_use::process_seconds(*p))
            .sum::<f64>()
    };
    let (servers_before, node_before) =
        (cpu(server_pids), crate::cpu_use::process_seconds(node_pid));
    let output = client
        .stderr(Stdio::piped())
        .stdout(Stdio::piped())
        .output()
        .map_err(|e| LabError::io("cannot run the load client", e))?;
    let (servers_after, node_after) = (cpu(server_pids), crate::cpu_use::process_seconds(node_pid));
    stop(node);
    let text = String::from_utf8_lossy(&output.stdout);
    let line: LoadLine = text
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .ok_or_else(|| LabError::Demo {
            what: format!("{}: the load client", placement.label()),
            message: format!(
                "no result ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ),
        })?;
    let node_cpu = node_after - node_before;
    let server_cpu = servers_after - servers_before;
    let (host_cpu, dpu_cpu) = match placement {
        Placement::Host => (line.cpu_s + server_cpu + node_cpu, 0.0),
        Placement::DpuVeth | Placement::DpuShm => (line.cpu_s + server_cpu, node_cpu),
    };
    // The proxy's ports are released by the agents once nothing holds them.
    pod.wait_for_table(Duration::from_secs(10), |s| {
        !s.ports.contains_key(&PROXY_PORT) && !s.ports.contains_key(&NODE_ADMIN)
    });
    Ok(Round {
        load: line,
        host_cpu,
        dpu_cpu,
        shm_client: accelerated(&client_stats),
        shm_node: accelerated(&node_stats),
    })
}

/// What one round of one placement measured.
#[derive(Debug, Clone, Copy)]
struct Round {
    load: LoadLine,
    /// CPU seconds on each PU.
    host_cpu: f64,
    dpu_cpu: f64,
    shm_client: u64,
    shm_node: u64,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// Runs the scenario: `progress` hears of each step.
pub fn run_mesh(opts: &MeshOptions, progress: &dyn Fn(&str)) -> Result<Vec<PlacementResult>> {
    flatmesh_pu::backend::require_root()?;
    if opts.rounds == 0 || opts.seconds == 0 || !(1..=256).contains(&opts.connections) {
        return Err(LabError::InvalidOption(
            "--rounds and --seconds must be at least 1, --connections 1 to 256".into(),
        ));
    }
    for (path, what) in [(&opts.flatmesh, "flatmesh"), (&opts.library, "the library")] {
        if !path.is_file() {
            return Err(LabError::Demo {
                what: format!("{what} ({})", path.display()),
                message:
                    "not found: build both with `cargo build --release -p flatmesh -p flatmesh-shm`"
                        .into(),
            });
        }
    }
    let _awake = if opts.cpus_awake {
        Some(CpusAwake::hold()?)
    } else {
        None
    };
    let config = config(opts)?;
    cleanup::cleanup(Some(&opts.namespace), &opts.state_dir)?;
    let mut pod = Pod::up(config)?;
    pod.start_agent("host")?;
    pod.start_agent("dpu")?;
    // The server, on the host: plain for the TCP placements, preloaded for shared memory.
    let mut server_pids = Vec::new();
    for (port, library) in [
        (SERVER_TCP, None),
        (SERVER_SHM, Some(opts.library.as_path())),
    ] {
        let listen = format!("127.0.0.1:{port}");
        let server = flatmesh_on(
            &pod,
            opts,
            "host",
            &["pu", "app", "serve", "--listen", &listen],
            library,
            None,
        )?;
        let server = spawn(server, "the server")?;
        server_pids.push(server.id());
        pod.adopt(server);
    }
    let listening = pod.wait_for_table(Duration::from_secs(10), |s| {
        [SERVER_TCP, SERVER_SHM]
            .iter()
            .all(|p| s.ports.get(p).map(String::as_str) == Some("host"))
    });
    if !listening {
        return Err(LabError::Demo {
            what: "the server".into(),
            message: format!("ports {SERVER_TCP} and {SERVER_SHM} never became the host PU's"),
        });
    }
    let mut runs: Vec<Vec<Round>> = vec![Vec::new(); Placement::ALL.len()];
    for round_number in 1..=opts.rounds {
        for (i, placement) in Placement::ALL.iter().enumerate() {
            progress(&format!(
                "round {round_number}/{}: {}",
                opts.rounds,
                placement.label()
            ));
            runs[i].push(round(&pod, opts, *placement, &server_pids)?);
        }
    }
    pod.down()?;
    Ok(Placement::ALL
        .iter()
        .zip(runs)
        .map(|(placement, runs)| {
            let requests: u64 = runs.iter().map(|r| r.load.ok).sum();
            let per_request = |cpu: f64| cpu * 1e6 / requests.max(1) as f64;
            PlacementResult {
                placement: *placement,
                p50_us: median(runs.iter().map(|r| r.load.p50_us as f64).collect()),
                p99_us: median(runs.iter().map(|r| r.load.p99_us as f64).collect()),
                requests,
                errors: runs.iter().map(|r| r.load.errors).sum(),
                seconds: runs.iter().map(|r| r.load.elapsed_s).sum(),
                host_cpu_us: per_request(runs.iter().map(|r| r.host_cpu).sum()),
                dpu_cpu_us: per_request(runs.iter().map(|r| r.dpu_cpu).sum()),
                shm_connections: runs.iter().map(|r| r.shm_client).sum(),
                shm_node_connections: runs.iter().map(|r| r.shm_node).sum(),
            }
        })
        .collect())
}

/// The results as two bar charts: latency, and CPU per request on each PU.
pub fn charts(results: &[PlacementResult]) -> (String, String) {
    let categories: Vec<String> = results
        .iter()
        .map(|r| r.placement.short_label().to_string())
        .collect();
    let latency = crate::svg::bar_chart(
        "HeteroK8s-Mesh-All: end-to-end latency (client and server on the host PU)",
        "µs",
        &categories,
        &[
            ("p50".into(), results.iter().map(|r| r.p50_us).collect()),
            ("p99".into(), results.iter().map(|r| r.p99_us).collect()),
        ],
    );
    let cpu = crate::svg::bar_chart(
        "HeteroK8s-Mesh-All: CPU per request",
        "µs of CPU per request",
        &categories,
        &[
            (
                "host CPU".into(),
                results.iter().map(|r| r.host_cpu_us).collect(),
            ),
            (
                "DPU CPU".into(),
                results.iter().map(|r| r.dpu_cpu_us).collect(),
            ),
        ],
    );
    (latency, cpu)
}

/// `flatmesh pu app serve`: the server microservice, an HTTP/1.1 service answering every request
/// (`x-backend: app`). Runs until killed.
pub fn serve(listen: SocketAddr) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(LabError::Runtime)?;
    runtime.block_on(async {
        let (_, task) = crate::demo::services::spawn_http_at(
            listen,
            "app",
            crate::demo::services::HttpVersions::Http1,
        )
        .await?;
        let _ = task.await;
        Ok(())
    })
}

/// `flatmesh pu app load`: the client microservice, closed-loop HTTP/1.1 keep-alive GETs to
/// `target` on `connections` connections for `seconds`; returns one JSON line.
pub fn load(target: SocketAddr, connections: usize, seconds: u64) -> Result<LoadLine> {
    use crate::demo::load::{self, HttpTarget, Live, Plan};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(LabError::Runtime)?;
    let plan = Plan {
        http_addr: Some(target),
        targets: vec![HttpTarget {
            name: "app".into(),
            method: http::Method::GET,
            path: "/".into(),
            expect_status: http::StatusCode::OK,
        }],
        connections,
        tcp: None,
        duration: Duration::from_secs(seconds),
    };
    let results = runtime.block_on(load::run(&plan, std::sync::Arc::new(Live::default())))?;
    let answered = results
        .http
        .first()
        .ok_or_else(|| LabError::Internal("the load plan had one target but no result".into()))?;
    // SAFETY: rusage is plain integers, for which all-zero bytes are valid; getrusage writes one
    // into `usage`, a live local.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let seconds_of = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Ok(LoadLine {
        ok: answered.ok(),
        errors: answered.errors,
        p50_us: answered.latency_us.value_at_quantile(0.5),
        p99_us: answered.latency_us.value_at_quantile(0.99),
        elapsed_s: results.elapsed.as_secs_f64(),
        cpu_s: seconds_of(usage.ru_utime) + seconds_of(usage.ru_stime),
    })
}
