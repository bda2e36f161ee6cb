//! A spin lock in shared memory that survives the death of its holder.
//!
//! The lock word holds the holder's pid (0: free). Locks are held only while copying bytes or
//! relinking a few records, never across a system call that can block, so a waiter spins
//! (yielding now and then: on a 2-core machine the holder may need our core). A waiter that has
//! spun for long checks whether the holder still lives, and takes the lock over from a dead one:
//! a peer that crashes while holding it must not hang the survivor.

use crate::process;
use std::sync::atomic::{AtomicU32, Ordering};

pub struct SpinGuard<'a>(&'a AtomicU32);

impl<'a> SpinGuard<'a> {
    /// Takes the lock. `robust`: the holder's pid can be judged (same pid namespace), so a dead
    /// holder's lock may be taken over.
    pub fn lock(word: &'a AtomicU32, robust: bool) -> Self {
        let me = process::pid();
        let mut spins = 0u32;
        loop {
            match word.compare_exchange_weak(0, me, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => return SpinGuard(word),
                Err(holder) => {
                    spins = spins.wrapping_add(1);
                    if spins.is_multiple_of(64) {
                        // SAFETY: plain syscall.
                        unsafe { libc::sched_yield() };
                    }
                    if robust
                        && spins.is_multiple_of(4096)
                        && holder != 0
                        && holder != me
                        && !process::alive(holder)
                        && word
                            .compare_exchange(holder, me, Ordering::Acquire, Ordering::Relaxed)
                            .is_ok()
                    {
                        return SpinGuard(word);
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
        let guard = SpinGuard::lock(&word, true);
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
        drop(SpinGuard::lock(&word, true));
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        assert_eq!(word.load(Ordering::Relaxed), 0);
    }
}
