//! Settings read once from the environment.
//!
//! - `FLATMESH_SHM=off` disables the library (every call goes straight to libc).
//! - `FLATMESH_SHM_RING_KIB` sets each local record's size (power of two, 4 KiB..64 MiB; default 64).
//! - `FLATMESH_SHM_SPIN_US` sets how long a waiter polls before it sleeps (default 50; 0 = never).

use crate::region::{DEFAULT_RING_BYTES, MAX_RING_BYTES, MIN_RING_BYTES};
use std::sync::OnceLock;
use std::time::Duration;

pub struct Settings {
    pub enabled: bool,
    pub ring_bytes: usize,
    pub spin: Duration,
}

pub fn get() -> &'static Settings {
    static SETTINGS: OnceLock<Settings> = OnceLock::new();
    SETTINGS.get_or_init(|| {
        let var = |name: &str| std::env::var(name).ok();
        let enabled = !matches!(var("FLATMESH_SHM").as_deref(), Some("off" | "0" | "false"));
        let ring_bytes = var("FLATMESH_SHM_RING_KIB")
            .and_then(|v| v.trim().parse::<usize>().ok())
            .map(|kib| kib.saturating_mul(1024))
            .filter(|b| b.is_power_of_two() && (MIN_RING_BYTES..=MAX_RING_BYTES).contains(b))
            .unwrap_or(DEFAULT_RING_BYTES);
        let spin_us = var("FLATMESH_SHM_SPIN_US")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(50);
        Settings {
            enabled,
            ring_bytes,
            spin: Duration::from_micros(spin_us.min(1_000_000)),
        }
    })
}
