//! The global port table of one split namespace: port -> PU (§4.1.1), shared by all agents.
//!
//! It is a small JSON file, `<state_dir>/<ns>/ports.json`, changed only under an exclusive
//! `flock` on `ports.lock` and replaced atomically (write a temporary file, rename), so a reader
//! never sees half a table and an agent that crashes mid-update leaves the previous table. It
//! outlives every agent: a restarted agent finds its ports where it left them.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{PuError, Result};

/// Bump when the file's meaning changes.
pub const TABLE_VERSION: u32 = 1;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableState {
    pub version: u32,
    /// TCP port -> name of the PU whose process listens on it.
    pub ports: BTreeMap<u16, String>,
    /// PU name -> process id of its agent (for `status`).
    #[serde(default)]
    pub agents: BTreeMap<String, u32>,
}

/// What one agent's claim did to the table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClaimOutcome {
    pub claimed: Vec<u16>,
    pub released: Vec<u16>,
    /// Ports this PU listens on although another PU holds them (the race of two binds within
    /// one poll interval); the earlier owner keeps the port.
    pub conflicts: Vec<(u16, String)>,
}

impl TableState {
    pub fn empty() -> TableState {
        TableState {
            version: TABLE_VERSION,
            ..TableState::default()
        }
    }

    /// Parses the table file's text.
    pub fn parse(text: &str) -> std::result::Result<TableState, String> {
        let state: TableState = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if state.version != TABLE_VERSION {
            return Err(format!(
                "version {} (this flatmesh reads version {TABLE_VERSION})",
                state.version
            ));
        }
        if state.ports.contains_key(&0) {
            return Err("port 0 is listed".to_string());
        }
        Ok(state)
    }

    /// Records that `pu` now listens on exactly `listening`: unowned ports become its own, its
    /// ports it no longer listens on are released, ports of other PUs stay theirs.
    pub fn claim(&mut self, pu: &str, listening: &std::collections::BTreeSet<u16>) -> ClaimOutcome {
        let mut outcome = ClaimOutcome::default();
        for &port in listening {
            match self.ports.get(&port) {
                None => {
                    self.ports.insert(port, pu.to_string());
                    outcome.claimed.push(port);
                }
                Some(owner) if owner == pu => {}
                Some(owner) => outcome.conflicts.push((port, owner.clone())),
            }
        }
        let mine_gone: Vec<u16> = self
            .ports
            .iter()
            .filter(|(port, owner)| *owner == pu && !listening.contains(port))
            .map(|(port, _)| *port)
            .collect();
        for port in mine_gone {
            self.ports.remove(&port);
            outcome.released.push(port);
        }
        outcome
    }
}

/// Handle on the table files of one split namespace.
#[derive(Debug, Clone)]
pub struct PortTable {
    dir: PathBuf,
}

impl PortTable {
    pub fn new(dir: &Path) -> PortTable {
        PortTable {
            dir: dir.to_path_buf(),
        }
    }

    pub fn path(&self) -> PathBuf {
        self.dir.join("ports.json")
    }

    fn io(&self, source: std::io::Error) -> PuError {
        PuError::TableIo {
            path: self.path(),
            source,
        }
    }

    /// Reads the table; a missing file is an empty table.
    pub fn read(&self) -> Result<TableState> {
        let path = self.path();
        match std::fs::read_to_string(&path) {
            Ok(text) => {
                TableState::parse(&text).map_err(|message| PuError::TableCorrupt { path, message })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(TableState::empty()),
            Err(e) => Err(self.io(e)),
        }
    }

    /// Runs `change` on the table under the lock and writes the result if it changed.
    pub fn update<R>(&self, change: impl FnOnce(&mut TableState) -> R) -> Result<(R, TableState)> {
        std::fs::create_dir_all(&self.dir).map_err(|e| self.io(e))?;
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.dir.join("ports.lock"))
            .map_err(|e| self.io(e))?;
        lock.lock().map_err(|e| self.io(e))?;
        let mut state = self.read()?;
        let before = state.clone();
        let result = change(&mut state);
        if state != before {
            self.write(&state)?;
        }
        // Dropping `lock` closes it, which releases the flock.
        drop(lock);
        Ok((result, state))
    }

    fn write(&self, state: &TableState) -> Result<()> {
        let tmp = self
            .dir
            .join(format!("ports.json.tmp{}", std::process::id()));
        let text = serde_json::to_string(state).map_err(|e| PuError::TableCorrupt {
            path: self.path(),
            message: e.to_string(),
        })?;
        let mut file = File::create(&tmp).map_err(|e| self.io(e))?;
        file.write_all(text.as_bytes()).map_err(|e| self.io(e))?;
        std::fs::rename(&tmp, self.path()).map_err(|e| self.io(e))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn claim_release_and_conflict() {
        let mut t = TableState::empty();
        let out = t.claim("a", &BTreeSet::from([80, 81]));
        assert_eq!(out.claimed, vec![80, 81]);
        let out = t.claim("b", &BTreeSet::from([81, 90]));
        assert_eq!(out.claimed, vec![90]);
        assert_eq!(out.conflicts, vec![(81, "a".to_string())]);
        let out = t.claim("a", &BTreeSet::from([80]));
        assert_eq!(out.released, vec![81]);
        assert_eq!(t.ports.get(&81), None);
        assert_eq!(t.ports.get(&90).map(String::as_str), Some("b"));
    }

    #[test]
    fn file_round_trip_and_damage() {
        let dir = std::env::temp_dir().join(format!("fmpu-table-test-{}", std::process::id()));
        let table = PortTable::new(&dir);
        let (_, state) = table
            .update(|s| s.claim("a", &BTreeSet::from([8080])))
            .unwrap();
        assert_eq!(table.read().unwrap(), state);
        std::fs::write(table.path(), "{not json").unwrap();
        let e = table.read().unwrap_err().to_string();
        assert!(e.contains("damaged") && e.contains("cleanup"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn rejects_other_versions_and_port_zero() {
        assert!(TableState::parse(r#"{"version":2,"ports":{}}"#).is_err());
        assert!(TableState::parse(r#"{"version":1,"ports":{"0":"a"}}"#).is_err());
        assert!(TableState::parse(r#"{"version":1,"ports":{"7":"a"}}"#).is_ok());
    }
}
