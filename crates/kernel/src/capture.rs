//! Capture: which service addresses are sent to the proxy, which processes are never
//! captured, and where a captured connection was going.

use std::net::SocketAddr;
use std::os::fd::AsFd;

use crate::abi::FmAddr;
use crate::error::KernelError;
use crate::sockopt::socket_cookie;
use crate::tier::KernelTier;

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
}
