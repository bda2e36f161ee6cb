//! Build + load + pin, idempotent attach, detach leaves nothing, stale cleanup.

mod common;

use std::io::{BufReader, Write};
use std::time::Duration;

use common::*;
use flatmesh_kernel::{cleanup_stale, status, KernelError, KernelTier};

fn loaded_ids() -> Vec<u32> {
    aya::programs::loaded_programs()
        .filter_map(|p| p.ok())
        .map(|p| p.id())
        .collect()
}

#[test]
fn attach_pins_everything_and_detach_removes_it() {
    require_root();
    let mut cfg = config("lifecycle");
    cfg.redirect = true;
    cfg.l7_dispatch = true;
    let tier = KernelTier::attach(&cfg).unwrap_or_else(|e| panic!("{e}"));
    for pin in [
        "prog_fm_sk_msg",
        "prog_fm_sockops_redirect",
        "prog_fm_sockops_l7",
        "prog_fm_parser",
        "prog_fm_verdict",
        "fm_redirect_socks",
        "fm_l7_socks",
        "fm_routes",
        "fm_stats",
        "fm_owner",
    ] {
        assert!(cfg.pin_dir.join(pin).exists(), "{pin} is not pinned");
    }
    let st = tier.status().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(st.owner, Some(std::process::id()));
    assert_eq!(st.programs.iter().filter(|p| !p.derived).count(), 5, "{st}");
    // The socket-direct share of fm_sk_msg has its own row.
    assert!(
        st.programs
            .iter()
            .any(|p| p.derived && p.name == "fm_sk_msg_direct"),
        "{st}"
    );

    // Idempotent: the same config gives the same programs, not a second copy.
    let ids = tier.program_ids().unwrap_or_else(|e| panic!("{e}"));
    let again = KernelTier::attach(&cfg).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(again.program_ids().unwrap_or_else(|e| panic!("{e}")), ids);
    // A different config for the same pins is refused, not silently merged.
    let mut other = cfg.clone();
    other.redirect = false;
    assert!(matches!(
        KernelTier::attach(&other),
        Err(KernelError::ConfigMismatch { .. })
    ));
    // Cleanup refuses a live owner (this process).
    assert!(matches!(
        cleanup_stale(&cfg.pin_dir),
        Err(KernelError::AlreadyAttached { .. })
    ));

    tier.detach().unwrap_or_else(|e| panic!("{e}"));
    again
        .detach()
        .unwrap_or_else(|e| panic!("second detach must be a no-op: {e}"));
    assert!(!cfg.pin_dir.exists(), "pin dir left behind");
    assert!(matches!(
        again.add_redirect_port(1),
        Err(KernelError::Detached)
    ));
    let ids: Vec<u32> = ids.into_iter().map(|(_, id)| id).collect();
    eventually("programs to be unloaded", || {
        let live = loaded_ids();
        (!ids.iter().any(|id| live.contains(id))).then_some(())
    });
    assert!(status(&cfg.pin_dir)
        .unwrap_or_else(|e| panic!("{e}"))
        .programs
        .is_empty());
}

/// Child helper: attaches at FM_CHILD_PIN_DIR, says so, then waits to be killed.
#[test]
#[ignore = "helper run as a child process by crashed_node_pins_are_cleaned"]
fn child_attach_and_hang() {
    let Ok(dir) = std::env::var("FM_CHILD_PIN_DIR") else {
        return;
    };
    let mut cfg = config("unused");
    cfg.pin_dir = dir.into();
    cfg.redirect = true;
    let _tier = KernelTier::attach(&cfg).unwrap_or_else(|e| panic!("{e}"));
    println!("attached");
    let _ = std::io::stdout().flush();
    std::thread::sleep(Duration::from_secs(30));
}

#[test]
fn crashed_node_pins_are_cleaned() {
    require_root();
    let mut cfg = config("crash");
    cfg.redirect = true;
    let mut kid = child(
        "child_attach_and_hang",
        &[("FM_CHILD_PIN_DIR", cfg.pin_dir.display().to_string())],
    );
    let mut out = BufReader::new(
        kid.stdout
            .take()
            .unwrap_or_else(|| panic!("no child stdout")),
    );
    child_line(&mut out, "attached");
    let pid = kid.id();
    // While it runs, its pins are not ours to take.
    match KernelTier::attach(&cfg) {
        Err(KernelError::AlreadyAttached { pid: p, .. }) => assert_eq!(p, pid),
        other => panic!("expected AlreadyAttached, got {other:?}"),
    }
    let _ = kid.kill(); // SIGKILL: no detach runs
    let _ = kid.wait();
    assert!(
        cfg.pin_dir.join("prog_fm_sk_msg").exists(),
        "a killed node leaves its pins"
    );
    let report = cleanup_stale(&cfg.pin_dir).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.owner, Some(pid));
    assert!(
        report.removed.contains(&"prog_fm_sk_msg".to_string()),
        "{report:?}"
    );
    assert!(!cfg.pin_dir.exists());
    // And the next start attaches cleanly.
    let tier = KernelTier::attach(&cfg).unwrap_or_else(|e| panic!("{e}"));
    tier.detach().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn attach_with_nothing_enabled_says_so() {
    require_root();
    let cfg = config("nothing");
    assert!(matches!(
        KernelTier::attach(&cfg),
        Err(KernelError::NothingEnabled)
    ));
    assert!(!cfg.pin_dir.exists());
}
