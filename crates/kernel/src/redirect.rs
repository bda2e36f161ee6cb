//! Local-hop redirect: which ports mark a connection as a local hop to shorten.

use crate::error::KernelError;
use crate::tier::KernelTier;

impl KernelTier {
    /// Connections established from now on with either end on `port` (a proxy listener or a
    /// local backend) are put in the sockhash; between two such local ends, sk_msg moves the
    /// bytes directly. Connections established before the call are not affected.
    pub fn add_redirect_port(&self, port: u16) -> Result<(), KernelError> {
        self.with(|l| {
            let m = l
                .maps
                .redirect_ports
                .as_mut()
                .ok_or(KernelError::MissingMap {
                    map: "fm_redirect_ports (redirect is off in the config)",
                })?;
            m.insert(port, 1, 0)
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
}
