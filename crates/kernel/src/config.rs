//! What to attach: the `kernel:` section of the node config, lowered to paths and switches.

use std::path::{Path, PathBuf};

/// Where tier K pins its programs and maps unless the config says otherwise.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/flatmesh";

/// Tier-K configuration. `Default` gives the production layout with everything on except
/// capture, which needs to know which workloads to capture.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelConfig {
    /// bpffs directory for this node's pins. One node per directory.
    pub pin_dir: PathBuf,
    /// cgroup v2 directory whose sockets the node sees: sockops (redirect, capture bookkeeping)
    /// and the SO_ORIGINAL_DST getsockopt program attach here.
    pub cgroup_root: PathBuf,
    /// Capture workloads' connections to service addresses; `None` leaves connect() alone.
    pub capture: Option<CaptureConfig>,
    /// Shorten local hops with sockops + sk_msg.
    pub redirect: bool,
    /// Decide `http` listeners' first request in the kernel (sk_skb verdict).
    pub l7_dispatch: bool,
    /// Also attach the sk_skb stream parser in front of the verdict (strparser mode). Off by
    /// default: on this kernel, strparser mode stalls or resets spliced connections under
    /// sustained small-message traffic; verdict-only mode does not (docs/kernel.md).
    pub l7_stream_parser: bool,
    /// Only take sockets of the attaching process's network namespace into the redirect and
    /// L7 sockhashes (the node's namespace), so nodes in other namespaces on the same host,
    /// with the same addresses and ports, are never touched.
    pub own_netns_only: bool,
    /// Load the socket filter that enforces tcp listeners' `connection_rate_limit` on their
    /// listening sockets ([`KernelTier::limit_connections`](crate::KernelTier::limit_connections)).
    pub conn_limit: bool,
}

/// Which workloads are captured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CaptureConfig {
    /// cgroup v2 directory of the workloads; connect4/connect6 attach here.
    pub cgroup: PathBuf,
}

impl Default for KernelConfig {
    fn default() -> Self {
        KernelConfig {
            pin_dir: PathBuf::from(DEFAULT_PIN_DIR),
            cgroup_root: default_cgroup_root(),
            capture: None,
            redirect: true,
            l7_dispatch: true,
            l7_stream_parser: false,
            own_netns_only: true,
            conn_limit: false,
        }
    }
}

/// The cgroup v2 root: `/sys/fs/cgroup` on a unified layout, `/sys/fs/cgroup/unified` on a
/// hybrid one (as on these machines).
pub fn default_cgroup_root() -> PathBuf {
    if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        PathBuf::from("/sys/fs/cgroup")
    } else {
        PathBuf::from("/sys/fs/cgroup/unified")
    }
}
