//! A spin lock in shared memory that survives the death of its holder.
//!
//! The lock word holds the holder's pid (0: free). Locks are held only while copying bytes or
//! relinking a few records, never across a system call that can block, so a waiter spins
//! (yielding now and then: on a 2-core machine the holder may need our core). A waiter that has
//! spun for long checks whether the holder still lives, and takes the lock over from a dead one:
//! a peer that crashes while holding it must not hang the survivor. A live holder that keeps
//! the lock past [`PATIENCE`] is not holding it for a copy: a misbehaving peer, or a scribbled
//! header, left the word set. The waiter then gives up with [`Stuck`], and the caller treats the
//! connection as broken (a reset), so one bad peer never hangs a worker.

use crate::process;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// How long a waiter waits for a live holder. Holders keep a lock for microseconds; even one
/// preempted on a loaded machine lets go within milliseconds. (A holder stopped by SIGSTOP or a
/// debugger in the middle of a copy for this long also makes its peer give up: documented in
/// docs/shm.md.)
pub const PATIENCE: Duration = Duration::from_secs(2);

/// Spins between looks at the clock and at the holder's pid.
const SPINS_PER_CHECK: u32 = 4096;

pub struct SpinGuard<'a>(&'a AtomicU32);

/// A lock that stayed held past [`PATIENCE`] by a live process.
#[derive(Debug, PartialEq, Eq)]
pub struct Stuck;

impl<'a> SpinGuard<'a> {
    /// Takes the lock. `robust`: the holder's pid can be judged (same pid namespace), so a dead
    /// holder's lock may be taken over. `Stuck` when a live holder keeps it past [`PATIENCE`].
    pub fn lock(word: &'a AtomicU32, robust: bool) -> Result<Self, Stuck> {
        Self::lock_within(word, robust, PATIENCE)
    }

    fn lock_within(word: &'a AtomicU32, robust: bool, patience: Duration) -> Result<Self, Stuck> {
        let me = process::pid();
        let mut spins = 0u32;
        // Set at the first check, so that an uncontended lock never reads the clock.
        let mut waiting_since: Option<Instant> = None;
        loop {
            match word.compare_exchange_weak(0, me, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => return Ok(SpinGuard(word)),
                Err(holder) => {
                    spins = spins.wrapping_add(1);
                    if spins.is_multiple_of(64) {
                        // SAFETY: sched_yield takes no arguments and has no preconditions.
                        unsafe { libc::sched_yield() };
                    }
                    if spins.is_multiple_of(SPINS_PER_CHECK) {
                        if robust
                            && holder != 0
                            && holder != me
                            && !process::alive(holder)
                            && word
                                .compare_exchange(holder, me, Ordering::Acquire, Ordering::Relaxed)
                                .is_ok()
                        {
                            return Ok(SpinGuard(word));
                        }
                        if waiting_since.get_or_insert_with(Instant::now).elapsed() >= patience {
                            return Err(Stuck);
                        }
                    }
                    std::hint::spin_loop();
                }
            }
        }
    }

    /// Takes the lock if it comes free within `attempts` tries (a few microseconds); `None`
    /// otherwise. For locks whose work may be skipped: a lock word that a misbehaving peer
    /// left set (even to a live pid, or to our own) can then never hang the caller.
    pub fn lock_briefly(word: &'a AtomicU32, attempts: u32) -> Option<Self> {
        let me = process::pid();
        for _ in 0..attempts {
            if word
                .compare_exchange_weak(0, me, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                return Some(SpinGuard(word));
            }
            std::hint::spin_loop();
        }
        None
    }

    /// Takes the lock only if it is free now.
    pub fn try_lock(word: &'a AtomicU32) -> Option<Self> {
        word.compare_exchange(0, process::pid(), Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| SpinGuard(word))
    }
}

impl Drop for SpinGuard<'_> {
    fn drop(&mut self) {
        self.0.store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn excludes_and_releases() {
        let word = AtomicU32::new(0);
        let guard = SpinGuard::lock(&word, true).unwrap();
        assert_eq!(word.load(Ordering::Relaxed), process::pid());
        assert!(SpinGuard::try_lock(&word).is_none());
        drop(guard);
        assert!(SpinGuard::try_lock(&word).is_some());
        assert_eq!(word.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_dead_holder_is_taken_over() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let word = AtomicU32::new(dead);
        let started = std::time::Instant::now();
        drop(SpinGuard::lock(&word, true).unwrap());
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        assert_eq!(word.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_live_holder_that_never_lets_go_makes_the_waiter_give_up() {
        // Our own pid: alive, and not a holder this waiter may take over.
        let word = AtomicU32::new(process::pid());
        let started = Instant::now();
        let patience = Duration::from_millis(50);
        assert_eq!(
            SpinGuard::lock_within(&word, true, patience).err(),
            Some(Stuck)
        );
        assert!(started.elapsed() >= patience);
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(word.load(Ordering::Relaxed), process::pid(), "left as it was");
    }
}
