//! What the tests against a real API server share: `testenv` (a kube-apiserver and etcd,
//! ../shared/k8s/testenv or $FLATMESH_K8S_TESTENV), started per test and stopped on drop, one
//! test at a time ([`Turn`]).
#![allow(clippy::unwrap_used, dead_code)]

#[path = "../../../../proxy/tests/common/ports.rs"]
mod ports;
#[allow(unused_imports)] // not every test binary asks for a port
pub use ports::free_port;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kube::api::{Api, PostParams};

/// The test binary's one running test: taken before a test's API server starts, given back
/// when it is stopped (or when starting it failed), so the tests run one after another.
pub struct Turn;

static TAKEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl Turn {
    pub fn take() -> Turn {
        while TAKEN.swap(true, std::sync::atomic::Ordering::AcqRel) {
            std::thread::sleep(Duration::from_millis(100));
        }
        Turn
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        TAKEN.store(false, std::sync::atomic::Ordering::Release);
    }
}

/// `testenv stop` on drop, whatever happened.
pub struct TestEnv {
    script: PathBuf,
    pub dir: PathBuf,
    /// The kube-apiserver this test started again (to reap it).
    restarted: parking_lot::Mutex<Option<std::process::Child>>,
    /// Given back after `testenv stop` (fields drop after `Drop::drop`).
    _turn: Turn,
}

impl TestEnv {
    pub fn start() -> TestEnv {
        let script = match std::env::var_os("FLATMESH_K8S_TESTENV") {
            Some(path) => PathBuf::from(path),
            None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/k8s/testenv"),
        };
        assert!(
            script.is_file(),
            "testenv not found at {}: set FLATMESH_K8S_TESTENV to the testenv script (see scripts/setup)",
            script.display()
        );
        let turn = Turn::take();
        // One directory per start: tests of one binary may each start one.
        static STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("flatmesh-k8s-{}-{n}", std::process::id()));
        let env = TestEnv {
            script,
            dir,
            restarted: Default::default(),
            _turn: turn,
        };
        let out = Command::new(&env.script)
            .arg("start")
            .arg(&env.dir)
            .output()
            .expect("run testenv start");
        assert!(
            out.status.success(),
            "testenv start failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        env.reissue_server_certificate();
        env
    }

    /// testenv's server certificate is self-signed with `CA:TRUE`, which kubectl (Go) takes
    /// but rustls refuses as a server's own certificate (`CaUsedAsEndEntity`); a real cluster
    /// has a CA and a leaf. The same key and names as a self-signed leaf (`CA:FALSE`) is
    /// trusted by both, so the API server is restarted with that, at the same path.
    fn reissue_server_certificate(&self) {
        let out = Command::new("openssl")
            .args(["req", "-x509", "-key"])
            .arg(self.dir.join("apiserver.key"))
            .arg("-out")
            .arg(self.dir.join("apiserver.crt"))
            .args([
                "-days",
                "2",
                "-subj",
                "/CN=kube-apiserver",
                "-addext",
                "subjectAltName=IP:127.0.0.1,DNS:localhost",
                "-addext",
                "basicConstraints=critical,CA:FALSE",
                "-addext",
                "keyUsage=critical,digitalSignature,keyEncipherment",
                "-addext",
                "extendedKeyUsage=serverAuth",
            ])
            .output()
            .expect("run openssl");
        assert!(
            out.status.success(),
            "openssl: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let argv = self.stop_apiserver();
        self.start_apiserver(&argv);
    }

    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.join("kubeconfig")
    }

