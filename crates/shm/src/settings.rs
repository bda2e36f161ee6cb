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
//! | `FLATMESH_SHM_NOTIFY` | how a sleeping waiter is woken (`notify`): `sync` (a wake-up byte over the kernel socket), `async` (a signal to the sleeping thread), `norw` (Notify-on-RW: the peer's store to a write-protected page) | sync |
//! | `FLATMESH_SHM_STATS` | `1`: print counters and arena usage on stderr at exit; an absolute path: append them to that file | off |
//! | `FLATMESH_SHM_PORTS` | the allow-list: only connections to these server ports use shared memory; comma-separated ports and ranges (`8080,9000-9099`), at most 64 entries | every port |
//! | `FLATMESH_SHM_GROUP` | a directory the network namespaces of one split namespace share (set by `flatmesh pu run`): connections between them use shared memory too (`group`); an absolute path of at most 80 bytes | within one network namespace only |

use crate::arena;
use crate::region::{DEFAULT_LOCAL_BYTES, MAX_LOCAL_BYTES, MIN_LOCAL_BYTES};
use std::sync::OnceLock;
use std::time::Duration;

/// `FLATMESH_SHM_NOTIFY`: how a sleeping waiter is woken (`notify`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum NotifyMode {
    /// A wake-up byte over the kernel socket.
    Sync,
    /// A signal to the sleeping thread.
    Async,
    /// The peer's store to a page the sleeper write-protected.
    NotifyOnRw,
}

impl NotifyMode {
    pub fn parse(value: &str) -> Option<NotifyMode> {
        match value.trim() {
            "sync" => Some(NotifyMode::Sync),
            "async" => Some(NotifyMode::Async),
            "norw" => Some(NotifyMode::NotifyOnRw),
            _ => None,
        }
    }
}

pub struct Settings {
    pub enabled: bool,
    /// `FLATMESH_SHM_PORTS`: the server ports whose connections may use shared memory; `None`:
    /// every port.
    pub ports: Option<Vec<std::ops::RangeInclusive<u16>>>,
    /// `FLATMESH_SHM_GROUP`: the directory shared with the other PUs of a split namespace.
    pub group: Option<std::ffi::CString>,
    pub local_bytes: usize,
    pub spin: Duration,
    pub notify: NotifyMode,
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
    /// Whether a connection to server port `port` may use shared memory (the allow-list).
    pub fn port_allowed(&self, port: u16) -> bool {
        self.ports
            .as_ref()
            .is_none_or(|ranges| ranges.iter().any(|range| range.contains(&port)))
    }

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
    warn_then(name, value, rule, "using the default");
}

/// As `warn`, saying what is done instead.
fn warn_then(name: &str, value: &str, rule: &str, instead: &str) {
    let message =
        format!("flatmesh-shm: {name}={value:?} ignored: {rule}; {instead} (see docs/shm.md)\n");
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

/// Most entries `FLATMESH_SHM_PORTS` may list.
const MAX_PORT_RANGES: usize = 64;
const PORTS_RULE: &str = "must be comma-separated ports (1-65535) or ranges of them (8080,9000-9099), at most 64 entries";
/// Longest `FLATMESH_SHM_GROUP`: the directory's socket names (`<dir>/proof-<20 digits>`) must
/// fit a Unix socket address (108 bytes).
const MAX_GROUP_LEN: usize = 80;
const GROUP_RULE: &str = "must be an absolute directory path of at most 80 bytes";
const NOTIFY_RULE: &str = "must be sync, async or norw";

/// `FLATMESH_SHM_PORTS` read: `None` if it is not a valid list.
fn parse_ports(value: &str) -> Option<Vec<std::ops::RangeInclusive<u16>>> {
    let entries: Vec<&str> = value.split(',').map(str::trim).collect();
    if entries.len() > MAX_PORT_RANGES {
        return None;
    }
    entries
        .into_iter()
        .map(|entry| {
            let (low, high) = entry.split_once('-').unwrap_or((entry, entry));
            let (low, high) = (low.trim().parse::<u16>().ok()?, high.trim().parse::<u16>().ok()?);
            (low >= 1 && low <= high).then_some(low..=high)
        })
        .collect()
}

fn group_ok(value: &str) -> bool {
    value.starts_with('/') && value.len() <= MAX_GROUP_LEN && !value.contains('\0')
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
    if let Ok(value) = std::env::var("FLATMESH_SHM_PORTS") {
        if parse_ports(&value).is_none() {
            found.push(format!("FLATMESH_SHM_PORTS={value:?}: {PORTS_RULE}"));
        }
    }
    if let Ok(value) = std::env::var("FLATMESH_SHM_GROUP") {
        if !group_ok(&value) {
            found.push(format!("FLATMESH_SHM_GROUP={value:?}: {GROUP_RULE}"));
        }
    }
    if let Ok(value) = std::env::var("FLATMESH_SHM_NOTIFY") {
        if NotifyMode::parse(&value).is_none() {
            found.push(format!("FLATMESH_SHM_NOTIFY={value:?}: {NOTIFY_RULE}"));
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
        // A bad allow-list is an empty one (nothing uses shared memory), not "every port": the
        // list exists to keep connections off shared memory.
        let ports = var("FLATMESH_SHM_PORTS").map(|value| {
            parse_ports(&value).unwrap_or_else(|| {
                warn_then(
                    "FLATMESH_SHM_PORTS",
                    &value,
                    PORTS_RULE,
                    "no connection uses shared memory",
                );
                Vec::new()
            })
        });
        let group = var("FLATMESH_SHM_GROUP").and_then(|value| {
            if group_ok(&value) {
                std::ffi::CString::new(value).ok()
            } else {
                warn_then(
                    "FLATMESH_SHM_GROUP",
                    &value,
                    GROUP_RULE,
                    "shared memory only within this network namespace",
                );
                None
            }
        });
        let notify = var("FLATMESH_SHM_NOTIFY")
            .and_then(|value| {
                let mode = NotifyMode::parse(&value);
                if mode.is_none() {
                    warn("FLATMESH_SHM_NOTIFY", &value, NOTIFY_RULE);
                }
                mode
            })
            .unwrap_or(NotifyMode::Sync);
        let mut settings = Settings {
            enabled,
            ports,
            group,
            local_bytes,
            spin: Duration::from_micros(spin_us),
            notify,
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
