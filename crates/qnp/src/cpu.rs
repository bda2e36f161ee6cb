//! Pinning threads to CPUs, so that the dispatch workers (and a benchmark's load generator)
//! run on the cores they are given (DESIGN.md, "Measuring"). How busy CPUs were is measured
//! in the lab (`flatmesh_lab::cpu_use`).

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
    fn pinning_to_cpu_0_works_and_absurd_cpus_are_refused() {
        std::thread::spawn(|| {
            pin_current_thread(&[0]).unwrap();
            assert!(pin_current_thread(&[100_000]).is_err());
        })
        .join()
        .unwrap();
    }
}