    /// Stop kube-apiserver (etcd keeps its data) and return how to start it again: SIGTERM,
    /// then SIGKILL if it is still there after 5 s (a graceful stop waits for open watches).
    pub fn stop_apiserver(&self) -> Vec<String> {
        let pid = std::fs::read_to_string(self.dir.join("apiserver.pid")).unwrap();
        let pid = pid.trim().to_string();
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
        let argv: Vec<String> = cmdline
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        // A zombie (our own child, not reaped yet) has an empty command line.
        let running = || std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| !c.is_empty());
        for (signal, wait) in [("-TERM", 5), ("-KILL", 15)] {
            let _ = Command::new("kill").args([signal, &pid]).status();
            let deadline = Instant::now() + Duration::from_secs(wait);
            while running() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            if !running() {
                break;
            }
        }
        assert!(!running(), "kube-apiserver {pid} did not stop");
        if let Some(mut child) = self.restarted.lock().take() {
            let _ = child.wait();
        }
        argv
    }

    /// Start kube-apiserver again, as before, and record its pid for `testenv stop`.
    pub fn start_apiserver(&self, argv: &[String]) {
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(self.dir.join("apiserver.log"))
            .unwrap();
        let child = Command::new(&argv[0])
            .args(&argv[1..])
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        std::fs::write(self.dir.join("apiserver.pid"), child.id().to_string()).unwrap();
        *self.restarted.lock() = Some(child);
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        let _ = Command::new(&self.script)
            .arg("stop")
            .arg(&self.dir)
            .status();
        if let Some(mut child) = self.restarted.lock().take() {
            let _ = child.wait(); // killed by `testenv stop`
        }
    }
}

/// This test's own kube-apiserver and etcd, and a client of it once it is ready.
/// The scheduler's options for tests: a round 300 ms after a change, and every second.
pub fn fast_scheduler() -> flatmesh_k8s::schedule::Options {
    flatmesh_k8s::schedule::Options {
        debounce: std::time::Duration::from_millis(300),
        resync: std::time::Duration::from_secs(1),
    }
}

pub async fn api_server() -> (TestEnv, kube::Client) {
    let env = tokio::task::spawn_blocking(TestEnv::start).await.unwrap();
    let client = flatmesh_k8s::connect(Some(&env.kubeconfig()))
        .await
        .unwrap();
    wait_ready(&client, &env.dir).await;
    wait_service_ips(&client, &env.dir).await;
    (env, client)
}

/// Calls `attempt` every 200 ms until it succeeds (a minute at most); then fails with `what`,
/// the last error and where the API server's log is.
async fn until_ok<T, E: std::fmt::Display, F: std::future::Future<Output = Result<T, E>>>(
    what: &str,
    dir: &Path,
    mut attempt: impl FnMut() -> F,
) -> T {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match attempt().await {
            Ok(done) => return done,
            Err(e) => assert!(
                Instant::now() < deadline,
                "{what} ({e}); see {}/apiserver.log",
                dir.display()
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Until the API server answers (a minute at most).
pub async fn wait_ready(client: &kube::Client, dir: &Path) {
    until_ok("kube-apiserver is not ready", dir, || {
        client.apiserver_version()
    })
    .await;
}

/// Until a new API server gives Services their ClusterIPs (a minute at most), found by
/// creating one (in `default`) and deleting it again. On Kubernetes 1.33+ (ServiceCIDR GA)
/// `/readyz` says ok, and even the default ServiceCIDR says Ready, before the server's IP
/// allocator has seen that CIDR; until it has, every Service create fails with "failed to
/// allocate a serviceIP: range is full". Call it before anything watches Services.
pub async fn wait_service_ips(client: &kube::Client, dir: &Path) {
    use k8s_openapi::api::core::v1::Service;
    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    let probe: Service = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "testenv-ip-probe" },
        "spec": { "ports": [ { "port": 80 } ] },
    }))
    .unwrap();
    let post = PostParams::default();
    until_ok("kube-apiserver gives Services no ClusterIP", dir, || {
        services.create(&post, &probe)
    })
    .await;
    services
        .delete("testenv-ip-probe", &Default::default())
        .await
        .unwrap();
}

pub async fn create<K>(api: &Api<K>, value: serde_json::Value) -> K
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    api.create(
        &PostParams::default(),
        &serde_json::from_value(value).unwrap(),
    )
    .await
    .unwrap()
}

/// The release binary next to this test's or example's (target/release/flatmesh), or
/// $FLATMESH_BIN.
pub fn flatmesh_bin() -> PathBuf {
    let path = match std::env::var_os("FLATMESH_BIN") {
        Some(path) => PathBuf::from(path),
        None => {
            let exe = std::env::current_exe().unwrap();
            exe.parent().unwrap().parent().unwrap().join("flatmesh")
        }
    };
    assert!(
        path.is_file(),
        "no flatmesh binary at {}: run `cargo build --release -p flatmesh` first (or set FLATMESH_BIN)",
        path.display()
    );
    path
}
