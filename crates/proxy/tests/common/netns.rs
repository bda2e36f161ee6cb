//! Runs a test's body in a network namespace of its own: the test binary runs that one test
//! again under `unshare --net` (loopback brought up first), and this process waits, bounded,
//! for it to pass. Inside, every address is the namespace's own, so tests that change the
//! network (an nftables rule, tier K's programs) never touch the host's or each other's.
//! The caller checks for root first (the namespace needs it).

use std::future::Future;
use std::time::{Duration, Instant};

/// Set to the test's name in the re-run: the body runs there.
const INSIDE: &str = "FM_NETNS_TEST";
/// A file the re-run creates once the body has returned: a re-run that ran no test (a name
/// that matched nothing) exits 0 too, and must not pass.
const DONE: &str = "FM_NETNS_DONE";

/// True in the re-run inside the namespace (a test that holds something for the whole run,
/// such as a turn, takes it outside only).
#[allow(dead_code)] // not every test binary asks
pub fn inside() -> bool {
    std::env::var_os(INSIDE).is_some()
}

pub fn in_netns<F, Fut>(test: &str, limit: Duration, body: F)
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = ()>,
{
    if std::env::var(INSIDE).as_deref() == Ok(test) {
        let up = std::process::Command::new("ip")
            .args(["link", "set", "lo", "up"])
            .status()
            .expect("run `ip link set lo up` (iproute2)");
        assert!(
            up.success(),
            "cannot bring loopback up in the test's namespace"
        );
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(body());
        if let Some(done) = std::env::var_os(DONE) {
            std::fs::write(done, test).unwrap();
        }
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let done = std::env::temp_dir().join(format!("fm-netns-{}-{test}.done", std::process::id()));
    let _ = std::fs::remove_file(&done);
    // `--include-ignored`: this process runs, so the test was asked for, ignored or not.
    let mut child = std::process::Command::new("unshare")
        .arg("--net")
        .arg(exe)
        .args([
            test,
            "--exact",
            "--nocapture",
            "--test-threads=1",
            "--include-ignored",
        ])
        .env(INSIDE, test)
        .env(DONE, &done)
        .spawn()
        .expect("run `unshare --net` (util-linux) to give the test its own network namespace");
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{test} did not finish within {limit:?} in its network namespace");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        status.success(),
        "{test} failed in its network namespace (output above)"
    );
    assert!(
        std::fs::remove_file(&done).is_ok(),
        "{test} did not run in its network namespace (the re-run matched no test)"
    );
}
