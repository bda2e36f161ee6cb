//! Which way a connection's bytes travel once its upstream is connected: the user relay,
//! the sk_skb splice, or socket direct ([`super::direct`]).

use std::net::IpAddr;

use tokio::net::TcpStream;

use super::direct::DirectConn;
use super::KernelBinding;

/// How a connection's bytes travel once its upstream is connected.
pub enum KernelPath {
    /// The user relay carries everything (local hops may still be shortened by sk_msg).
    User,
    /// The sk_skb verdict moves the bytes between the proxy's two sockets; the cookies are
    /// for [`KernelBinding::forget`].
    Spliced(u64, u64),
    /// Socket direct: the client's and the backend's sockets talk straight to each other
    /// (boxed: it is much larger than the other variants).
    Direct(Box<DirectConn>),
}

/// Whether the far end of `sock` is on this host (and in its network namespace): a loopback
/// peer, or a peer that has the socket's own local address.
pub fn peer_is_local(sock: &TcpStream) -> bool {
    let unmapped = |ip: IpAddr| match ip {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map(IpAddr::V4)
            .unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    };
    match (sock.local_addr(), sock.peer_addr()) {
        (Ok(local), Ok(peer)) => {
            let (local, peer) = (unmapped(local.ip()), unmapped(peer.ip()));
            peer.is_loopback() || peer == local
        }
        _ => false,
    }
}

impl KernelBinding {
    /// Which tier-K path a connection takes once its upstream is connected (docs/kernel.md,
    /// "Which path a connection takes"):
    /// - both ends on this host and sk_msg redirect on: socket direct;
    /// - splice allowed and neither end in the redirect sockhash: the sk_skb splice (a socket
    ///   that sk_msg may also feed must not be spliced: its bytes could arrive out of order);
    /// - otherwise the user relay, with its local hops shortened by sk_msg.
    pub fn choose_path(
        &self,
        splice: bool,
        client: &TcpStream,
        upstream: &TcpStream,
    ) -> KernelPath {
        let redirect = self.redirect_on();
        let (client_local, upstream_local) = (peer_is_local(client), peer_is_local(upstream));
        if redirect && client_local && upstream_local {
            if let Some(d) = self.direct(client, upstream) {
                return KernelPath::Direct(Box::new(d));
            }
        }
        if splice && !(redirect && (client_local || upstream_local)) {
            if let Some((a, b)) = self.splice(client, upstream) {
                return KernelPath::Spliced(a, b);
            }
        }
        KernelPath::User
    }

    /// Pairs a tcp listener's client and upstream sockets in the kernel. `None` (logged at
    /// debug) leaves the whole connection to the user relay.
    pub fn splice(&self, client: &TcpStream, upstream: &TcpStream) -> Option<(u64, u64)> {
        match self.tier.splice(client, upstream) {
            Ok(cookies) => Some(cookies),
            Err(err) => {
                tracing::debug!(error = %err, "tier K splice refused; the user relay carries the connection");
                None
            }
        }
    }

    /// Ends a spliced pair: the bytes the kernel moved from each socket (client, upstream)
    /// without user space seeing them, then its state is dropped. `None` when the kernel lost
    /// count (the map entry was evicted).
    pub fn splice_end(&self, client: u64, upstream: u64) -> Option<(u64, u64)> {
        let counts = match (
            self.tier.l7_spliced_bytes(client),
            self.tier.l7_spliced_bytes(upstream),
        ) {
            (Ok(Some(a)), Ok(Some(b))) => Some((a, b)),
            _ => None,
        };
        self.forget(&[client, upstream]);
        counts
    }
}
