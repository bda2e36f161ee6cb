//! Local-hop redirect: which ports mark a connection as a local hop to shorten, and socket
//! direct, the shortcut from a proxied connection's client straight to its backend
//! (`bpf/redirect.bpf.c` explains the ordering rule).

use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd};

use crate::abi::{FmAddr, FmDirect, FmShortcut, FmSockKey, PORT_BOTH, PORT_CLIENT};
use crate::error::KernelError;
use crate::tier::KernelTier;

/// How a marked port makes its connections members of the local-hop sockhash.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HopPort {
    /// Both ends: a proxy `tcp` listener or a local backend.
    Both,
    /// Only the connecting end: an L7 listener, whose accepted sockets the sk_skb dispatcher
    /// owns (it must see the client's bytes arrive through TCP). The client end still joins,
    /// so a decided connection can go socket direct.
    ClientOnly,
}

/// A socket's identity as the redirect programs key it: its own (local, remote) ends, plus
/// the network namespace when the local end is loopback.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SockKey(pub(crate) FmSockKey);

impl SockKey {
    /// The key of the socket at the far end of `sock` (the client of an accepted socket, the
    /// backend of a connected one): the ends swapped, in `sock`'s network namespace.
    pub fn of_peer(sock: &impl AsFd) -> Result<SockKey, KernelError> {
        let (local, peer) = ends(sock)?;
        let local = FmAddr::from_socket_addr_normalized(local);
        let peer = FmAddr::from_socket_addr_normalized(peer);
        let netns = if peer.is_loopback() {
            netns_cookie(sock)?
        } else {
            0
        };
        Ok(SockKey(FmSockKey {
            local: peer,
            remote: local,
            netns,
        }))
    }

    /// The socket's local address (normalized: v4-mapped as IPv4).
    pub fn local(&self) -> Option<SocketAddr> {
        self.0.local.to_socket_addr()
    }

    /// The socket's remote address (normalized).
    pub fn remote(&self) -> Option<SocketAddr> {
        self.0.remote.to_socket_addr()
    }
}

/// Bytes and messages the kernel carried straight from one end of a socket-direct
/// connection to the other, per direction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DirectBytes {
    pub client_to_backend: u64,
    pub backend_to_client: u64,
    pub messages: u64,
}

fn ends(sock: &impl AsFd) -> Result<(SocketAddr, SocketAddr), KernelError> {
    let s = socket2::SockRef::from(sock);
    let local = s
        .local_addr()
        .map_err(|e| KernelError::io("getsockname", e))?
        .as_socket()
        .ok_or_else(|| {
            KernelError::io("getsockname", std::io::Error::other("not an inet socket"))
        })?;
    let peer = s
        .peer_addr()
        .map_err(|e| KernelError::io("getpeername (is the socket connected?)", e))?
        .as_socket()
        .ok_or_else(|| {
            KernelError::io("getpeername", std::io::Error::other("not an inet socket"))
        })?;
    Ok((local, peer))
}

