//! Tier K of flatmesh: the kernel eBPF tier (DESIGN.md, "tier K").
//!
//! - **capture** (`bpf/capture.bpf.c`): cgroup/connect4+6 send workloads' connections to
//!   service addresses to the node proxy; the original destination is kept by socket cookie
//!   and answered to `getsockopt(SO_ORIGINAL_DST)` by a cgroup/getsockopt program.
//! - **redirect** (`bpf/redirect.bpf.c`): sockops + sk_msg move bytes between the two ends of
//!   a local hop without the TCP/IP stack (FlatProxy §IV-E "socket direct", on Linux).
//! - **dispatch** (`bpf/dispatch.bpf.c`): the sk_skb verdict decides a connection's first
//!   HTTP/1.1 or gRPC request from the tier-K route table and splice it in the kernel. The
//!   table's entries come from the tier-K lowering in flatmesh-rules; this crate encodes them.
//! - **conn_limit** (`bpf/conn_limit.bpf.c`): a socket filter on tcp listeners' listening
//!   sockets drops SYNs over the listener's `connection_rate_limit` before the proxy sees them.
//! - **pu_ports** (`bpf/pu_ports.bpf.c`): not part of the node's tier. The global port table
//!   of a split network namespace (flatmesh-pu) as a pinned map, and cgroup/bind4+6 programs
//!   that claim a port for the binding PU or refuse it with EADDRINUSE ([`PuPorts`]).
//!
//! [`KernelTier::attach`] loads and pins everything under [`KernelConfig::pin_dir`];
//! [`KernelTier::detach`] removes it; [`cleanup_stale`] clears a crashed node's pins.

mod abi;
mod capture;
mod config;
mod conn_limit;
mod dispatch;
mod error;
pub mod huffman;
mod pu_ports;
mod redirect;
mod routes;
mod sockopt;
mod status;
mod tier;

pub use abi::FmStat;
pub use capture::{cgroup_id, SourceProcess};
pub use config::{default_cgroup_root, CaptureConfig, KernelConfig, DEFAULT_PIN_DIR};
pub use conn_limit::ConnLimit;
pub use dispatch::{FallbackReason, L7Decision};
pub use error::KernelError;
/// The route table's entries, as the tier-K lowering in flatmesh-rules makes them.
pub use flatmesh_rules::lower::kernel::{KernelAction, KernelEntry, PathKey, Protocols};
pub use pu_ports::{BindStats, Claim, PuPorts, PU_MAX};
pub use redirect::{DirectBytes, HopPort, SockKey};
pub use sockopt::{original_dst_sockopt, socket_cookie, tcp_counters, TcpCounters};
pub use status::{status, KernelStatus, MapStatus, ProgramStatus};
pub use tier::{cleanup_stale, CleanupReport, KernelTier};

/// What this host lacks for tier K, each with where to get it (root privileges, kernel BTF,
/// a cgroup v2 mount); empty when it has everything.
pub fn missing_requirements() -> Vec<&'static str> {
    let mut missing = Vec::new();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        missing.push("root privileges (run as root)");
    }
    if !std::path::Path::new("/sys/kernel/btf/vmlinux").exists() {
        missing.push("kernel BTF (/sys/kernel/btf/vmlinux; needs CONFIG_DEBUG_INFO_BTF=y)");
    }
    if !default_cgroup_root().join("cgroup.procs").exists() {
        missing.push("a cgroup v2 mount (/sys/fs/cgroup or /sys/fs/cgroup/unified)");
    }
    missing
}

/// What this host lacks for tier K, as one line for the node's log, or `None` if it has
/// everything. The node logs it and runs on the user tiers.
pub fn probe() -> Option<String> {
    let missing = missing_requirements();
    if missing.is_empty() {
        None
    } else {
        Some(format!(
            "tier K (eBPF) disabled, missing: {}; running on the user tiers",
            missing.join(", ")
        ))
    }
}
