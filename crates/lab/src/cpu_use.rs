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

/// User + system CPU time a live process has used, in seconds, from `/proc/<pid>/stat`
/// (0 once it is gone).
pub fn process_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // The command name (field 2) may hold spaces and parentheses: count fields after its last
    // `)`. utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / clock_ticks_per_sec()
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
    fn a_process_cpu_time_grows_with_work_and_is_zero_when_gone() {
        let before = process_seconds(std::process::id());
        // Work until the kernel has charged at least one clock tick to this process.
        let mut x = 1u64;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while process_seconds(std::process::id()) <= before {
            assert!(
                std::time::Instant::now() < deadline,
                "no CPU time charged in 20 s of work"
            );
            for i in 0..100_000u64 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(i);
            }
            std::hint::black_box(x);
        }
        assert_eq!(process_seconds(u32::MAX), 0.0);
    }

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
