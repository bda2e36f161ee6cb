//! Pinning threads to CPUs, so that a benchmark runs the system under test and the load
//! generator on the cores DESIGN.md names ("Measuring"), the same cores for every mode.

use crate::QnpError;

/// Restricts the calling thread to `cpus`; an empty list leaves it unpinned.
pub fn pin_current_thread(cpus: &[usize]) -> Result<(), QnpError> {
    if cpus.is_empty() {
        return Ok(());
    }
    // SAFETY: cpu_set_t is plain bits, so all-zero is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let max = 8 * std::mem::size_of::<libc::cpu_set_t>();
    for &c in cpus {
        if c >= max {
            return Err(QnpError::TooLarge(format!(
                "CPU {c} is beyond the {max} a CPU set holds; name CPUs that exist (see nproc)"
            )));
        }
        // SAFETY: `c` is inside the set, checked just above.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: `set` is a valid cpu_set_t of the size passed; pid 0 is the calling thread.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
    if rc != 0 {
        return Err(QnpError::io(
            format!("pinning a thread to CPUs {cpus:?} (do they exist? see nproc)"),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

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
    pub fn now() -> Result<CpuTimes, QnpError> {
        let text = std::fs::read_to_string("/proc/stat").map_err(|e| QnpError::File {
            path: "/proc/stat".into(),
            source: e,
        })?;
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

/// Parses a CPU list such as `1`, `0,1` or `0-3`; an empty string is no pinning.
pub fn parse_cpu_list(s: &str) -> Result<Vec<usize>, QnpError> {
    let bad = || {
        QnpError::TooLarge(format!(
            "bad CPU list `{s}`; write CPUs as `1`, `0,1` or `0-3`"
        ))
    };
    let mut out = Vec::new();
    // CPU numbers a cpu_set_t can hold.
    let limit = 8 * std::mem::size_of::<libc::cpu_set_t>();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (
                    a.trim().parse().map_err(|_| bad())?,
                    b.trim().parse().map_err(|_| bad())?,
                );
                if a > b || b >= limit {
                    return Err(bad());
                }
                out.extend(a..=b);
            }
            None => out.push(part.parse().map_err(|_| bad())?),
        }
        if out.last().is_some_and(|c| *c >= limit) || out.len() > limit {
            return Err(bad());
        }
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_and_bad_ones_say_how() {
        assert_eq!(parse_cpu_list("1").unwrap(), vec![1]);
        assert_eq!(parse_cpu_list("0, 2-3").unwrap(), vec![0, 2, 3]);
        assert_eq!(parse_cpu_list("").unwrap(), Vec::<usize>::new());
        assert_eq!(parse_cpu_list("1,1,0").unwrap(), vec![0, 1]);
        for bad in ["x", "3-1", "1-", "0-99999", "5000"] {
            assert!(parse_cpu_list(bad).unwrap_err().to_string().contains("0-3"));
        }
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

    #[test]
    fn pinning_to_cpu_0_works_and_absurd_cpus_are_refused() {
        std::thread::spawn(|| {
            pin_current_thread(&[0]).unwrap();
            assert!(pin_current_thread(&[100_000]).is_err());
        })
        .join()
        .unwrap();
    }
}
