//! Capture with a real cgroup: a workload's connect() to a service address lands on the
//! proxy; the proxy recovers the original destination by socket cookie and with
//! getsockopt(SO_ORIGINAL_DST); the proxy's own connections are never captured.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use common::*;
use flatmesh_kernel::{original_dst_sockopt, CaptureConfig, KernelTier};

/// Child helper: joins FM_CGROUP, says "ready", waits for a line on stdin, connects to
/// FM_CONNECT, sends "hello\n" and prints the reply line.
#[test]
#[ignore = "helper run as a child process by the capture tests"]
fn child_connect() {
    let (Ok(cgroup), Ok(addr)) = (std::env::var("FM_CGROUP"), std::env::var("FM_CONNECT")) else {
        return;
    };
    std::fs::write(
        format!("{cgroup}/cgroup.procs"),
        std::process::id().to_string(),
    )
    .unwrap_or_else(|e| panic!("joining {cgroup}: {e}"));
    if let Ok(uid) = std::env::var("FM_UID") {
        let uid: u32 = uid.parse().unwrap_or_else(|e| panic!("FM_UID {uid}: {e}"));
        // SAFETY: no pointers; the whole process becomes `uid` (glibc applies it to every thread).
        let rc = unsafe { libc::setresuid(uid, uid, uid) };
        assert_eq!(
            rc,
            0,
            "setresuid({uid}): {}",
            std::io::Error::last_os_error()
        );
    }
    println!("ready");
    let _ = std::io::stdout().flush();
    let mut go = String::new();
    let _ = std::io::stdin().read_line(&mut go);
    let addr: SocketAddr = addr.parse().unwrap_or_else(|e| panic!("{addr}: {e}"));
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(3))
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.write_all(b"hello\n").unwrap_or_else(|e| panic!("{e}"));
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let mut reply = String::new();
    BufReader::new(s)
        .read_line(&mut reply)
        .unwrap_or_else(|e| panic!("{e}"));
    println!("reply:{}", reply.trim_end());
}

/// Serves one connection: answers "<name> orig=<by cookie> sockopt=<by getsockopt>".
fn serve_one(
    l: TcpListener,
    name: &'static str,
    tier: KernelTier,
    v6: bool,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap_or_else(|e| panic!("accept: {e}"));
        let mut buf = [0u8; 6];
        let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
        let _ = s.read_exact(&mut buf);
        let by_cookie = tier
            .original_dst(&s)
            .ok()
            .flatten()
            .map(|a| a.to_string())
            .unwrap_or("-".into());
        let by_sockopt = original_dst_sockopt(&s, v6)
            .map(|a| a.to_string())
            .unwrap_or_else(|e| format!("err({e})"));
        let _ = writeln!(s, "{name} orig={by_cookie} sockopt={by_sockopt}");
    })
}

/// Runs the child in `cgroup` against `addr`; `before_go` runs with the child's pid once it
/// is in the cgroup. Returns its reply line.
fn run_child(cgroup: &TestCgroup, addr: SocketAddr, before_go: impl FnOnce(u32)) -> String {
    run_child_as(&cgroup.path, None, addr, before_go)
}

/// As `run_child`, in cgroup directory `cgroup` and, with `uid`, as that user.
fn run_child_as(
    cgroup: &std::path::Path,
    uid: Option<u32>,
    addr: SocketAddr,
    before_go: impl FnOnce(u32),
) -> String {
    let mut env = vec![
        ("FM_CGROUP", cgroup.display().to_string()),
        ("FM_CONNECT", addr.to_string()),
    ];
    env.extend(uid.map(|u| ("FM_UID", u.to_string())));
    let mut kid = child("child_connect", &env);
    let mut out = BufReader::new(
        kid.stdout
            .take()
            .unwrap_or_else(|| panic!("no child stdout")),
    );
    child_line(&mut out, "ready");
    before_go(kid.id());
    if let Some(mut stdin) = kid.stdin.take() {
        let _ = stdin.write_all(b"go\n");
    }
    let reply = child_line(&mut out, "reply:");
    let _ = kid.wait();
    reply
}

