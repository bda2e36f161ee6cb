//! `flatmesh pu demo`: one pod split over two emulated PUs, `host` (CPU 0) and `dpu` (CPU 1).
//! The app runs on `host`; the mesh proxy, the real `flatmesh node` process, runs on `dpu`
//! (HeteroK8s-Mesh's "offload the proxy to the DPU", §5.1). Outside the pod, a network namespace
//! `fmpu-<ns>-ext` plays the rest of the cluster: services at 10.96.0.10:80, 10.96.0.11:5432 and
//! 10.96.0.12:7000, reached through `dpu`, which holds the pod's uplink.
//!
//! It shows, each as a row: direct calls over localhost in both directions, a port conflict
//! across PUs, outbound calls intercepted on `host` and carried by the flatmesh node proxy on
//! `dpu`, with `getsockopt(SO_ORIGINAL_DST)` on the proxy's own accepted socket returning the
//! address the app dialed, one call through a relay that connects to whatever SO_ORIGINAL_DST
//! says, and that nothing is left behind afterwards.

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use crate::pu::echo::{ask, EchoServer, Mode};
use crate::{LabError, Result};
use flatmesh_pu::cleanup;
use flatmesh_pu::config::SplitConfig;
use flatmesh_pu::exec::run;
use flatmesh_pu::netns;
use flatmesh_pu::pod::Pod;
use flatmesh_pu::relay::Relay;
use flatmesh_pu::topology::NETNS_PREFIX;

pub struct DemoOptions {
    pub namespace: String,
    pub state_dir: PathBuf,
    /// The flatmesh binary, to run `flatmesh node` on the dpu PU; `None` skips that row.
    pub node_proxy: Option<PathBuf>,
}

#[derive(Debug, Clone)]
pub struct DemoRow {
    pub call: String,
    pub from: String,
    pub dialed: String,
    pub handled_by: String,
    pub seen: String,
    pub ok: bool,
}

#[derive(Debug, Clone, Default)]
pub struct DemoReport {
    pub rows: Vec<DemoRow>,
    pub port_table: Vec<(u16, String)>,
    pub notes: Vec<String>,
}

const SERVICES: [(&str, &str); 3] = [
    ("svc-a", "10.96.0.10:80"),
    ("svc-b", "10.96.0.11:5432"),
    ("svc-c", "10.96.0.12:7000"),
];

/// The node proxy's config: one `tcp` listener per intercepted service, on the proxy ports the
/// interception rules redirect to.
const NODE_YAML: &str = "admin: 127.0.0.1:15000
workers: 1
listeners:
  - { name: to-svc-a, address: 127.0.0.1:15006, protocol: tcp, cluster: svc-a }
  - { name: to-svc-c, address: 127.0.0.1:15007, protocol: tcp, cluster: svc-c }
clusters:
  - { name: svc-a, endpoints: [ 10.96.0.10:80 ] }
  - { name: svc-c, endpoints: [ 10.96.0.12:7000 ] }
";

/// (service, proxy port, node listener) of the calls the node proxy carries.
const THROUGH_NODE: [(usize, u16, &str); 2] = [(0, 15006, "to-svc-a"), (2, 15007, "to-svc-c")];
/// The proxy port of the original-destination relay (carries svc-b).
const RELAY_PORT: u16 = 15001;
const NODE_ADMIN: u16 = 15000;

fn demo_config(opts: &DemoOptions) -> Result<SplitConfig> {
    let dpu_cpu = if std::thread::available_parallelism().map_or(1, |n| n.get()) > 1 {
        "1"
    } else {
        "0"
    };
    // The interception rules as they would be written for a single host (sidecar style); the
    // agents split them across the PUs (§4.1.2).
    let text = format!(
        "namespace: {ns}\nstate_dir: {dir}\npoll_interval_ms: 20\npus:\n  - {{ name: host, cpus: \"0\" }}\n  - {{ name: dpu, cpus: \"{dpu_cpu}\" }}\nuplink: dpu\nintercept:\n  - {{ proxy_port: 15006, ports: [80] }}\n  - {{ proxy_port: 15007, ports: [7000] }}\n  - {{ proxy_port: {RELAY_PORT}, ports: [5432] }}\n",
        ns = opts.namespace,
        dir = opts.state_dir.display()
    );
    Ok(SplitConfig::parse(&text, "demo config")?)
}

