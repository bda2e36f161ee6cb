//! In-kernel L7 dispatch at run time: install the route table, register accepted client
//! sockets, read the kernel's decision and splice a decided connection to its upstream.
//!
//! The proxy's part, per connection on an `http` listener with tier K:
//! 1. accept, then `l7_register(&client)` before reading anything;
//! 2. read as usual, buffering; after each read check `l7_decision(cookie)`:
//!    `Pending` → keep reading, `Fallback` → run the user L7 path on the buffered bytes,
//!    `Backend` → connect the upstream for that backend;
//! 3. `l7_attach_upstream(cookie, &upstream)`, write the buffered bytes to the upstream,
//!    then `l7_pair(cookie, upstream_cookie)`; from here the kernel moves the bytes both ways;
//! 4. keep watching both sockets: bytes that still reach user space (sent before the pair
//!    was set) are forwarded by hand, EOF on one side is `shutdown(Write)` on the other,
//!    and `l7_forget` both cookies when the pair closes.

use std::os::fd::AsFd;

use crate::abi::{FmL7Conn, L7_DECIDED, L7_FALLBACK, L7_PENDING, ROUTES_MAX};
use crate::error::KernelError;
use crate::sockopt::socket_cookie;
use crate::tier::KernelTier;
use flatmesh_rules::lower::kernel::KernelEntry;

/// Why the kernel left a connection to the user tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FallbackReason {
    NoMatch,
    /// A Huffman-coded pseudo-header *name*, or more Huffman-coded names than the kernel
    /// checks per block (4); coded regular names are decoded and checked in the kernel.
    Huffman,
    Truncated,
    Malformed,
    PuntRule,
    DynamicTable,
    TooLong,
    Busy,
    /// The route's cluster speaks another protocol than the client (HTTP/1.1 vs HTTP/2):
    /// only the user tier can translate.
    Protocol,
    /// No first HEADERS frame within the kernel's bound (16 KiB of stream, 64 chunks).
    PendingLimit,
    /// The path has a `%`, `//` or a dot segment: the listener may normalise it into another
    /// route's path, which only the user tier does (`flatmesh_rules::normalize::is_plain`).
    NotPlain,
    Other(u32),
}

impl FallbackReason {
    fn from_raw(why: u32) -> Self {
        match why {
            1 => FallbackReason::NoMatch,
            2 => FallbackReason::Huffman,
            3 => FallbackReason::Truncated,
            4 => FallbackReason::Malformed,
            5 => FallbackReason::PuntRule,
            6 => FallbackReason::DynamicTable,
            7 => FallbackReason::TooLong,
            8 => FallbackReason::Busy,
            9 => FallbackReason::Protocol,
            13 => FallbackReason::PendingLimit,
            14 => FallbackReason::NotPlain,
            other => FallbackReason::Other(other),
        }
    }
}

/// The kernel's answer for a registered connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum L7Decision {
    /// The first request has not been seen in full yet.
    Pending,
    /// The first request matched `route_id`, which forwards to `backend`.
    Backend { backend: u32, route_id: u32 },
    /// The user tier must decide. `route_id` is set when a punt rule matched.
    Fallback {
        reason: FallbackReason,
        route_id: Option<u32>,
    },
}

impl KernelTier {
    /// Replaces the tier-K route table with the lowering's entries
    /// (`flatmesh_rules::RuleProgram::kernel`). Entries past the new table are cleared first
    /// from the end, so a concurrent first request sees either the old or the new prefix of
    /// rules followed by an end marker, never a table without an end.
    pub fn set_routes(&self, table: &[KernelEntry]) -> Result<(), KernelError> {
        if table.len() > ROUTES_MAX {
            return Err(KernelError::TooManyRoutes {
                given: table.len(),
                max: ROUTES_MAX,
            });
        }
        self.with(|l| {
            let m = l.maps.routes.as_mut().ok_or(KernelError::MissingMap {
                map: "fm_routes (l7_dispatch is off in the config)",
            })?;
            // End marker first at the new length, then entries back to front.
            if table.len() < ROUTES_MAX {
                m.set(table.len() as u32, crate::abi::FmRoute::default(), 0)
                    .map_err(|e| KernelError::map("fm_routes", "update", e))?;
            }
            for (i, r) in table.iter().enumerate().rev() {
                m.set(i as u32, crate::routes::to_abi(r), 0)
                    .map_err(|e| KernelError::map("fm_routes", "update", e))?;
            }
            Ok(())
        })
    }