fn tier(test: &str, cgroup: &TestCgroup) -> KernelTier {
    require_root();
    let mut cfg = config(test);
    cfg.capture = Some(CaptureConfig {
        cgroup: cgroup.path.clone(),
    });
    KernelTier::attach(&cfg).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn workload_connections_reach_the_proxy_with_their_original_destination() {
    let cgroup = TestCgroup::new("capture");
    let tier = tier("capture", &cgroup);
    let (proxy, proxy_port) = listener();
    let vip: SocketAddr = "10.254.7.1:8080".parse().unwrap_or_else(|e| panic!("{e}"));
    tier.add_service(vip, SocketAddr::from(([127, 0, 0, 1], proxy_port)))
        .unwrap_or_else(|e| panic!("{e}"));
    let server = serve_one(proxy, "proxy", tier.clone(), false);
    let reply = run_child(&cgroup, vip, |_| {});
    let _ = server.join();
    assert_eq!(reply, format!("proxy orig={vip} sockopt={vip}"));
    let st = tier.status().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(st.stat("fm_connect4").hits, 1, "{st}");
    assert_eq!(st.stat("fm_getsockopt").hits, 1, "{st}");
    tier.detach().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn ipv6_service_addresses_are_captured_too() {
    let cgroup = TestCgroup::new("capture6");
    let tier = tier("capture6", &cgroup);
    let proxy = TcpListener::bind("[::1]:0").unwrap_or_else(|e| panic!("bind [::1]: {e}"));
    let proxy_addr = proxy.local_addr().unwrap_or_else(|e| panic!("{e}"));
    let vip: SocketAddr = "[fd00:fe::7]:9090"
        .parse()
        .unwrap_or_else(|e| panic!("{e}"));
    tier.add_service(vip, proxy_addr)
        .unwrap_or_else(|e| panic!("{e}"));
    let server = serve_one(proxy, "proxy6", tier.clone(), true);
    let reply = run_child(&cgroup, vip, |_| {});
    let _ = server.join();
    assert_eq!(reply, format!("proxy6 orig={vip} sockopt={vip}"));
    assert!(
        tier.add_service(vip, SocketAddr::from(([127, 0, 0, 1], 1)))
            .is_err(),
        "mixed families must be refused"
    );
    tier.detach().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn the_proxy_and_other_cgroups_are_never_captured() {
    let cgroup = TestCgroup::new("capture-bypass");
    let tier = tier("capture-bypass", &cgroup);
    let (proxy, proxy_port) = listener();
    let (service, service_port) = listener();
    let service_addr = SocketAddr::from(([127, 0, 0, 1], service_port));
    tier.add_service(service_addr, SocketAddr::from(([127, 0, 0, 1], proxy_port)))
        .unwrap_or_else(|e| panic!("{e}"));

    // A process registered as the proxy reaches the real service even from the cgroup.
    let server = serve_one(
        service.try_clone().unwrap_or_else(|e| panic!("{e}")),
        "service",
        tier.clone(),
        false,
    );
    let t = tier.clone();
    let reply = run_child(&cgroup, service_addr, move |pid| {
        t.bypass_pid(pid).unwrap_or_else(|e| panic!("{e}"))
    });
    let _ = server.join();
    assert!(
        reply.starts_with("service orig=- "),
        "bypassed process was captured: {reply}"
    );

    // This test process is not in the capture cgroup: its connection is not captured either.
    let server = serve_one(service, "service", tier.clone(), false);
    let mut s = TcpStream::connect(service_addr).unwrap_or_else(|e| panic!("{e}"));
    write_all(&mut s, b"hello\n");
    let mut line = String::new();
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    BufReader::new(s)
        .read_line(&mut line)
        .unwrap_or_else(|e| panic!("{e}"));
    let _ = server.join();
    assert!(
        line.starts_with("service orig=- "),
        "connection outside the cgroup was captured: {line}"
    );
    drop(proxy);
    tier.detach().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn each_captured_connection_names_the_process_that_made_it() {
    let cgroup = TestCgroup::new("capture-source");
    let tier = tier("capture-source", &cgroup);
    let (proxy, proxy_port) = listener();
    let vip: SocketAddr = "10.254.7.2:8080".parse().unwrap_or_else(|e| panic!("{e}"));
    tier.add_service(vip, SocketAddr::from(([127, 0, 0, 1], proxy_port)))
        .unwrap_or_else(|e| panic!("{e}"));
    // Two workloads: sub-cgroups of the capture cgroup (connect4 applies to them too), each
    // under a user of its own.
    let workloads = [("a", 4101u32), ("b", 4102u32)];
    for (name, uid) in workloads {
        let dir = cgroup.path.join(name);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let t = tier.clone();
        let listener = proxy.try_clone().unwrap_or_else(|e| panic!("{e}"));
        let server = std::thread::spawn(move || {
            let (mut s, peer) = listener.accept().unwrap_or_else(|e| panic!("accept: {e}"));
            let local = s.local_addr().unwrap_or_else(|e| panic!("{e}"));
            let source = t.source(peer, local).unwrap_or_else(|e| panic!("{e}"));
            let mut buf = [0u8; 6];
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            let _ = s.read_exact(&mut buf);
            let _ = writeln!(s, "ok");
            source
        });
        let reply = run_child_as(&dir, Some(uid), vip, |_| {});
        assert_eq!(reply, "ok");
        let source = server
            .join()
            .unwrap_or_else(|_| panic!("server thread"))
            .unwrap_or_else(|| panic!("no source recorded for workload {name}"));
        let id = flatmesh_kernel::cgroup_id(&dir).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            source,
            flatmesh_kernel::SourceProcess { cgroup_id: id, uid },
            "workload {name}"
        );
        // The child has exited; the kernel may take a moment to let its cgroup go.
        for _ in 0..50 {
            if std::fs::remove_dir(&dir).is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    // A connection the kernel did not capture (this process is outside the cgroup) has none.
    let s = TcpStream::connect(("127.0.0.1", proxy_port)).unwrap_or_else(|e| panic!("{e}"));
    let (accepted, peer) = proxy.accept().unwrap_or_else(|e| panic!("{e}"));
    let local = accepted.local_addr().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        tier.source(peer, local).unwrap_or_else(|e| panic!("{e}")),
        None
    );
    drop((s, accepted));
    tier.detach().unwrap_or_else(|e| panic!("{e}"));
}