/// SO_NETNS_COOKIE: the network namespace's 64-bit id, as `bpf_get_netns_cookie` sees it.
pub(crate) fn netns_cookie(sock: &impl AsFd) -> Result<u64, KernelError> {
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: the buffer and its length describe a valid u64.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_NETNS_COOKIE,
            (&mut cookie as *mut u64).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(KernelError::io(
            "getsockopt(SO_NETNS_COOKIE) (needs Linux 5.14+)",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(cookie)
}

impl KernelTier {
    /// Connections established from now on whose server end listens on `port` (a proxy
    /// listener or a local backend) are put in the sockhash; between two such local ends,
    /// sk_msg moves the bytes directly. Connections established before the call are not
    /// affected.
    pub fn add_redirect_port(&self, port: u16) -> Result<(), KernelError> {
        self.add_hop_port(port, HopPort::Both)
    }

    /// As [`KernelTier::add_redirect_port`], with the membership rule `mode`.
    pub fn add_hop_port(&self, port: u16, mode: HopPort) -> Result<(), KernelError> {
        let value = match mode {
            HopPort::Both => PORT_BOTH,
            HopPort::ClientOnly => PORT_CLIENT,
        };
        self.with(|l| {
            let m = l
                .maps
                .redirect_ports
                .as_mut()
                .ok_or(KernelError::MissingMap {
                    map: "fm_redirect_ports (redirect is off in the config)",
                })?;
            m.insert(port, value, 0)
                .map_err(|e| KernelError::map("fm_redirect_ports", "insert", e))
        })
    }

    /// Stops marking new connections on `port`. Not an error if it was not marked.
    pub fn remove_redirect_port(&self, port: u16) -> Result<(), KernelError> {
        self.with(|l| {
            let m = l
                .maps
                .redirect_ports
                .as_mut()
                .ok_or(KernelError::MissingMap {
                    map: "fm_redirect_ports (redirect is off in the config)",
                })?;
            match m.remove(&port) {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
                Err(e) => Err(KernelError::map("fm_redirect_ports", "remove", e)),
            }
        })
    }

    /// Starts counting the direct bytes of a socket-direct connection (client end `client`,
    /// backend end `backend`). Call once, before the first [`KernelTier::direct_arm`].
    pub fn direct_begin(&self, client: &SockKey, backend: &SockKey) -> Result<(), KernelError> {
        self.with(|l| {
            let m = l
                .maps
                .direct_bytes
                .as_mut()
                .ok_or(KernelError::MissingMap {
                    map: "fm_direct_bytes (redirect is off in the config)",
                })?;
            for k in [client, backend] {
                m.insert(k.0, FmDirect::default(), 0)
                    .map_err(|e| KernelError::map("fm_direct_bytes", "insert", e))?;
            }
            Ok(())
        })
    }

    /// Lets `from`'s next messages go straight into `to`'s receive queue, as soon as the
    /// bytes `from` sent toward the proxy equal `forwarded`: the number the proxy has written
    /// on to `to` so far, through a socket that is itself redirected into `to`. Call again
    /// after each forward (until nothing reaches the proxy any more).
    pub fn direct_arm(
        &self,
        from: &SockKey,
        to: &SockKey,
        forwarded: u64,
    ) -> Result<(), KernelError> {
        self.with(|l| {
            let m = l.maps.shortcuts.as_mut().ok_or(KernelError::MissingMap {
                map: "fm_shortcuts (redirect is off in the config)",
            })?;
            m.insert(
                from.0,
                FmShortcut {
                    target: to.0,
                    armed_at: forwarded,
                },
                0,
            )
            .map_err(|e| KernelError::map("fm_shortcuts", "insert", e))
        })
    }

    /// Sends `from`'s messages to the proxy again (its forwarding could not be kept in order).
    pub fn direct_disarm(&self, from: &SockKey) -> Result<(), KernelError> {
        self.with(|l| {
            let m = l.maps.shortcuts.as_mut().ok_or(KernelError::MissingMap {
                map: "fm_shortcuts (redirect is off in the config)",
            })?;
            match m.remove(&from.0) {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
                Err(e) => Err(KernelError::map("fm_shortcuts", "remove", e)),
            }
        })
    }

    /// Ends a socket-direct connection: removes both shortcuts and returns what went direct.
    pub fn direct_end(
        &self,
        client: &SockKey,
        backend: &SockKey,
    ) -> Result<DirectBytes, KernelError> {
        self.with(|l| {
            let mut out = DirectBytes::default();
            if let Some(m) = l.maps.shortcuts.as_mut() {
                for k in [client, backend] {
                    match m.remove(&k.0) {
                        Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
                        Err(e) => return Err(KernelError::map("fm_shortcuts", "remove", e)),
                    }
                }
            }
            if let Some(m) = l.maps.direct_bytes.as_mut() {
                for (k, slot) in [
                    (client, &mut out.client_to_backend),
                    (backend, &mut out.backend_to_client),
                ] {
                    match m.get(&k.0, 0) {
                        Ok(d) => {
                            *slot = d.bytes;
                            out.messages += d.msgs;
                        }
                        Err(aya::maps::MapError::KeyNotFound) => {}
                        Err(e) => return Err(KernelError::map("fm_direct_bytes", "lookup", e)),
                    }
                    match m.remove(&k.0) {
                        Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
                        Err(e) => return Err(KernelError::map("fm_direct_bytes", "remove", e)),
                    }
                }
            }
            Ok(out)
        })
    }
}
