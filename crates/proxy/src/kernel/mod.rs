//! Tier K in the node: attach what the config's `kernel:` section asks for, keep the kernel's
//! maps in step with each config snapshot, and the per-connection paths that hand a
//! connection's bytes to the kernel (docs/kernel.md). One file per concept:
//! - [`attach`]: attach the programs the config asks for, and work out (plan) and install
//!   what each config snapshot asks of the kernel's maps;
//! - [`handoff`]: the L7 `http` listener's first request, on a listener the tier-K lowering
//!   lets the kernel splice (`KernelLowering::l7_listener`: only where every request a
//!   spliced connection could carry gets the user tier's answer; any other listener's
//!   connections go straight to the user tier). `fm_sockops_l7` registers each
//!   accepted connection before any payload arrives; [`KernelBinding::first_request`] reads
//!   the kernel's decision for the first request and either hands the connection to the
//!   kernel for the decided cluster or hands the bytes read so far to the user L7 path, which
//!   then answers exactly as without tier K. [`settings_ack`] is the HTTP/2 surgery that wait
//!   needs;
//! - [`path`]: which way a connection's bytes travel once its upstream is connected. The
//!   **splice** (`kernel.tcp_splice`, and decided L7 connections with a remote end):
//!   [`KernelBinding::splice`] pairs the proxy's two sockets and the sk_skb verdict moves
//!   every later byte between them;
//! - [`direct`]: **socket direct** (`kernel.redirect`): when a connection's client and
//!   backend are both on this host, [`KernelBinding::direct`] arms sk_msg shortcuts so the
//!   client's sendmsg lands in the backend's socket and back, without TCP and without the
//!   proxy; the proxy keeps both connections open, carries FIN, RST and whatever the kernel
//!   does not, and accounts for the bytes each way;
//! - [`conn_limit`]: a tcp listener's `connection_rate_limit`, enforced by a socket filter
//!   on its listening sockets that drops SYNs over the limit before the proxy sees them.

mod attach;
mod conn_limit;
mod direct;
mod handoff;
mod path;
mod settings_ack;

use flatmesh_kernel::KernelTier;
use parking_lot::Mutex;

use attach::Installed;

pub use attach::{attach, plan, KernelPlan};
pub use direct::{DirectConn, DirectDir};
pub use handoff::FirstRequest;
pub use path::KernelPath;
pub use settings_ack::StripSettingsAck;

/// How much of a connection the node reads while the kernel has not decided its first
/// request. The kernel only looks at the first 256 bytes of an HTTP/1.1 request and at the
/// first HEADERS frame of HTTP/2, so a connection past this is the user tier's. The verdict
/// gives up at the same bound (FM_PENDING_MAX in bpf/dispatch.bpf.c: `PendingLimit`).
const FIRST_REQUEST_MAX: usize = 16 * 1024;

/// The node's handle on tier K.
pub struct KernelBinding {
    tier: KernelTier,
    installed: Mutex<Installed>,
    conn: conn_limit::ConnLimits,
}

impl KernelBinding {
    /// What this node has of tier K, for `/rules`.
    pub fn runtime(&self) -> flatmesh_rules::KernelRuntime {
        flatmesh_rules::KernelRuntime::Attached {
            verdict: self.tier.config().l7_dispatch,
            table_error: self.installed.lock().table_error.clone(),
        }
    }

    /// Whether sk_msg local-hop redirect (and so socket direct) is attached.
    pub fn redirect_on(&self) -> bool {
        self.tier.config().redirect
    }

    /// Who made the connection the node accepted from `peer` on `local`, when tier K
    /// captured it (`crate::workload`).
    pub fn source(
        &self,
        peer: std::net::SocketAddr,
        local: std::net::SocketAddr,
    ) -> Option<flatmesh_kernel::SourceProcess> {
        self.tier.config().capture.as_ref()?;
        match self.tier.source(peer, local) {
            Ok(source) => source,
            Err(err) => {
                tracing::debug!(%peer, error = %err, "tier K: no source for the connection");
                None
            }
        }
    }

    /// Where the connection on `sock` was going, when tier K's capture redirected it
    /// (`crate::original_dst`).
    pub fn original_dst(&self, sock: &impl std::os::fd::AsFd) -> Option<std::net::SocketAddr> {
        self.tier.config().capture.as_ref()?;
        match self.tier.original_dst(sock) {
            Ok(to) => to,
            Err(err) => {
                tracing::debug!(error = %err, "tier K: no original destination for the connection");
                None
            }
        }
    }

    /// Drops the kernel's state of finished connections (their sockhash entries go when the
    /// sockets close).
    pub fn forget(&self, cookies: &[u64]) {
        for c in cookies {
            let _ = self.tier.l7_forget(*c);
        }
    }
}
