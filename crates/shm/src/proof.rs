//! Proof that an accepted connection is the one a rendezvous region was made for.
//!
//! The region's file name is only a rendezvous hint: it carries the server address and the
//! client *port*, which a connection from another address (another user's, or a remote
//! client's that happened to pick the same port) can share. Attaching on the name alone handed
//! one connection's region to another, so the acceptor must prove the match before it attaches.
//!
//! The proof comes from the kernel, not from the peer's word. The connector stores the *socket
//! cookie* of its TCP socket in the region (`SO_COOKIE`: a 64-bit number the kernel gives each
//! socket once and never reuses until reboot). The acceptor asks the kernel, over
//! `NETLINK_SOCK_DIAG`, which socket holds the other end of the connection it accepted: the
//! socket whose local address is the accepted connection's peer and whose remote address is its
//! own. Only if that socket's cookie is the region's cookie is the region attached; otherwise the
//! connection stays plain TCP and the file stays where it is, for the connection it belongs to.
//!
//! This keeps negotiation free of in-band bytes (a peer without the library never sees one) and
//! binds a region to exactly one connection: two live connections never share a 4-tuple within a
//! network namespace, and a socket never shares a cookie. This lookup needs both ends in one
//! network namespace (the region name then carries the namespace's id); between the network
//! namespaces of a split namespace the PU agents prove it instead (`group`).

use flatmesh_netlink::Netlink;
use std::net::SocketAddr;

pub use flatmesh_netlink::sock_diag::{canonical, socket_cookie};

/// The cookie of the socket at the far end of the connection `(local, peer)` that this process
/// accepted, as the kernel reports it. `None` if the kernel knows no such socket here (a remote
/// peer, a peer in another network namespace, a peer that already closed) or cannot be asked.
pub fn peer_cookie(local: SocketAddr, peer: SocketAddr) -> Option<u64> {
    // The far socket's own view: its local address is our peer, its remote is us.
    Netlink::sock_diag().ok()?.cookie_of(peer, local)
}

/// Whether the connection `(local, peer)` this process accepted is the one whose connector's
/// socket has `cookie`.
pub fn proven(local: SocketAddr, peer: SocketAddr, cookie: u64) -> bool {
    cookie != 0 && peer_cookie(local, peer) == Some(cookie)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;

    #[test]
    fn the_kernel_names_the_connectors_socket() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, peer) = listener.accept().unwrap();
        let local = accepted.local_addr().unwrap();
        let cookie = socket_cookie(client.as_raw_fd());
        assert_ne!(cookie, 0, "SO_COOKIE gave nothing");
        assert_eq!(peer_cookie(local, peer), Some(cookie));
        assert!(proven(local, peer, cookie));
        // Another socket's cookie is no proof, and neither is 0.
        let other = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        assert!(!proven(local, peer, socket_cookie(other.as_raw_fd())));
        assert!(!proven(local, peer, 0));
    }

    #[test]
    fn a_peer_address_no_local_socket_has_is_no_proof() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, peer) = listener.accept().unwrap();
        let local = accepted.local_addr().unwrap();
        let elsewhere = SocketAddr::new("127.0.0.2".parse().unwrap(), peer.port());
        let cookie = socket_cookie(client.as_raw_fd());
        assert!(!proven(local, elsewhere, cookie));
    }
}
