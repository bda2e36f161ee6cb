//! tcp listeners' `connection_rate_limit` in the kernel: the `fm_conn_limit` socket filter of
//! `bpf/conn_limit.bpf.c` on each listening socket of a limited listener, which drops a SYN
//! over the listener's token bucket before any socket is created for it. Buckets and drop
//! counts are kept by listener port.

use std::os::fd::AsFd;

use aya::maps::MapError;

use crate::abi::FmConnLimit;
use crate::error::KernelError;
use crate::tier::KernelTier;

/// A listener's bucket as the filter keeps it: GCRA's parameters, in nanoseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLimit {
    /// Time between two connections at the sustained rate (1 s / connections_per_s).
    pub interval_ns: u64,
    /// How far past now the theoretical arrival time may run: burst × interval.
    pub tolerance_ns: u64,
}

impl ConnLimit {
    /// The map value that installs this limit with a full bucket.
    fn full_bucket(self) -> FmConnLimit {
        FmConnLimit {
            tat: 0,
            interval: self.interval_ns.max(1),
            tolerance: self.tolerance_ns,
        }
    }
}

const LIMITS: &str = "fm_conn_limits (conn_limit is off in the config)";
const DROPS: &str = "fm_conn_drops (conn_limit is off in the config)";

impl KernelTier {
    /// Attaches the connection rate-limit filter to `socket`, a listening TCP socket (with
    /// SO_REUSEPORT, each socket of the group). It limits the SYNs to the socket's port while
    /// that port has a limit ([`KernelTier::set_conn_limit`]) and passes everything else.
    /// Sockets accepted from it inherit the filter, which passes their segments.
    pub fn limit_connections(&self, socket: &impl AsFd) -> Result<(), KernelError> {
        self.with(|l| {
            l.conn_limit_filter()?.attach(socket.as_fd()).map_err(|e| {
                KernelError::program(
                    "fm_conn_limit",
                    "attach to a listening socket (SO_ATTACH_BPF)",
                    e,
                )
            })
        })
    }

    /// Limits new connections to `port` (on the sockets carrying the filter) to `limit`,
    /// starting from a full bucket. Replaces the port's previous limit and bucket; its drop
    /// count goes on.
    pub fn set_conn_limit(&self, port: u16, limit: ConnLimit) -> Result<(), KernelError> {
        self.with(|l| {
            let m = l
                .maps
                .conn_limits
                .as_mut()
                .ok_or(KernelError::MissingMap { map: LIMITS })?;
            m.insert(port, limit.full_bucket(), 0)
                .map_err(|e| KernelError::map("fm_conn_limits", "insert", e))
        })
    }

    /// The limit in force on `port`, if any.
    pub fn conn_limit(&self, port: u16) -> Result<Option<ConnLimit>, KernelError> {
        self.with(|l| {
            let m = l
                .maps
                .conn_limits
                .as_ref()
                .ok_or(KernelError::MissingMap { map: LIMITS })?;
            match m.get(&port, 0) {
                Ok(v) => Ok(Some(ConnLimit {
                    interval_ns: v.interval,
                    tolerance_ns: v.tolerance,
                })),
                Err(MapError::KeyNotFound) => Ok(None),
                Err(e) => Err(KernelError::map("fm_conn_limits", "lookup", e)),
            }
        })
    }

    /// Stops limiting `port` in the kernel and forgets its drop count. Not an error if it
    /// was not limited.
    pub fn remove_conn_limit(&self, port: u16) -> Result<(), KernelError> {
        self.with(|l| {
            let m = l
                .maps
                .conn_limits
                .as_mut()
                .ok_or(KernelError::MissingMap { map: LIMITS })?;
            match m.remove(&port) {
                Ok(()) | Err(MapError::KeyNotFound) => {}
                Err(e) => return Err(KernelError::map("fm_conn_limits", "remove", e)),
            }
            let d = l
                .maps
                .conn_drops
                .as_mut()
                .ok_or(KernelError::MissingMap { map: DROPS })?;
            match d.remove(&port) {
                Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
                Err(e) => Err(KernelError::map("fm_conn_drops", "remove", e)),
            }
        })
    }

    /// SYNs to `port` the filter dropped over its limit, summed over CPUs.
    pub fn conn_limit_drops(&self, port: u16) -> Result<u64, KernelError> {
        self.with(|l| {
            let d = l
                .maps
                .conn_drops
                .as_ref()
                .ok_or(KernelError::MissingMap { map: DROPS })?;
            match d.get(&port, 0) {
                Ok(per_cpu) => Ok(per_cpu.iter().sum()),
                Err(MapError::KeyNotFound) => Ok(0),
                Err(e) => Err(KernelError::map("fm_conn_drops", "lookup", e)),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_is_installed_with_a_full_bucket() {
        let v = ConnLimit {
            interval_ns: 200_000_000,
            tolerance_ns: 600_000_000,
        }
        .full_bucket();
        assert_eq!(
            v,
            FmConnLimit {
                tat: 0,
                interval: 200_000_000,
                tolerance: 600_000_000
            }
        );
        // An interval of 0 would let every SYN through at the same instant.
        let zero = ConnLimit {
            interval_ns: 0,
            tolerance_ns: 0,
        }
        .full_bucket();
        assert_eq!(zero.interval, 1);
    }
}
