//! `flatmesh pu demo`: one pod split over two emulated PUs, `host` (CPU 0) and `dpu` (CPU 1).
//! The app runs on `host`; the mesh proxies run on `dpu` (HeteroK8s-Mesh's "offload the proxy to
//! the DPU", §5.1). Outside the pod, a network namespace `fmpu-<ns>-ext` plays the rest of the
//! cluster: services at 10.96.0.10:80, 10.96.0.11:5432 and 10.96.0.12:7000, reached through
//! `dpu`, which holds the pod's uplink.
//!
//! It shows, each as a row: direct calls over localhost in both directions, a port conflict
//! across PUs, outbound calls intercepted and read with SO_ORIGINAL_DST by a relay on the other
//! PU, and an intercepted call carried by the flatmesh node proxy on the other PU.

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use crate::config::SplitConfig;
use crate::echo::{ask, EchoServer, Mode};
use crate::error::{PuError, Result};
use crate::exec::run;
use crate::netns;
use crate::pod::Pod;
use crate::relay::Relay;
use crate::topology::NETNS_PREFIX;
use crate::{cleanup, PuBackend as _};

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

fn demo_config(opts: &DemoOptions) -> Result<SplitConfig> {
    let dpu_cpu = if std::thread::available_parallelism().map_or(1, |n| n.get()) > 1 {
        "1"
    } else {
        "0"
    };
    let text = format!(
        "namespace: {ns}\nstate_dir: {dir}\npoll_interval_ms: 20\npus:\n  - {{ name: host, cpus: \"0\" }}\n  - {{ name: dpu, cpus: \"{dpu_cpu}\" }}\nuplink: dpu\nintercept:\n  - {{ proxy_port: 15001, ports: [80, 5432] }}\n  - {{ proxy_port: 15006, ports: [7000] }}\n",
        ns = opts.namespace,
        dir = opts.state_dir.display()
    );
    SplitConfig::parse(&text, "demo config")
}

fn addr(s: &str) -> Result<SocketAddr> {
    s.parse().map_err(|e| PuError::Parse {
        what: s.to_string(),
        message: format!("{e}"),
    })
}

/// Builds the rest of the cluster: a namespace with the services, linked to the uplink PU.
fn build_ext(pod: &mut Pod) -> Result<String> {
    let t = pod.backend.topology().clone();
    let dpu = pod.pu("dpu")?;
    let ext = format!("{NETNS_PREFIX}{}-ext", t.namespace);
    let _ = crate::backend::remove_netns(&ext);
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
            Err(PuError::io(
                "demo thread",
                std::io::Error::other("panicked"),
            ))
        })
    })
}

fn bind(a: &str) -> Result<TcpListener> {
    TcpListener::bind(a).map_err(|e| PuError::io(format!("cannot listen on {a}"), e))
}

