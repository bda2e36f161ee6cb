//! Socket direct: a connection whose client and backend are both on this host has its
//! payload carried by sk_msg shortcuts from one socket to the other. The proxy's relay keeps
//! both connections open and accounts for the bytes it forwards itself, so each shortcut is
//! armed only once the proxy has caught up (bpf/redirect.bpf.c).

use flatmesh_kernel::{DirectBytes, KernelTier, SockKey};
use tokio::net::TcpStream;

use super::KernelBinding;

/// One direction of a socket-direct connection, as the proxy's relay sees it.
pub struct DirectDir {
    tier: KernelTier,
    from: SockKey,
    to: SockKey,
    forwarded: u64,
    armed: bool,
}

impl DirectDir {
    /// Call after writing `n` more bytes of this direction through `through` (the proxy's
    /// socket toward the receiver). Arms the shortcut again with the new total, or gives it
    /// up for good if `through` did not hand its bytes to the receiver's socket in the kernel
    /// (then the direct bytes could overtake them).
    pub fn forwarded(&mut self, n: usize, through: &TcpStream) {
        self.forwarded += n as u64;
        if !self.armed {
            return;
        }
        if sent_through_tcp(through) {
            self.armed = false;
            if let Err(err) = self.tier.direct_disarm(&self.from) {
                tracing::debug!(error = %err, "tier K: disarming a socket-direct shortcut failed");
            }
            return;
        }
        if let Err(err) = self.tier.direct_arm(&self.from, &self.to, self.forwarded) {
            tracing::debug!(error = %err, "tier K: re-arming a socket-direct shortcut failed; the proxy relays");
            self.armed = false;
        }
    }
}

/// A connection going socket direct. Dropping it removes its shortcuts.
pub struct DirectConn {
    tier: KernelTier,
    client: SockKey,
    backend: SockKey,
    /// Client to backend, backend to client.
    pub to_backend: DirectDir,
    pub to_client: DirectDir,
    ended: bool,
}

impl DirectConn {
    /// Removes both shortcuts; returns the bytes the kernel carried directly.
    pub fn end(mut self) -> DirectBytes {
        self.finish()
    }

    fn finish(&mut self) -> DirectBytes {
        if std::mem::replace(&mut self.ended, true) {
            return DirectBytes::default();
        }
        match self.tier.direct_end(&self.client, &self.backend) {
            Ok(b) => b,
            Err(err) => {
                tracing::warn!(error = %err, "tier K: removing a socket-direct shortcut failed");
                DirectBytes::default()
            }
        }
    }
}

impl Drop for DirectConn {
    fn drop(&mut self) {
        self.finish();
    }
}

/// Whether `sock` has handed any payload to TCP (sent, or queued to send) rather than to the
/// kernel's sockmap redirect.
fn sent_through_tcp(sock: &TcpStream) -> bool {
    match flatmesh_kernel::tcp_counters(sock) {
        Ok(c) => c.sent > 0 || c.unsent > 0,
        // Cannot tell: assume the worst, which only keeps the proxy on the path.
        Err(_) => true,
    }
}

impl KernelBinding {
    /// Arms socket direct for a connection whose client (the peer of `accepted`) and backend
    /// (the peer of `upstream`) are both on this host. `None` (logged at debug) leaves the
    /// connection to the other paths. Call before relaying any byte.
    pub fn direct(&self, accepted: &TcpStream, upstream: &TcpStream) -> Option<DirectConn> {
        let keys = SockKey::of_peer(accepted).and_then(|c| Ok((c, SockKey::of_peer(upstream)?)));
        let (client, backend) = match keys {
            Ok(k) => k,
            Err(err) => {
                tracing::debug!(error = %err, "tier K: no socket direct for this connection");
                return None;
            }
        };
        let armed = self
            .tier
            .direct_begin(&client, &backend)
            .and_then(|()| self.tier.direct_arm(&backend, &client, 0))
            .and_then(|()| self.tier.direct_arm(&client, &backend, 0));
        let conn = DirectConn {
            tier: self.tier.clone(),
            client,
            backend,
            to_backend: DirectDir {
                tier: self.tier.clone(),
                from: client,
                to: backend,
                forwarded: 0,
                armed: true,
            },
            to_client: DirectDir {
                tier: self.tier.clone(),
                from: backend,
                to: client,
                forwarded: 0,
                armed: true,
            },
            ended: false,
        };
        match armed {
            Ok(()) => Some(conn),
            Err(err) => {
                // Dropping `conn` removes whatever was armed.
                tracing::debug!(error = %err, "tier K: cannot arm socket direct; the proxy relays");
                None
            }
        }
    }
}
