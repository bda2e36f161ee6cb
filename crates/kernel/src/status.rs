//! `flatmesh kernel status`: programs, maps, entries and per-program counters, read from the
//! pins so any process can show them.

use std::fmt;
use std::path::Path;

use aya::maps::{Array, HashMap, Map, MapData, PerCpuArray, SockHash};
use aya::programs::ProgramInfo;

use crate::abi::{
    FmAddr, FmConnLimit, FmDirect, FmL7Conn, FmL7Hold, FmRoute, FmShortcut, FmSockKey, FmStat,
    DERIVED_STATS, MATCH_END, STAT_NAMES, WHY_BASE, WHY_HELD, WHY_NAMES,
};
use crate::error::KernelError;
use crate::tier::{pinned_owner, KernelTier};

/// One pinned program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProgramStatus {
    pub name: String,
    pub id: u32,
    /// Kernel run count/time; non-zero only while `sysctl kernel.bpf_stats_enabled=1`.
    pub kernel_run_count: u64,
    pub kernel_run_time_ns: u64,
    /// flatmesh's own counters (always on), summed over CPUs.
    pub stats: FmStat,
    /// A counter row for part of another program's work (`fm_sk_msg_direct` is the part of
    /// `fm_sk_msg` that went socket direct), not a program of its own.
    pub derived: bool,
}

/// One pinned map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapStatus {
    pub name: String,
    pub entries: usize,
    pub max_entries: u32,
}

/// Everything under a pin directory.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelStatus {
    pub owner: Option<u32>,
    pub programs: Vec<ProgramStatus>,
    pub maps: Vec<MapStatus>,
    /// Why the verdict left work to user space: (reason, counters) for every reason it
    /// counted at least once. The count is in `fallbacks`; `bytes` is set for the per-chunk
    /// reasons (`unregistered`, `peer_gone`), the bytes so passed up.
    pub fallback_reasons: Vec<(String, FmStat)>,
}

impl KernelStatus {
    /// Counters of one program by name (`fm_sk_msg`, ...), zero if it is not loaded.
    pub fn stat(&self, program: &str) -> FmStat {
        self.programs
            .iter()
            .find(|p| p.name == program)
            .map(|p| p.stats)
            .unwrap_or_default()
    }

    /// How often the verdict left work to user space for `reason` (a name of
    /// `fallback_reasons`: `truncated`, `huffman`, `no_match`, ...), zero if never.
    pub fn fallbacks(&self, reason: &str) -> u64 {
        self.reason(reason).fallbacks
    }

    /// The counters of one `fallback_reasons` row by name (zero if never counted); for `held`,
    /// `runs` and `bytes` are the frames and bytes held across chunks.
    pub fn reason(&self, reason: &str) -> FmStat {
        self.fallback_reasons
            .iter()
            .find(|(r, _)| r == reason)
            .map(|(_, s)| *s)
            .unwrap_or_default()
    }

    /// Entries of one map by name, zero if it is not pinned.
    pub fn entries(&self, map: &str) -> usize {
        self.maps
            .iter()
            .find(|m| m.name == map)
            .map(|m| m.entries)
            .unwrap_or(0)
    }
}

impl KernelTier {
    /// Status of this tier.
    pub fn status(&self) -> Result<KernelStatus, KernelError> {
        status(&self.inner.cfg.pin_dir)
    }
}

fn count<K: aya::Pod, V: aya::Pod>(data: MapData, lru: bool) -> usize {
    let map = if lru {
        Map::LruHashMap(data)
    } else {
        Map::HashMap(data)
    };
    HashMap::<MapData, K, V>::try_from(map)
        .map(|m| m.keys().filter(Result::is_ok).count())
        .unwrap_or(0)
}

fn count_sock<K: aya::Pod>(data: MapData) -> usize {
    SockHash::<MapData, K>::try_from(Map::SockHash(data))
        .map(|m| m.keys().filter(Result::is_ok).count())
        .unwrap_or(0)
}