fn addr(s: &str) -> Result<SocketAddr> {
    s.parse().map_err(|e| LabError::Invalid {
        what: "address",
        message: format!("`{s}`: {e}"),
    })
}

/// Builds the rest of the cluster: a namespace with the services, linked to the uplink PU.
fn build_ext(pod: &mut Pod) -> Result<String> {
    let t = pod.backend.topology().clone();
    let dpu = pod.pu("dpu")?;
    let ext = format!("{NETNS_PREFIX}{}-ext", t.namespace);
    let _ = flatmesh_pu::backend::remove_netns(&ext);
    run("ip", &["netns", "add", &ext])?;
    pod.adopt_netns(&ext);
    let dpu_ns = t.netns(dpu);
    run(
        "ip",
        &[
            "link", "add", "uplink", "netns", &dpu_ns, "type", "veth", "peer", "name", "pod",
            "netns", &ext,
        ],
    )?;
    for (ns, dev, a) in [
        (&dpu_ns, "uplink", "10.213.255.1/30"),
        (&ext, "pod", "10.213.255.2/30"),
    ] {
        run("ip", &["-n", ns, "addr", "add", a, "dev", dev])?;
        run("ip", &["-n", ns, "link", "set", dev, "up"])?;
    }
    run("ip", &["-n", &ext, "link", "set", "lo", "up"])?;
    for (_, service) in SERVICES {
        let ip = service.split(':').next().unwrap_or_default();
        run(
            "ip",
            &["-n", &ext, "addr", "add", &format!("{ip}/32"), "dev", "lo"],
        )?;
    }
    run(
        "ip",
        &[
            "-n",
            &ext,
            "route",
            "add",
            "169.254.213.0/24",
            "via",
            "10.213.255.1",
        ],
    )?;
    run(
        "ip",
        &[
            "-n",
            &dpu_ns,
            "route",
            "add",
            "10.96.0.0/24",
            "via",
            "10.213.255.2",
        ],
    )?;
    Ok(ext)
}

/// Runs `f` on a thread inside a plain (non-PU) network namespace.
fn in_netns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| {
            netns::enter(ns)?;
            Ok(f())
        })
        .join()
        .unwrap_or_else(|_| {
            Err(LabError::io(
                "demo thread",
                std::io::Error::other("panicked"),
            ))
        })
    })
}

fn bind(a: &str) -> Result<TcpListener> {
    TcpListener::bind(a).map_err(|e| LabError::io(format!("cannot listen on {a}"), e))
}

/// Starts `flatmesh node` on the dpu PU; it dies with this process (also on `kill -9`).
fn start_node(pod: &mut Pod, exe: &std::path::Path) -> Result<(u32, PathBuf)> {
    let dir = pod.config.table_dir();
    std::fs::create_dir_all(&dir)
        .map_err(|e| LabError::io(format!("cannot create {}", dir.display()), e))?;
    let node_yaml = dir.join("node.yaml");
    std::fs::write(&node_yaml, NODE_YAML)
        .map_err(|e| LabError::io("cannot write the node proxy config", e))?;
    let log_path = dir.join("node.log");
    let log = std::fs::File::create(&log_path)
        .map_err(|e| LabError::io("cannot create the node proxy log", e))?;
    let dpu = pod.pu("dpu")?;
    let mut command = pod.backend.command(dpu, exe.as_os_str())?;
    command
        .args(["node", "--config"])
        .arg(&node_yaml)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    die_with_parent(&mut command);
    let child = command
        .spawn()
        .map_err(|e| LabError::io(format!("cannot start {}", exe.display()), e))?;
    let pid = child.id();
    pod.adopt(child);
    Ok((pid, log_path))
}

