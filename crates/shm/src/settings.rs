//! Settings read once from the environment. A bad value is reported once on stderr and the
//! default is used (`flatmesh shm run` refuses bad values before it starts the program).
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `FLATMESH_SHM` | `off`/`0`/`false` disables the library | on |
//! | `FLATMESH_SHM_LOCAL_KIB` | size of each local record (one per direction), power of two, 8..65536 | 64 |
//! | `FLATMESH_SHM_ARENA_MIB` | shared arena size per user, split into one arena per core; 0 = no arena | 128 |
//! | `FLATMESH_SHM_PROCESS_RECORDS` | arena records one process may hold | a quarter of the arena |
//! | `FLATMESH_SHM_CONN_KIB` | arena bytes one direction of a connection may hold; 0 = none | 4096 |
//! | `FLATMESH_SHM_SPIN_US` | how long a waiter polls before it sleeps; 0 = never | 50 |
//! | `FLATMESH_SHM_STATS` | `1`: print counters and arena usage on stderr at exit; an absolute path: append them to that file | off |

use crate::arena;
use crate::region::{DEFAULT_LOCAL_BYTES, MAX_LOCAL_BYTES, MIN_LOCAL_BYTES};
use std::sync::OnceLock;
use std::time::Duration;

pub struct Settings {
    pub enabled: bool,
    pub local_bytes: usize,
    pub spin: Duration,
    pub arena_bytes: u64,
    pub process_records: u32,
    pub conn_records: u32,
}

/// Where the exit report goes (`FLATMESH_SHM_STATS`): `Some(None)` stderr, `Some(Some(path))`
/// a file, `None` nowhere. Read on its own, so that the exit hook does not parse (and warn
/// about) the other settings in a process that never used the library.
pub fn stats_target() -> &'static Option<Option<std::ffi::CString>> {
    static TARGET: OnceLock<Option<Option<std::ffi::CString>>> = OnceLock::new();
    TARGET.get_or_init(|| match std::env::var("FLATMESH_SHM_STATS").as_deref() {
        Ok("1" | "on" | "true") => Some(None),
        Ok(path) if path.starts_with('/') => Some(std::ffi::CString::new(path).ok()),
        _ => None,
    })
}

impl Settings {
    /// Records in each per-core arena.
    pub fn arena_records_per_core(&self) -> u32 {
        if self.arena_bytes == 0 {
            return 0;
        }
        let per_core = self.arena_bytes / arena::arena_count() as u64 / arena::RECORD_BYTES as u64;
        per_core.clamp(1, arena::MAX_RECORDS as u64 - 1) as u32
    }
}

fn warn(name: &str, value: &str, rule: &str) {
    let message = format!(
        "flatmesh-shm: {name}={value:?} ignored: {rule}; using the default (see docs/shm.md)\n"
    );
    // SAFETY: SYS_write reads `message.len()` bytes of a live local String. The raw system
    // call, not std's stderr: no std lock inside a preload hook, and `write` is interposed.
    unsafe { libc::syscall(libc::SYS_write, 2, message.as_ptr(), message.len()) };
}

/// Reads `name` as a number within `range`; warns and returns `None` when it is not one.
fn number(name: &str, range: std::ops::RangeInclusive<u64>, rule: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    match value.trim().parse::<u64>() {
        Ok(n) if range.contains(&n) => Some(n),
        _ => {
            warn(name, &value, rule);
            None
        }
    }
}

/// Checks every variable; one message per bad one (used by `flatmesh shm run` through the
/// same rules, so both agree).
pub fn problems() -> Vec<String> {
    let mut found: Vec<String> = Vec::new();
    if let Ok(value) = std::env::var("FLATMESH_SHM") {
        if !matches!(value.as_str(), "on" | "1" | "true" | "off" | "0" | "false") {
            found.push(format!(
                "FLATMESH_SHM={value:?}: must be on, off, 1, 0, true or false"
            ));
        }
    }
    if let Ok(value) = std::env::var("FLATMESH_SHM_STATS") {
        if !matches!(value.as_str(), "1" | "on" | "true" | "0" | "off" | "false")
            && !value.starts_with('/')
        {
            found.push(format!(
                "FLATMESH_SHM_STATS={value:?}: must be 1 (report on stderr at exit) or an absolute file path"
            ));
        }
    }
    found.extend(RULES.iter().filter_map(|(name, range, rule)| {
        let value = std::env::var(name).ok()?;
        let ok = value
            .trim()
            .parse::<u64>()
            .is_ok_and(|n| range.contains(&n) && (*name != LOCAL || n.is_power_of_two()));
        (!ok).then(|| format!("{name}={value:?}: {rule}"))
    }));
    found
}

const LOCAL: &str = "FLATMESH_SHM_LOCAL_KIB";
const LOCAL_RULE: &str = "must be a power of two from 8 to 65536 (KiB)";
const RULES: [(&str, std::ops::RangeInclusive<u64>, &str); 5] = [
    (
        LOCAL,
        (MIN_LOCAL_BYTES / 1024) as u64..=(MAX_LOCAL_BYTES / 1024) as u64,
        LOCAL_RULE,
    ),
    (
        "FLATMESH_SHM_ARENA_MIB",
        0..=65536,
        "must be a whole number of MiB from 0 (no arena) to 65536",
    ),
    (
        "FLATMESH_SHM_PROCESS_RECORDS",
        1..=(arena::MAX_RECORDS as u64 * arena::MAX_ARENAS as u64),
        "must be a positive number of records",
    ),
    (
        "FLATMESH_SHM_CONN_KIB",
        0..=16 * 1024 * 1024,
        "must be a whole number of KiB from 0 (no arena records) to 16777216",
    ),
    (
        "FLATMESH_SHM_SPIN_US",
        0..=1_000_000,
        "must be a whole number of microseconds from 0 to 1000000",
    ),
];

pub fn get() -> &'static Settings {
    static SETTINGS: OnceLock<Settings> = OnceLock::new();
    SETTINGS.get_or_init(|| {
        let var = |name: &str| std::env::var(name).ok();
        let enabled = !matches!(var("FLATMESH_SHM").as_deref(), Some("off" | "0" | "false"));
        let [local, arena_mib, process, conn, spin] = RULES.clone();
        let local_bytes = number(local.0, local.1, local.2)
            .and_then(|kib| {
                if kib.is_power_of_two() {
                    Some(kib as usize * 1024)
                } else {
                    warn(local.0, &kib.to_string(), LOCAL_RULE);
                    None
                }
            })
            .unwrap_or(DEFAULT_LOCAL_BYTES);
        let arena_bytes = number(arena_mib.0, arena_mib.1, arena_mib.2).unwrap_or(128) << 20;
        let conn_records = number(conn.0, conn.1, conn.2)
            .unwrap_or(4096)
            .saturating_mul(1024)
            .div_ceil(arena::RECORD_BYTES as u64)
            .min(u32::MAX as u64) as u32;
        let spin_us = number(spin.0, spin.1, spin.2).unwrap_or(50);
        let mut settings = Settings {
            enabled,
            local_bytes,
            spin: Duration::from_micros(spin_us),
            arena_bytes,
            process_records: 0,
            conn_records,
        };
        let default_process =
            (settings.arena_records_per_core() as u64 * arena::arena_count() as u64 / 4).max(1);
        settings.process_records = number(process.0, process.1, process.2)
            .unwrap_or(default_process)
            .min(u32::MAX as u64) as u32;
        settings
    })
}
