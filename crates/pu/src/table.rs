//! The global port table of one split namespace: TCP port -> PU (§4.1.1), shared by all agents.
//!
//! The table is a BPF hash map that the kernel itself writes at bind(): `flatmesh pu up`
//! attaches a cgroup/bind4+6 hook for the split namespace (`crates/kernel/bpf/pu_ports.bpf.c`)
//! and pins it with the map under `/sys/fs/bpf/flatmesh-pu-<ns>/`. A bind of a free port claims
//! it for the binding PU; a bind of a port another PU owns fails with EADDRINUSE right there.
//! The claim is one insert-if-absent in the kernel, so of two racing binds exactly one wins.
//! The agents read the map to build their rules, claim ports bound as port 0 (which the hook
//! cannot see) when they see them listening, and release their PU's ports once nothing on the
//! PU holds them. The map outlives every agent: a restarted agent finds its ports where it left
//! them.
//!
//! Which agent runs for which PU is kept beside it, in `<state_dir>/<ns>/agent-<pu>.lock`
//! (the agent's flock, with its pid inside).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use flatmesh_kernel::{Claim, PuPorts};

use crate::config::SplitConfig;
use crate::error::{PuError, Result};
use crate::topology::pin_dir;

/// A snapshot of the table, by PU name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableState {
    /// TCP port -> name of the PU that owns it.
    pub ports: BTreeMap<u16, String>,
    /// PU name -> process id of its running agent (for `status`).
    pub agents: BTreeMap<String, u32>,
}

impl TableState {
    pub fn empty() -> TableState {
        TableState::default()
    }
}

/// What an agent's pass must do to the table, given the ports its PU listens on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClaimPlan {
    /// Listening here but in nobody's name (bound as port 0, so the hook never saw them).
    pub claim: Vec<u16>,
    /// Listening here although another PU owns them: bound before the hook was attached, or
    /// claimed by the agent after another PU bound them. The owner keeps the port.
    pub conflicts: Vec<(u16, String)>,
    /// This PU's ports that nothing listens on: released once nothing on the PU holds them.
    pub maybe_released: Vec<u16>,
}

impl TableState {
    /// Compares the table with the ports `pu` listens on.
    pub fn plan(&self, pu: &str, listening: &std::collections::BTreeSet<u16>) -> ClaimPlan {
        let mut plan = ClaimPlan::default();
        for &port in listening {
            match self.ports.get(&port) {
                None => plan.claim.push(port),
                Some(owner) if owner == pu => {}
                Some(owner) => plan.conflicts.push((port, owner.clone())),
            }
        }
        plan.maybe_released = self
            .ports
            .iter()
            .filter(|(port, owner)| *owner == pu && !listening.contains(port))
            .map(|(port, _)| *port)
            .collect();
        plan
    }
}

/// Handle on the table of one split namespace.
#[derive(Debug, Clone)]
pub struct PortTable {
    pin_dir: PathBuf,
    state_dir: PathBuf,
    pus: Vec<String>,
}

impl PortTable {
    pub fn new(config: &SplitConfig) -> PortTable {
        PortTable {
            pin_dir: pin_dir(&config.namespace),
            state_dir: config.table_dir(),
            pus: config.pus.iter().map(|p| p.name.clone()).collect(),
        }
    }

    /// The bpffs directory holding the table and the hook.
    pub fn path(&self) -> &Path {
        &self.pin_dir
    }

    fn error(&self, e: impl std::fmt::Display) -> PuError {
        PuError::PortTable {
            path: self.pin_dir.clone(),
            message: e.to_string(),
        }
    }

    /// Attaches the bind hook with an empty table; `netns_cookies[i]` is the network namespace
    /// cookie of PU i. Replaces what an earlier run left.
    pub fn create(&self, netns_cookies: &[u64]) -> Result<()> {
        PuPorts::attach(
            &self.pin_dir,
            &flatmesh_kernel::default_cgroup_root(),
            netns_cookies,
        )
        .map(|_| ())
        .map_err(|e| self.error(e))
    }

    /// Detaches the hook and drops the table. Nothing to do if there is none.
    pub fn remove(&self) -> Result<()> {
        PuPorts::detach(&self.pin_dir).map_err(|e| self.error(e))
    }

    /// Whether the hook and table are in place.
    pub fn exists(&self) -> bool {
        PuPorts::attached(&self.pin_dir)
    }

    /// Opens the pinned table.
    pub fn open(&self) -> Result<PuPorts> {
        if !self.exists() {
            return Err(self.error("no bind hook is attached"));
        }
        PuPorts::open(&self.pin_dir).map_err(|e| self.error(e))
    }

    fn index(&self, pu: &str) -> Result<u32> {
        self.pus
            .iter()
            .position(|p| p == pu)
            .map(|i| i as u32)
            .ok_or_else(|| self.error(format!("no PU named `{pu}`")))
    }

    /// Claims `port` for `pu` as a bind would: `None` if it is now `pu`'s, else its owner.
    pub fn claim(&self, port: u16, pu: &str) -> Result<Option<String>> {
        let me = self.index(pu)?;
        match self.open()?.claim(port, me).map_err(|e| self.error(e))? {
            Claim::Mine => Ok(None),
            Claim::Taken(owner) => Ok(Some(self.name(owner))),
        }
    }

    /// Releases `port` if `pu` owns it; true if it did.
    pub fn release(&self, port: u16, pu: &str) -> Result<bool> {
        let me = self.index(pu)?;
        self.open()?.release(port, me).map_err(|e| self.error(e))
    }

    fn name(&self, pu: u32) -> String {
        self.pus
            .get(pu as usize)
            .cloned()
            .unwrap_or_else(|| format!("#{pu}"))
    }

    /// Reads the table and the running agents.
    pub fn read(&self) -> Result<TableState> {
        let ports = self.open()?.ports().map_err(|e| self.error(e))?;
        let ports = ports
            .into_iter()
            .map(|(port, pu)| (port, self.name(pu)))
            .collect();
        let agents = self
            .pus
            .iter()
            .filter_map(|pu| Some((pu.clone(), self.agent_pid(pu)?)))
            .collect();
        Ok(TableState { ports, agents })
    }

    /// `<state_dir>/<ns>/agent-<pu>.lock`: flocked by the PU's running agent, its pid inside.
    pub fn agent_file(&self, pu: &str) -> PathBuf {
        self.state_dir.join(format!("agent-{pu}.lock"))
    }

    /// The pid recorded by the agent of `pu`, if that process still runs.
    pub fn agent_pid(&self, pu: &str) -> Option<u32> {
        let text = std::fs::read_to_string(self.agent_file(pu)).ok()?;
        let pid: u32 = text.trim().parse().ok()?;
        Path::new(&format!("/proc/{pid}")).exists().then_some(pid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn plan_claims_reports_conflicts_and_finds_releases() {
        let mut t = TableState::empty();
        t.ports.insert(80, "a".into());
        t.ports.insert(81, "a".into());
        t.ports.insert(90, "b".into());
        let plan = t.plan("a", &BTreeSet::from([80, 90, 100]));
        assert_eq!(plan.claim, vec![100]);
        assert_eq!(plan.conflicts, vec![(90, "b".to_string())]);
        assert_eq!(plan.maybe_released, vec![81]);
    }
}