/// Makes the process `command` starts die (SIGKILL) when this one does, also on `kill -9`, so
/// that a demo killed half-way leaves no proxy or app running.
pub(crate) fn die_with_parent(command: &mut std::process::Command) {
    // SAFETY: prctl(PR_SET_PDEATHSIG) is async-signal-safe and touches no memory of ours.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// `flatmesh_downstream_connections_total{listener="NAME"}` from the node's admin port, read
/// from a thread on the dpu PU (HTTP/1.0, so the body is not chunked).
fn node_connections(pod: &Pod, listener: &str) -> Option<u64> {
    let text = pod
        .on("dpu", || -> std::io::Result<String> {
            let timeout = Duration::from_secs(2);
            let mut s = TcpStream::connect_timeout(
                &SocketAddr::from(([127, 0, 0, 1], NODE_ADMIN)),
                timeout,
            )?;
            s.set_read_timeout(Some(timeout))?;
            s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
            let mut body = String::new();
            s.take(4 << 20).read_to_string(&mut body)?;
            Ok(body)
        })
        .ok()?
        .ok()?;
    // Prometheus counters carry a `_total` suffix; the listener is the only label.
    let key = format!("flatmesh_downstream_connections_total{{listener=\"{listener}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&key))
        .and_then(|v| v.trim().parse().ok())
}

/// One call from the app on `host` to `target`, intercepted and carried by the node proxy on
/// `dpu`: the app's view, what the proxy's own socket says with SO_ORIGINAL_DST, the proxy's
/// connection count, and the service's answer.
fn call_through_node(
    pod: &Pod,
    node_pid: u32,
    (name, target): (&str, SocketAddr),
    proxy_port: u16,
    listener: &str,
) -> Result<DemoRow> {
    let timeout = Duration::from_secs(2);
    let mut row = DemoRow {
        call: "intercepted".into(),
        from: "host".into(),
        dialed: target.to_string(),
        handled_by: format!("flatmesh node on dpu\nlistener {listener} (:{proxy_port})"),
        seen: String::new(),
        ok: false,
    };
    let before = node_connections(pod, listener).unwrap_or(0);
    let stream = pod.on("host", || TcpStream::connect_timeout(&target, timeout))?;
    let mut stream = match stream {
        Ok(s) => s,
        Err(e) => {
            row.seen = format!("connect failed: {e}");
            return Ok(row);
        }
    };
    let app_peer = stream.peer_addr().ok();
    let app_port = stream.local_addr().map(|a| a.port()).unwrap_or(0);
    // The proxy accepts asynchronously; look for its end of this connection for up to 3 s.
    let mut orig = Err("the node never accepted the connection".to_string());
    for _ in 0..150 {
        match flatmesh_pu::relay::original_dst_in_process(node_pid, proxy_port, app_port) {
            Ok(Some(o)) => {
                orig = Ok(o);
                break;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => {
                orig = Err(format!("cannot inspect the node's socket: {e}"));
                break;
            }
        }
    }
    let answer = (|| -> std::io::Result<String> {
        stream.set_read_timeout(Some(timeout))?;
        writeln!(stream, "GET via flatmesh node")?;
        let mut line = String::new();
        BufReader::new(&stream).take(4096).read_line(&mut line)?;
        Ok(line.trim().to_string())
    })();
    drop(stream);
    let after = node_connections(pod, listener).unwrap_or(0);
    let counted = after.saturating_sub(before);
    row.ok = app_peer == Some(target)
        && orig.as_ref().ok().map(|o| SocketAddr::V4(*o)) == Some(target)
        && counted >= 1
        && answer.as_ref().is_ok_and(|a| a.starts_with(name));
    row.seen = format!(
        "app's peer={}\nSO_ORIGINAL_DST on the node's socket={}\nnode metrics: {counted} new connection(s) on {listener}\n{}",
        app_peer.map_or("?".into(), |p| p.to_string()),
        orig.map_or_else(|e| e, |o| o.to_string()),
        answer.unwrap_or_else(|e| format!("error: {e}"))
    );
    Ok(row)
}

pub fn run_demo(opts: &DemoOptions) -> Result<DemoReport> {
    flatmesh_pu::backend::require_root()?;
    let config = demo_config(opts)?;
    // Whatever an earlier run left (it was killed, say): removed before anything is built.
    let earlier = cleanup::cleanup(Some(&opts.namespace), &opts.state_dir)?;
    let mut report = DemoReport::default();
    if !earlier.is_empty() {
        report.notes.push(format!(
            "removed leftovers of an earlier run: {} network namespace(s), {} cgroup(s), {} state dir(s)",
            earlier.netns.len(),
            earlier.cgroups.len(),
            earlier.state_dirs.len()
        ));
    }
    let mut pod = Pod::up(config)?;
    let ext = build_ext(&mut pod)?;

    // The rest of the cluster.
    let _services = in_netns(&ext, || -> Result<Vec<EchoServer>> {
        SERVICES
            .iter()
            .map(|(name, a)| {
                EchoServer::start(bind(a)?, name, Mode::Describe)
                    .map_err(|e| LabError::io("echo server", e))
            })
            .collect()
    })??;

    // The pod: agents first, then its processes.
    pod.start_agent("host")?;
    pod.start_agent("dpu")?;
    let _web = pod.on("host", || -> Result<EchoServer> {
        EchoServer::start(bind("127.0.0.1:8080")?, "web@host", Mode::Describe)
            .map_err(|e| LabError::io("web", e))
    })??;
    let _cart = pod.on("dpu", || -> Result<EchoServer> {
        EchoServer::start(bind("127.0.0.1:9080")?, "cart@dpu", Mode::Describe)
            .map_err(|e| LabError::io("cart", e))
    })??;
    let relay = pod.on("dpu", || -> Result<Relay> {
        Relay::start(bind(&format!("127.0.0.1:{RELAY_PORT}"))?)
            .map_err(|e| LabError::io("relay", e))
    })??;
    let node = match &opts.node_proxy {
        Some(exe) => Some(start_node(&mut pod, exe)?),
        None => None,
    };
    let ready = pod.wait_for_table(Duration::from_secs(10), |s| {
        let owner = |p: u16| s.ports.get(&p).map(String::as_str);
        owner(8080) == Some("host")
            && owner(9080) == Some("dpu")
            && owner(RELAY_PORT) == Some("dpu")
            && (node.is_none()
                || THROUGH_NODE
                    .iter()
                    .all(|(_, port, _)| owner(*port) == Some("dpu")))
    });
    if !ready {
        report
            .notes
            .push("the port table did not fill within 10 s; rows below may fail".into());
    }

    // Direct calls.
    let host_to_dpu = pod.on("host", || {
        ask(SocketAddr::from(([127, 0, 0, 1], 9080)), "hello from host")
    })?;
    report.rows.push(row(
        "direct",
        "host",
        "127.0.0.1:9080",
        "cart on dpu",
        host_to_dpu,
        |s| s.starts_with("cart@dpu") && s.contains("peer=127.0.0.1"),
    ));
    let dpu_to_host = pod.on("dpu", || {
        ask(SocketAddr::from(([127, 0, 0, 1], 8080)), "hello from dpu")
    })?;
    report.rows.push(row(
        "direct",
        "dpu",
        "127.0.0.1:8080",
        "web on host",
        dpu_to_host,
        |s| s.starts_with("web@host") && s.contains("peer=127.0.0.1"),
    ));

    // A port held by the other PU.
    let conflict = pod.on("host", || TcpListener::bind("127.0.0.1:9080").map(|_| ()))?;
    report.rows.push(DemoRow {
        call: "bind".into(),
        from: "host".into(),
        dialed: "bind 127.0.0.1:9080".into(),
        handled_by: "bind hook (dpu owns 9080)".into(),
        ok: conflict.as_ref().err().and_then(|e| e.raw_os_error()) == Some(libc::EADDRINUSE),
        seen: match conflict {
            Ok(()) => "bind succeeded (should have failed)".into(),
            Err(e) => e.to_string(),
        },
    });

    // Intercepted calls carried by the flatmesh node proxy on the other PU.
    match &node {
        Some((pid, log)) => {
            for (service, port, listener) in THROUGH_NODE {
                let (name, a) = SERVICES[service];
                report.rows.push(call_through_node(
                    &pod,
                    *pid,
                    (name, addr(a)?),
                    port,
                    listener,
                )?);
            }
            if report.rows.iter().any(|r| !r.ok) {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(5).collect();
                for line in tail.into_iter().rev() {
                    report.notes.push(format!("flatmesh node: {line}"));
                }
            }
        }
        None => report
            .notes
            .push("--no-node-proxy: the rows through `flatmesh node` were skipped".into()),
    }

    // One call through a relay that connects wherever SO_ORIGINAL_DST says (what an
    // original-destination cluster does; the node proxy has none yet, see docs/pu.md).
    let (name, a) = SERVICES[1];
    let target = addr(a)?;
    let answer = pod.on("host", || ask(target, "GET via relay"))?;
    let local = answer.as_ref().ok().map(|(_, l)| *l);
    let record = relay.records().into_iter().find(|r| Some(r.peer) == local);
    let orig = record.as_ref().and_then(|r| r.original_dst);
    report.rows.push(DemoRow {
        call: "intercepted".into(),
        from: "host".into(),
        dialed: a.to_string(),
        handled_by: format!("orig-dst relay on dpu (:{RELAY_PORT})"),
        ok: answer.as_ref().is_ok_and(|(s, _)| s.starts_with(name))
            && orig.map(SocketAddr::V4) == Some(target),
        seen: format!(
            "SO_ORIGINAL_DST on the relay's socket={}, relay connected there\n{}",
            orig.map_or("none".into(), |o| o.to_string()),
            answer.map_or_else(|e| format!("error: {e}"), |(s, _)| s)
        ),
    });

    report.port_table = pod.table().read()?.ports.into_iter().collect();
    let leaked = cleanup::host_tables()?;
    report.rows.push(DemoRow {
        call: "check".into(),
        from: "host ns".into(),
        dialed: "nft list tables".into(),
        handled_by: "-".into(),
        ok: leaked.is_empty(),
        seen: if leaked.is_empty() {
            "no flatmesh-pu table in the host namespace".into()
        } else {
            format!("leaked: {leaked:?}")
        },
    });
    drop(relay);
    let table_dir = pod.config.table_dir();
    pod.down()?;
    let left = cleanup::leftovers(&opts.namespace, &table_dir);
    report.rows.push(DemoRow {
        call: "clean-up".into(),
        from: "-".into(),
        dialed: "pod down".into(),
        handled_by: "-".into(),
        ok: left.is_empty(),
        seen: if left.is_empty() {
            "no namespace, veth, cpuset, rule or port table left".into()
        } else {
            format!("left behind: {}", left.join(", "))
        },
    });
    Ok(report)
}

fn row(
    call: &str,
    from: &str,
    dialed: &str,
    handled_by: &str,
    answer: std::io::Result<(String, SocketAddr)>,
    check: impl Fn(&str) -> bool,
) -> DemoRow {
    let (seen, ok) = match answer {
        Ok((s, _)) => {
            let ok = check(&s);
            (s, ok)
        }
        Err(e) => (format!("error: {e}"), false),
    };
    DemoRow {
        call: call.into(),
        from: from.into(),
        dialed: dialed.into(),
        handled_by: handled_by.into(),
        seen,
        ok,
    }
}