    /// Marks an http listener port: connections accepted on it are registered for in-kernel
    /// dispatch by the `fm_sockops_l7` program as soon as they are established, so even a
    /// request sent with the handshake is seen by the verdict. The proxy then only reads
    /// [`KernelTier::l7_decision`] with the accepted socket's cookie.
    pub fn add_l7_port(&self, port: u16) -> Result<(), KernelError> {
        self.with(|l| {
            let ports = l.maps.l7_ports.as_mut().ok_or(KernelError::MissingMap {
                map: "fm_l7_ports (l7_dispatch is off in the config)",
            })?;
            ports
                .insert(port, 1, 0)
                .map_err(|e| KernelError::map("fm_l7_ports", "insert", e))
        })
    }

    pub fn remove_l7_port(&self, port: u16) -> Result<(), KernelError> {
        self.with(|l| {
            let ports = l.maps.l7_ports.as_mut().ok_or(KernelError::MissingMap {
                map: "fm_l7_ports (l7_dispatch is off in the config)",
            })?;
            match ports.remove(&port) {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
                Err(e) => Err(KernelError::map("fm_l7_ports", "remove", e)),
            }
        })
    }

    /// Registers an accepted client socket for in-kernel dispatch; call before reading from
    /// it. Returns its cookie, the key for the other `l7_*` calls.
    pub fn l7_register(&self, client: &impl AsFd) -> Result<u64, KernelError> {
        let cookie =
            socket_cookie(client).map_err(|e| KernelError::io("getsockopt(SO_COOKIE)", e))?;
        self.with(|l| {
            let conns = l.maps.l7_conns.as_mut().ok_or(KernelError::MissingMap {
                map: "fm_l7_conns (l7_dispatch is off in the config)",
            })?;
            // State before the sockhash entry: the verdict ignores sockets it has no state for.
            conns
                .insert(cookie, FmL7Conn::default(), 0)
                .map_err(|e| KernelError::map("fm_l7_conns", "insert", e))?;
            let socks = l
                .maps
                .l7_socks
                .as_mut()
                .ok_or(KernelError::MissingMap { map: "fm_l7_socks" })?;
            socks.insert(cookie, client.as_fd(), 0).map_err(|e| {
                KernelError::map("fm_l7_socks", "insert (is the socket connected?)", e)
            })
        })?;
        Ok(cookie)
    }

    /// The kernel's decision for a registered connection.
    pub fn l7_decision(&self, cookie: u64) -> Result<L7Decision, KernelError> {
        self.with(|l| {
            let conns = l.maps.l7_conns.as_ref().ok_or(KernelError::MissingMap {
                map: "fm_l7_conns (l7_dispatch is off in the config)",
            })?;
            let c = match conns.get(&cookie, 0) {
                Ok(c) => c,
                // Evicted or never registered: only the user tier can answer.
                Err(aya::maps::MapError::KeyNotFound) => {
                    return Ok(L7Decision::Fallback {
                        reason: FallbackReason::Other(0),
                        route_id: None,
                    })
                }
                Err(e) => return Err(KernelError::map("fm_l7_conns", "lookup", e)),
            };
            Ok(match c.state {
                L7_PENDING => L7Decision::Pending,
                L7_DECIDED => L7Decision::Backend {
                    backend: c.backend,
                    route_id: c.route_id,
                },
                L7_FALLBACK => L7Decision::Fallback {
                    reason: FallbackReason::from_raw(c.reason),
                    route_id: (c.reason == 5 || c.reason == 9).then_some(c.route_id),
                },
                other => L7Decision::Fallback {
                    reason: FallbackReason::Other(other),
                    route_id: None,
                },
            })
        })
    }

    /// Puts the upstream socket in the sockhash with the client as its peer, so replies go
    /// straight to the client. Call before writing the buffered request to the upstream.
    /// Returns the upstream's cookie.
    pub fn l7_attach_upstream(
        &self,
        client_cookie: u64,
        upstream: &impl AsFd,
    ) -> Result<u64, KernelError> {
        let cookie =
            socket_cookie(upstream).map_err(|e| KernelError::io("getsockopt(SO_COOKIE)", e))?;
        self.with(|l| {
            let conns = l.maps.l7_conns.as_mut().ok_or(KernelError::MissingMap {
                map: "fm_l7_conns (l7_dispatch is off in the config)",
            })?;
            let state = FmL7Conn {
                peer: client_cookie,
                state: L7_DECIDED,
                ..FmL7Conn::default()
            };
            conns
                .insert(cookie, state, 0)
                .map_err(|e| KernelError::map("fm_l7_conns", "insert", e))?;
            let socks = l
                .maps
                .l7_socks
                .as_mut()
                .ok_or(KernelError::MissingMap { map: "fm_l7_socks" })?;
            socks.insert(cookie, upstream.as_fd(), 0).map_err(|e| {
                KernelError::map("fm_l7_socks", "insert (is the upstream connected?)", e)
            })
        })?;
        Ok(cookie)
    }

