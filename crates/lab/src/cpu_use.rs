//! How busy a set of CPUs was over an interval, from `/proc/stat`: the benchmarks report it
//! beside the system under test's own CPU time, so that work charged to other threads (softirq,
//! the kernel dispatcher) is seen too.

use crate::LabError;

/// Busy and total time of every CPU, from `/proc/stat`, in clock ticks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CpuTimes {
    /// Indexed by CPU number: `(busy, total)`. Busy is user + nice + system + irq + softirq
    /// (softirq holds the kernel's packet receive path, and so the kernel dispatcher); idle,
    /// iowait and steal are not busy.
    pub per_cpu: Vec<(u64, u64)>,
}

/// How busy a set of CPUs was over an interval.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CpuUse {
    /// Busy CPU time summed over the set, in seconds.
    pub busy_secs: f64,
    /// Busy time over elapsed time, averaged over the set's CPUs (0..=1).
    pub busy_fraction: f64,
}

impl CpuTimes {
    /// Reads `/proc/stat` now.
    pub fn now() -> Result<CpuTimes, LabError> {
        let text = std::fs::read_to_string("/proc/stat")
            .map_err(|e| LabError::io("reading /proc/stat", e))?;
        Ok(CpuTimes::parse(&text))
    }

    /// Parses the `cpuN ...` lines of `/proc/stat` text; malformed lines are skipped.
    pub fn parse(text: &str) -> CpuTimes {
        let mut per_cpu = Vec::new();
        for line in text.lines() {
            let mut words = line.split_whitespace();
            let Some(cpu) = words
                .next()
                .and_then(|w| w.strip_prefix("cpu"))
                .and_then(|n| n.parse::<usize>().ok())
            else {
                continue;
            };
            let v: Vec<u64> = words.map_while(|w| w.parse().ok()).collect();
            if v.len() < 8 || cpu >= 1 << 16 {
                continue;
            }
            // user nice system idle iowait irq softirq steal [guest guest_nice: inside user/nice]
            let busy = v[0] + v[1] + v[2] + v[5] + v[6];
            let total = busy + v[3] + v[4] + v[7];
            if per_cpu.len() <= cpu {
                per_cpu.resize(cpu + 1, (0, 0));
            }
            per_cpu[cpu] = (busy, total);
        }
        CpuTimes { per_cpu }
    }

    /// The use of `cpus` (all CPUs if empty) between `earlier` and `self`.
    pub fn since(&self, earlier: &CpuTimes, cpus: &[usize]) -> CpuUse {
        let all: Vec<usize> = (0..self.per_cpu.len()).collect();
        let cpus = if cpus.is_empty() { &all[..] } else { cpus };
        let (mut busy, mut total) = (0u64, 0u64);
        for &c in cpus {
            let (Some(now), Some(then)) = (self.per_cpu.get(c), earlier.per_cpu.get(c)) else {
                continue;
            };
            busy += now.0.saturating_sub(then.0);
            total += now.1.saturating_sub(then.1);
        }
        CpuUse {
            busy_secs: busy as f64 / clock_ticks_per_sec(),
            busy_fraction: if total == 0 {
                0.0
            } else {
                busy as f64 / total as f64
            },
        }
    }
}

/// The unit of `/proc/stat` (USER_HZ, 100 on Linux).
fn clock_ticks_per_sec() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        hz as f64
    } else {
        100.0
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn cpu_times_count_softirq_as_busy_and_steal_as_not() {
        let before = CpuTimes::parse(
            "cpu  9 9 9 9 9 9 9 9 0 0\ncpu0 100 0 50 800 10 5 20 3 0 0\ncpu1 10 0 10 980 0 0 0 0 0 0\nintr 1 2 3\n",
        );
        assert_eq!(before.per_cpu, vec![(175, 988), (20, 1000)]);
        let after = CpuTimes::parse(
            "cpu0 150 0 60 830 10 5 60 13 0 0\ncpu1 10 0 10 1080 0 0 0 0 0 0\nbroken line\ncpuX 1\n",
        );
        let u = after.since(&before, &[0]);
        assert!((u.busy_fraction - 100.0 / 140.0).abs() < 1e-9, "{u:?}");
        assert!(u.busy_secs > 0.0);
        assert_eq!(after.since(&before, &[1]).busy_fraction, 0.0);
        let all = after.since(&before, &[]);
        assert!((all.busy_fraction - 100.0 / 240.0).abs() < 1e-9, "{all:?}");
        assert_eq!(
            after.since(&before, &[7]),
            CpuUse::default(),
            "absent CPUs count nothing"
        );
        assert!(!CpuTimes::now().unwrap().per_cpu.is_empty());
    }
}