pub fn run_demo(opts: &DemoOptions) -> Result<DemoReport> {
    crate::backend::require_root()?;
    let config = demo_config(opts)?;
    let _ = cleanup::cleanup(Some(&opts.namespace), &opts.state_dir);
    let mut pod = Pod::up(config)?;
    let ext = build_ext(&mut pod)?;
    let mut report = DemoReport::default();

    // The rest of the cluster.
    let _services = in_netns(&ext, || -> Result<Vec<EchoServer>> {
        SERVICES
            .iter()
            .map(|(name, a)| {
                EchoServer::start(bind(a)?, name, Mode::Describe)
                    .map_err(|e| PuError::io("echo server", e))
            })
            .collect()
    })??;

    // The pod: agents first, then its processes.
    pod.start_agent("host")?;
    pod.start_agent("dpu")?;
    let _web = pod.on("host", || -> Result<EchoServer> {
        EchoServer::start(bind("127.0.0.1:8080")?, "web@host", Mode::Describe)
            .map_err(|e| PuError::io("web", e))
    })??;
    let _cart = pod.on("dpu", || -> Result<EchoServer> {
        EchoServer::start(bind("127.0.0.1:9080")?, "cart@dpu", Mode::Describe)
            .map_err(|e| PuError::io("cart", e))
    })??;
    let relay = pod.on("dpu", || -> Result<Relay> {
        Relay::start(bind("127.0.0.1:15001")?).map_err(|e| PuError::io("relay", e))
    })??;
    if let Some(exe) = &opts.node_proxy {
        let node_yaml = pod.config.table_dir().join("node.yaml");
        std::fs::write(
            &node_yaml,
            "admin: 127.0.0.1:15000\nworkers: 1\nlisteners:\n  - { name: intercepted, address: 127.0.0.1:15006, protocol: tcp, cluster: svc-c }\nclusters:\n  - { name: svc-c, endpoints: [ 10.96.0.12:7000 ] }\n",
        )
        .map_err(|e| PuError::io("cannot write the node proxy config", e))?;
        let dpu = pod.pu("dpu")?;
        let child = pod
            .backend
            .command(dpu, exe.as_os_str())?
            .args(["node", "--config"])
            .arg(&node_yaml)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| PuError::io(format!("cannot start {}", exe.display()), e))?;
        pod.adopt(child);
    }
    let want_node = opts.node_proxy.is_some();
    let ready = pod.wait_for_table(Duration::from_secs(10), |s| {
        let owner = |p: u16| s.ports.get(&p).map(String::as_str);
        owner(8080) == Some("host")
            && owner(9080) == Some("dpu")
            && owner(15001) == Some("dpu")
            && (!want_node || owner(15006) == Some("dpu"))
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
        |s| s.contains("peer=127.0.0.1"),
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
        |s| s.contains("peer=127.0.0.1"),
    ));

    // A port held by the other PU.
    let conflict = pod.on("host", || TcpListener::bind("127.0.0.1:9080").map(|_| ()))?;
    report.rows.push(DemoRow {
        call: "bind".into(),
        from: "host".into(),
        dialed: "bind 127.0.0.1:9080".into(),
        handled_by: "placeholder on host (dpu owns 9080)".into(),
        ok: conflict.as_ref().err().and_then(|e| e.raw_os_error()) == Some(libc::EADDRINUSE),
        seen: match conflict {
            Ok(()) => "bind succeeded (should have failed)".into(),
            Err(e) => e.to_string(),
        },
    });

    // Intercepted calls, read with SO_ORIGINAL_DST on the other PU.
    for (name, a) in &SERVICES[..2] {
        let target = addr(a)?;
        let answer = pod.on("host", || ask(target, "GET via relay"))?;
        let local = answer.as_ref().ok().map(|(_, l)| *l);
        let record = relay.records().into_iter().find(|r| Some(r.peer) == local);
        let orig = record.as_ref().and_then(|r| r.original_dst);
        let ok = answer.as_ref().is_ok_and(|(s, _)| s.starts_with(name))
            && orig.map(SocketAddr::V4) == Some(target);
        report.rows.push(DemoRow {
            call: "intercepted".into(),
            from: "host".into(),
            dialed: a.to_string(),
            handled_by: "orig-dst relay on dpu :15001".into(),
            seen: format!(
                "SO_ORIGINAL_DST={} -> {}",
                orig.map_or("none".into(), |o| o.to_string()),
                answer.map_or_else(|e| format!("error: {e}"), |(s, _)| s)
            ),
            ok,
        });
    }
    if want_node {
        let (name, a) = SERVICES[2];
        let target = addr(a)?;
        let answer = pod.on("host", || ask(target, "GET via flatmesh node"))?;
        report.rows.push(DemoRow {
            call: "intercepted".into(),
            from: "host".into(),
            dialed: a.to_string(),
            handled_by: "flatmesh node on dpu :15006 (tcp listener)".into(),
            ok: answer.as_ref().is_ok_and(|(s, _)| s.starts_with(name)),
            seen: answer.map_or_else(|e| format!("error: {e}"), |(s, _)| s),
        });
    }
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
    pod.down()?;
    let left = netns::list(&format!("{NETNS_PREFIX}{}-", opts.namespace));
    if !left.is_empty() {
        report.notes.push(format!("left behind: {left:?}"));
    }
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