    /// Sends the client's further bytes straight to the upstream. Call after the buffered
    /// request has been written to the upstream.
    pub fn l7_pair(&self, client_cookie: u64, upstream_cookie: u64) -> Result<(), KernelError> {
        self.with(|l| {
            let conns = l.maps.l7_conns.as_mut().ok_or(KernelError::MissingMap {
                map: "fm_l7_conns (l7_dispatch is off in the config)",
            })?;
            let mut c = match conns.get(&client_cookie, 0) {
                Ok(c) => c,
                Err(aya::maps::MapError::KeyNotFound) => FmL7Conn {
                    state: L7_DECIDED,
                    ..FmL7Conn::default()
                },
                Err(e) => return Err(KernelError::map("fm_l7_conns", "lookup", e)),
            };
            c.peer = upstream_cookie;
            conns
                .insert(client_cookie, c, 0)
                .map_err(|e| KernelError::map("fm_l7_conns", "update", e))
        })
    }

    /// Splices two connected sockets in the kernel from their next byte on: whatever one
    /// receives, the sk_skb verdict sends out of the other. This is the L4 relay of a `tcp`
    /// listener in tier K (no decision to wait for). Returns both cookies for
    /// [`KernelTier::l7_forget`]. Bytes already queued before the call still reach user space
    /// and must be forwarded by hand, as must anything that arrives if a peer closes.
    pub fn splice(
        &self,
        client: &impl AsFd,
        upstream: &impl AsFd,
    ) -> Result<(u64, u64), KernelError> {
        let client_cookie =
            socket_cookie(client).map_err(|e| KernelError::io("getsockopt(SO_COOKIE)", e))?;
        let upstream_cookie =
            socket_cookie(upstream).map_err(|e| KernelError::io("getsockopt(SO_COOKIE)", e))?;
        self.with(|l| {
            let conns = l.maps.l7_conns.as_mut().ok_or(KernelError::MissingMap {
                map: "fm_l7_conns (tcp_splice and l7_dispatch are off in the config)",
            })?;
            for (cookie, peer) in [
                (client_cookie, upstream_cookie),
                (upstream_cookie, client_cookie),
            ] {
                let state = FmL7Conn {
                    peer,
                    state: L7_DECIDED,
                    ..FmL7Conn::default()
                };
                conns
                    .insert(cookie, state, 0)
                    .map_err(|e| KernelError::map("fm_l7_conns", "insert", e))?;
            }
            let socks = l
                .maps
                .l7_socks
                .as_mut()
                .ok_or(KernelError::MissingMap { map: "fm_l7_socks" })?;
            // Upstream first: once the client is in the sockhash its bytes are redirected to
            // the upstream, which must already be there to receive them.
            socks
                .insert(upstream_cookie, upstream.as_fd(), 0)
                .map_err(|e| {
                    KernelError::map("fm_l7_socks", "insert (is the upstream connected?)", e)
                })?;
            socks.insert(client_cookie, client.as_fd(), 0).map_err(|e| {
                KernelError::map("fm_l7_socks", "insert (is the client connected?)", e)
            })
        })?;
        Ok((client_cookie, upstream_cookie))
    }

    /// Bytes the verdict redirected from the socket with `cookie` to its peer: the bytes
    /// user space never saw. `None` when the kernel has no state for it.
    pub fn l7_spliced_bytes(&self, cookie: u64) -> Result<Option<u64>, KernelError> {
        self.with(|l| {
            let conns = l.maps.l7_conns.as_ref().ok_or(KernelError::MissingMap {
                map: "fm_l7_conns (l7_dispatch is off in the config)",
            })?;
            match conns.get(&cookie, 0) {
                Ok(c) => Ok(Some(c.spliced)),
                Err(aya::maps::MapError::KeyNotFound) => Ok(None),
                Err(e) => Err(KernelError::map("fm_l7_conns", "lookup", e)),
            }
        })
    }

    /// Drops a connection's dispatch state (its sockhash entry goes when the socket closes),
    /// and any bytes the kernel held for a frame cut across chunks.
    pub fn l7_forget(&self, cookie: u64) -> Result<(), KernelError> {
        self.with(|l| {
            if let Some(hold) = l.maps.l7_hold.as_mut() {
                // Usually there is none: a missing key is ENOENT from the syscall.
                match hold.remove(&cookie) {
                    Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
                    Err(aya::maps::MapError::SyscallError(e))
                        if e.io_error.raw_os_error() == Some(libc::ENOENT) => {}
                    Err(e) => return Err(KernelError::map("fm_l7_hold", "remove", e)),
                }
            }
            let conns = l.maps.l7_conns.as_mut().ok_or(KernelError::MissingMap {
                map: "fm_l7_conns (l7_dispatch is off in the config)",
            })?;
            match conns.remove(&cookie) {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
                Err(e) => Err(KernelError::map("fm_l7_conns", "remove", e)),
            }
        })
    }
}
