//! The workloads on this node (`workloads:`; docs/security.md, "Workloads"): which one made a
//! connection the node accepted, so that a tunnel carries it presenting that workload's
//! identity (`hbone/client.rs`), and which one listens on a port, so that an HBONE stream
//! delivered there is named in logs and metrics (`hbone/server.rs`).
//!
//! A connection's source is never read from anything the client sends. With tier K's capture
//! the kernel recorded it in the client's own `connect()` (its cgroup and uid:
//! `flatmesh_kernel::SourceProcess`); otherwise the node reads the uid that owns the client's
//! socket from `/proc/net/tcp{,6}` ([`proc_net`]), which is all it can learn there (matching
//! by cgroup needs tier K, and validation says so).

pub mod proc_net;

use std::net::SocketAddr;

use flatmesh_config::Config;

use crate::error::ProxyError;
use crate::kernel::KernelBinding;

/// A workload by its place in `workloads:`.
pub type WorkloadId = usize;

/// The label of connections from, or streams for, no declared workload.
pub const NONE: &str = "(none)";

/// The declared workloads, ready for the connection path.
#[derive(Debug, Default)]
pub struct Workloads {
    entries: Vec<Entry>,
}

#[derive(Debug)]
struct Entry {
    name: String,
    how: How,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum How {
    /// The client's cgroup v2 id (the inode of the declared directory).
    Cgroup(u64),
    Uid(u32),
    /// The port the workload listens on.
    Port(u16),
}

impl Workloads {
    /// The config's workloads. A `cgroup` that does not exist is an error: its id is what
    /// the kernel reports, and a directory created later would have another.
    pub fn load(config: &Config) -> Result<Workloads, ProxyError> {
        let entries = config
            .workloads
            .iter()
            .map(|w| {
                let m = &w.matches;
                let how = match (&m.cgroup, m.uid, m.port) {
                    (Some(path), _, _) => How::Cgroup(flatmesh_kernel::cgroup_id(path).map_err(|e| {
                        ProxyError::Config(format!(
                            "workload `{}`: {e}; create the cgroup before the node loads the config",
                            w.name
                        ))
                    })?),
                    (None, Some(uid), _) => How::Uid(uid),
                    (None, None, Some(port)) => How::Port(port),
                    (None, None, None) => {
                        return Err(ProxyError::Config(format!(
                            "workload `{}` has no `match`",
                            w.name
                        )))
                    }
                };
                Ok(Entry {
                    name: w.name.clone(),
                    how,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Workloads { entries })
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The workloads' names in order, for metrics.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|e| e.name.as_str())
    }

    pub fn name(&self, id: Option<WorkloadId>) -> &str {
        id.and_then(|i| self.entries.get(i))
            .map_or(NONE, |e| e.name.as_str())
    }

    /// The local workload that listens on `port`.
    pub fn serving(&self, port: u16) -> Option<WorkloadId> {
        self.entries.iter().position(|e| e.how == How::Port(port))
    }

    /// The workload that made the connection the node accepted from `peer` on `local`, by
    /// the kernel's record of its `connect()` or, failing that, by the uid that owns the
    /// client's socket. A cgroup match wins over a uid match: it is the narrower.
    pub async fn client_of(
        &self,
        kernel: Option<&KernelBinding>,
        peer: SocketAddr,
        local: SocketAddr,
    ) -> Option<WorkloadId> {
        let by_uid = self.entries.iter().any(|e| matches!(e.how, How::Uid(_)));
        let by_cgroup = self.entries.iter().any(|e| matches!(e.how, How::Cgroup(_)));
        if !by_uid && !by_cgroup {
            return None;
        }
        if let Some(source) = kernel.and_then(|k| k.source(peer, local)) {
            return self.by_process(Some(source.cgroup_id), source.uid);
        }
        if !by_uid {
            return None;
        }
        // /proc is a file read, possibly of many lines: off the worker's thread.
        let uid = tokio::task::spawn_blocking(move || proc_net::socket_uid(peer, local))
            .await
            .ok()
            .flatten()?;
        self.by_process(None, uid)
    }

    fn by_process(&self, cgroup: Option<u64>, uid: u32) -> Option<WorkloadId> {
        cgroup
            .and_then(|c| self.entries.iter().position(|e| e.how == How::Cgroup(c)))
            .or_else(|| self.entries.iter().position(|e| e.how == How::Uid(uid)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workloads(yaml: &str) -> Workloads {
        let config = flatmesh_config::parse(
            &format!("listeners:\n  - {{ name: t, address: 127.0.0.1:1, protocol: tcp, cluster: c }}\nclusters:\n  - {{ name: c, endpoints: [ 127.0.0.1:2 ] }}\nworkloads:\n{yaml}"),
            "t.yaml",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        Workloads::load(&config).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn a_cgroup_match_wins_over_a_uid_match_and_ports_name_servers() {
        let w = Workloads {
            entries: vec![
                Entry {
                    name: "by-uid".into(),
                    how: How::Uid(1001),
                },
                Entry {
                    name: "by-cgroup".into(),
                    how: How::Cgroup(77),
                },
                Entry {
                    name: "db".into(),
                    how: How::Port(5432),
                },
            ],
        };
        assert_eq!(w.by_process(Some(77), 1001), Some(1));
        assert_eq!(w.by_process(Some(78), 1001), Some(0));
        assert_eq!(w.by_process(None, 1002), None);
        assert_eq!(w.serving(5432), Some(2));
        assert_eq!(w.serving(5433), None);
        assert_eq!(w.name(Some(2)), "db");
        assert_eq!(w.name(None), NONE);
    }

    #[test]
    fn a_missing_cgroup_is_a_load_error_that_says_what_to_do() {
        let config = flatmesh_config::parse(
            "listeners:\n  - { name: t, address: 127.0.0.1:1, protocol: tcp, cluster: c }\nclusters:\n  - { name: c, endpoints: [ 127.0.0.1:2 ] }\nkernel:\n  capture: { cgroup: /sys/fs/cgroup/unified/w, services: [ { address: \"10.0.0.1:80\", listener: t } ] }\nworkloads:\n  - { name: a, identity: spiffe://td/ns/x/sa/a, cert: a.pem, key: a.key, match: { cgroup: /nonexistent/fm-cgroup } }\n",
            "t.yaml",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let err = Workloads::load(&config).unwrap_err().to_string();
        assert!(
            err.contains("workload `a`") && err.contains("create the cgroup"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn without_tier_k_the_uid_comes_from_the_socket_owner() {
        // This process's own connection: its uid is ours.
        let me = nix_uid();
        let w = workloads(&format!(
            "  - {{ name: me, identity: spiffe://td/ns/x/sa/me, cert: a.pem, key: a.key, match: {{ uid: {me} }} }}\n"
        ));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
        let client =
            std::net::TcpStream::connect(listener.local_addr().unwrap_or_else(|e| panic!("{e}")))
                .unwrap_or_else(|e| panic!("{e}"));
        let (accepted, peer) = listener.accept().unwrap_or_else(|e| panic!("{e}"));
        let local = accepted.local_addr().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(w.client_of(None, peer, local).await, Some(0));
        // The reverse direction is the node's own accepted socket: never the client.
        assert_eq!(
            proc_net::socket_uid(local, SocketAddr::from(([127, 0, 0, 1], 9))),
            None
        );
        drop(client);
    }

    fn nix_uid() -> u32 {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata("/proc/self")
            .map(|m| m.uid())
            .unwrap_or_else(|e| panic!("{e}"))
    }
}
