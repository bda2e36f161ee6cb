//! Capture: which service addresses are sent to the proxy, which processes are never
//! captured, where a captured connection was going, and who made it.

use std::net::SocketAddr;
use std::os::fd::AsFd;

use crate::abi::{FmAddr, FmTuple};
use crate::error::KernelError;
use crate::sockopt::socket_cookie;
use crate::tier::KernelTier;

/// Who made a captured connection, as the kernel saw it in the client's own `connect()`:
/// nothing the client sends can change it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SourceProcess {
    /// The client process's cgroup v2 id: the inode number of its cgroup directory.
    pub cgroup_id: u64,
    /// The client process's (real) user id.
    pub uid: u32,
}

/// The cgroup v2 id of the cgroup directory `path`, as `bpf_get_current_cgroup_id()` gives it
/// for a process in that cgroup (its inode number).
pub fn cgroup_id(path: &std::path::Path) -> Result<u64, KernelError> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path)
        .map(|m| m.ino())
        .map_err(|e| KernelError::io(format!("reading cgroup {}", path.display()), e))
}

impl KernelTier {
    /// Sends TCP connections from the capture cgroup to `service` to `proxy` instead.
    /// `service` and `proxy` must be the same address family (connect4 cannot reach a v6 proxy).
    pub fn add_service(&self, service: SocketAddr, proxy: SocketAddr) -> Result<(), KernelError> {
        if service.is_ipv4() != proxy.is_ipv4() {
            return Err(KernelError::FamilyMismatch { service, proxy });
        }
        self.with(|l| {
            let m = l.maps.services.as_mut().ok_or(KernelError::MissingMap {
                map: "fm_services (capture is off in the config)",
            })?;
            m.insert(
                FmAddr::from_socket_addr(service),
                FmAddr::from_socket_addr(proxy),
                0,
            )
            .map_err(|e| KernelError::map("fm_services", "insert", e))
        })
    }

    /// Stops capturing `service`. Not an error if it was not captured.
    pub fn remove_service(&self, service: SocketAddr) -> Result<(), KernelError> {
        self.with(|l| {
            let m = l.maps.services.as_mut().ok_or(KernelError::MissingMap {
                map: "fm_services (capture is off in the config)",
            })?;
            match m.remove(&FmAddr::from_socket_addr(service)) {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
                Err(e) => Err(KernelError::map("fm_services", "remove", e)),
            }
        })
    }

    /// Never captures connections made by process `pid` (the proxy itself, so its upstream
    /// connections to service addresses do not loop back to it).
    pub fn bypass_pid(&self, pid: u32) -> Result<(), KernelError> {
        self.with(|l| {
            let m = l.maps.bypass_pids.as_mut().ok_or(KernelError::MissingMap {
                map: "fm_bypass_pids (capture is off in the config)",
            })?;
            m.insert(pid, 1, 0)
                .map_err(|e| KernelError::map("fm_bypass_pids", "insert", e))
        })
    }

    /// Where a captured connection was going, looked up by the socket cookie of either end
    /// (the proxy's accepted socket or the workload's socket). `None` if it was not captured.
    pub fn original_dst(&self, sock: &impl AsFd) -> Result<Option<SocketAddr>, KernelError> {
        let cookie =
            socket_cookie(sock).map_err(|e| KernelError::io("getsockopt(SO_COOKIE)", e))?;
        self.original_dst_by_cookie(cookie)
    }

    /// As `original_dst`, by cookie.
    pub fn original_dst_by_cookie(&self, cookie: u64) -> Result<Option<SocketAddr>, KernelError> {
        self.with(|l| {
            let m = l
                .maps
                .orig_by_cookie
                .as_ref()
                .ok_or(KernelError::MissingMap {
                    map: "fm_orig_by_cookie (capture is off in the config)",
                })?;
            match m.get(&cookie, 0) {
                Ok(a) => Ok(a.to_socket_addr()),
                Err(aya::maps::MapError::KeyNotFound) => Ok(None),
                Err(e) => Err(KernelError::map("fm_orig_by_cookie", "lookup", e)),
            }
        })
    }

    /// Who made the captured connection the node accepted from `peer` on `local` (the
    /// accepted socket's two ends). `None` if it was not captured (the kernel only records
    /// connections whose `connect()` the capture programs redirected).
    pub fn source(
        &self,
        peer: SocketAddr,
        local: SocketAddr,
    ) -> Result<Option<SourceProcess>, KernelError> {
        let key = FmTuple {
            client: FmAddr::from_socket_addr_normalized(peer),
            server: FmAddr::from_socket_addr_normalized(local),
        };
        self.with(|l| {
            let m = l
                .maps
                .src_by_tuple
                .as_ref()
                .ok_or(KernelError::MissingMap {
                    map: "fm_src_by_tuple (capture is off in the config)",
                })?;
            match m.get(&key, 0) {
                Ok(s) => Ok(Some(SourceProcess {
                    cgroup_id: s.cgroup_id,
                    uid: s.uid,
                })),
                Err(aya::maps::MapError::KeyNotFound) => Ok(None),
                Err(e) => Err(KernelError::map("fm_src_by_tuple", "lookup", e)),
            }
        })
    }
}