/// Reads the status of the tier pinned at `pin_dir`; empty if nothing is pinned there.
pub fn status(pin_dir: &Path) -> Result<KernelStatus, KernelError> {
    let mut st = KernelStatus {
        owner: pinned_owner(pin_dir),
        ..KernelStatus::default()
    };
    let entries = match std::fs::read_dir(pin_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(st),
        Err(e) => return Err(KernelError::io(format!("listing {}", pin_dir.display()), e)),
    };
    let stats: Option<PerCpuArray<MapData, FmStat>> = MapData::from_pin(pin_dir.join("fm_stats"))
        .ok()
        .and_then(|d| PerCpuArray::try_from(Map::PerCpuArray(d)).ok());
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    for name in names {
        let path = pin_dir.join(&name);
        if let Some(prog) = name.strip_prefix("prog_") {
            let info = ProgramInfo::from_pin(&path)
                .map_err(|e| KernelError::program("status", "read a pinned program", e))?;
            let sum = stats
                .as_ref()
                .map(|m| stat_sum(m, prog))
                .unwrap_or_default();
            st.programs.push(ProgramStatus {
                name: prog.to_string(),
                id: info.id(),
                kernel_run_count: info.run_count(),
                kernel_run_time_ns: info.run_time().as_nanos() as u64,
                stats: sum,
                derived: false,
            });
            continue;
        }
        let data = MapData::from_pin(&path)
            .map_err(|e| KernelError::map("status", "open a pinned map", e))?;
        let max_entries = data.info().map(|i| i.max_entries()).unwrap_or(0);
        let entries = match name.as_str() {
            "fm_services" => count::<FmAddr, FmAddr>(data, false),
            "fm_bypass_pids" => count::<u32, u8>(data, false),
            "fm_orig_by_cookie" => count::<u64, FmAddr>(data, true),
            "fm_orig_by_tuple" => count::<[u8; 40], FmAddr>(data, true),
            "fm_redirect_ports" | "fm_l7_ports" => count::<u16, u8>(data, false),
            "fm_l7_conns" => count::<u64, FmL7Conn>(data, true),
            "fm_l7_hold" => count::<u64, FmL7Hold>(data, true),
            "fm_redirect_socks" => count_sock::<[u8; 48]>(data),
            "fm_shortcuts" => count::<FmSockKey, FmShortcut>(data, false),
            "fm_direct_bytes" => count::<FmSockKey, FmDirect>(data, false),
            "fm_l7_socks" => count_sock::<u64>(data),
            "fm_conn_limits" => count::<u16, FmConnLimit>(data, false),
            "fm_routes" => Array::<MapData, FmRoute>::try_from(Map::Array(data))
                .map(|a| {
                    a.iter()
                        .take_while(|r| r.as_ref().is_ok_and(|r| r.kind != MATCH_END))
                        .count()
                })
                .unwrap_or(0),
            _ => max_entries as usize,
        };
        st.maps.push(MapStatus {
            name,
            entries,
            max_entries,
        });
    }
    // Counters that are part of a program's work get a row of their own under it.
    for (name, parent) in DERIVED_STATS {
        let Some(pos) = st.programs.iter().position(|p| p.name == parent) else {
            continue;
        };
        let stats = stats
            .as_ref()
            .map(|m| stat_sum(m, name))
            .unwrap_or_default();
        let row = ProgramStatus {
            name: name.to_string(),
            id: st.programs[pos].id,
            kernel_run_count: 0,
            kernel_run_time_ns: 0,
            stats,
            derived: true,
        };
        st.programs.insert(pos + 1, row);
    }
    if st.programs.iter().any(|p| p.name == "fm_verdict") {
        if let Some(m) = stats.as_ref() {
            for (i, name) in WHY_NAMES.iter().enumerate() {
                let s = slot_sum(m, WHY_BASE + i as u32);
                if s != FmStat::default() {
                    let name = if name.is_empty() {
                        format!("reason_{i}")
                    } else {
                        name.to_string()
                    };
                    st.fallback_reasons.push((name, s));
                }
            }
        }
    }
    Ok(st)
}

/// One counter slot of `fm_stats`, summed over CPUs.
fn stat_sum(stats: &PerCpuArray<MapData, FmStat>, name: &str) -> FmStat {
    match STAT_NAMES.iter().position(|n| *n == name) {
        Some(idx) => slot_sum(stats, idx as u32),
        None => FmStat::default(),
    }
}

/// One slot of `fm_stats` by index, summed over CPUs (zero if the map is older and shorter).
fn slot_sum(stats: &PerCpuArray<MapData, FmStat>, idx: u32) -> FmStat {
    let mut sum = FmStat::default();
    if let Ok(per_cpu) = stats.get(&idx, 0) {
        for s in per_cpu.iter() {
            sum.runs += s.runs;
            sum.bytes += s.bytes;
            sum.hits += s.hits;
            sum.fallbacks += s.fallbacks;
        }
    }
    sum
}

impl fmt::Display for KernelStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.owner {
            Some(pid) => writeln!(f, "tier K attached by pid {pid}")?,
            None if self.programs.is_empty() => return writeln!(f, "tier K is not attached"),
            None => writeln!(f, "tier K pins without an owner (stale?)")?,
        }
        writeln!(
            f,
            "{:<22} {:>6} {:>12} {:>14} {:>10} {:>10}",
            "program", "id", "runs", "bytes", "hits", "fallbacks"
        )?;
        for p in &self.programs {
            let name = if p.derived {
                format!("  {}", p.name)
            } else {
                p.name.clone()
            };
            writeln!(
                f,
                "{:<22} {:>6} {:>12} {:>14} {:>10} {:>10}",
                name, p.id, p.stats.runs, p.stats.bytes, p.stats.hits, p.stats.fallbacks
            )?;
            if p.name == "fm_verdict" {
                // Why the verdict left work to user space: one row per reason seen (the
                // fallbacks column), and the frames it held across chunks (runs, bytes).
                for (why, s) in &self.fallback_reasons {
                    let (name, runs, bytes) = if why == WHY_NAMES[WHY_HELD] {
                        (
                            "  held across chunks".to_string(),
                            s.runs.to_string(),
                            s.bytes,
                        )
                    } else {
                        (format!("  why {why}"), String::new(), s.bytes)
                    };
                    let bytes = if bytes > 0 {
                        bytes.to_string()
                    } else {
                        String::new()
                    };
                    writeln!(
                        f,
                        "{:<22} {:>6} {:>12} {:>14} {:>10} {:>10}",
                        name, "", runs, bytes, "", s.fallbacks
                    )?;
                }
            }
        }
        writeln!(f, "{:<22} {:>10} {:>10}", "map", "entries", "max")?;
        for m in &self.maps {
            writeln!(f, "{:<22} {:>10} {:>10}", m.name, m.entries, m.max_entries)?;
        }
        Ok(())
    }
}
