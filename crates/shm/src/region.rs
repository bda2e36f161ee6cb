//! The shared-memory region of one connection: a control page and two records (byte rings),
//! one per direction (§4.2.3 "two local records per connection").
//!
//! Layout (page-aligned): `[control page 4 KiB][record C->A][record A->C]`. Direction 0 carries
//! the connector's bytes to the acceptor, direction 1 the reverse. Each ring has exactly one
//! writing side and one reading side; a small spin lock per side serialises threads (or forked
//! processes) that share one socket.

use std::ffi::CStr;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

pub const MAGIC: u64 = 0x3168_736d_7461_6c66; // "flatmsh1"
pub const VERSION: u32 = 1;
pub const CONTROL_BYTES: usize = 4096;
/// Default size of each local record; `FLATMESH_SHM_RING_KIB` overrides it.
pub const DEFAULT_RING_BYTES: usize = 64 * 1024;
pub const MIN_RING_BYTES: usize = 4096;
pub const MAX_RING_BYTES: usize = 64 * 1024 * 1024;

/// The connection state word: the acceptor flips it once it has mapped the region.
pub const PENDING: u32 = 0;
pub const ATTACHED: u32 = 1;

#[repr(C, align(64))]
pub struct CacheLine<T>(pub T);

/// Control words of one direction.
#[repr(C)]
pub struct Direction {
    /// Bytes ever written (only the writer stores).
    pub written: CacheLine<AtomicU64>,
    /// Bytes ever consumed (only the reader stores).
    pub consumed: CacheLine<AtomicU64>,
    pub control: CacheLine<DirectionControl>,
}

#[repr(C)]
pub struct DirectionControl {
    /// Set by a reader before it sleeps; the writer that clears it sends a wake-up byte.
    pub reader_wants_wake: AtomicU32,
    /// Set by a writer before it sleeps on a full ring; the reader that clears it wakes it.
    pub writer_wants_wake: AtomicU32,
    pub write_lock: AtomicU32,
    pub read_lock: AtomicU32,
    /// The writer called shutdown(SHUT_WR): after the ring drains the reader sees EOF.
    pub shut_wr: AtomicU32,
    /// Direction 0 only: the connector moved from the kernel socket to the ring.
    pub switched: AtomicU32,
    /// Direction 0 only: bytes the connector sent over the kernel socket before switching.
    pub kernel_prefix: AtomicU64,
    /// Direction 0 only: bytes the connector has sent over the kernel socket so far.
    pub kernel_sent: AtomicU64,
    /// Direction 0 only: prefix bytes the acceptor has consumed from the kernel socket.
    pub kernel_consumed: AtomicU64,
}

#[repr(C)]
pub struct Control {
    pub magic: u64,
    pub version: u32,
    pub ring_bytes: u32,
    pub state: AtomicU32,
    pub connector_pid: u32,
    /// Processes holding each side (0: connector, 1: acceptor); fork adds one.
    pub holders: [AtomicU32; 2],
    pub directions: [Direction; 2],
}

const _: () = assert!(std::mem::size_of::<Control>() <= CONTROL_BYTES);

/// A mapped connection region. Unmapped on drop.
pub struct Region {
    base: *mut u8,
    len: usize,
    ring_bytes: usize,
}

// SAFETY: the region is shared memory accessed only through atomics and lock-protected copies.
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl Region {
    /// Creates the backing file at `path` (exclusively; a stale file is replaced), maps it and
    /// initialises the control page. Returns `None` on any failure: the caller then uses TCP.
    pub fn create(path: &CStr, ring_bytes: usize) -> Option<Region> {
        let len = CONTROL_BYTES + 2 * ring_bytes;
        let flags =
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC | libc::O_NOFOLLOW;
        // SAFETY: plain syscalls on a NUL-terminated path.
        let mut fd = unsafe { libc::open(path.as_ptr(), flags, 0o600) };
        if fd < 0 && crate::real::errno() == libc::EEXIST {
            // A crashed connector left it behind; the name (4-tuple) is ours now.
            unsafe { libc::unlink(path.as_ptr()) };
            fd = unsafe { libc::open(path.as_ptr(), flags, 0o600) };
        }
        if fd < 0 {
            return None;
        }
        // SAFETY: fd is ours.
        let sized = unsafe { libc::ftruncate(fd, len as libc::off_t) } == 0;
        let region = if sized {
            Self::map(fd, len, ring_bytes)
        } else {
            None
        };
        unsafe { crate::real::close(fd) };
        let Some(region) = region else {
            unsafe { libc::unlink(path.as_ptr()) };
            return None;
        };
        // SAFETY: freshly mapped, zero-filled and large enough for Control.
        unsafe {
            let control = region.base.cast::<Control>();
            (*control).version = VERSION;
            (*control).ring_bytes = ring_bytes as u32;
            (*control).connector_pid = libc::getpid() as u32;
            (*control).holders[0].store(1, Ordering::Relaxed);
            fence(Ordering::Release);
            (*control).magic = MAGIC;
        }
        Some(region)
    }

    /// Maps the region a connector created and checks that it is one. `None`: use TCP.
    pub fn attach(fd: libc::c_int) -> Option<Region> {
        // SAFETY: fstat into a zeroed struct.
        let mut stat: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd, &mut stat) } != 0 || stat.st_uid != unsafe { libc::geteuid() } {
            return None;
        }
        let len = usize::try_from(stat.st_size).ok()?;
        if !(CONTROL_BYTES + 2 * MIN_RING_BYTES..=CONTROL_BYTES + 2 * MAX_RING_BYTES).contains(&len)
        {
            return None;
        }
        let ring_bytes = (len - CONTROL_BYTES) / 2;
        let region = Self::map(fd, len, ring_bytes)?;
        let control = region.control();
        let valid = control.magic == MAGIC
            && control.version == VERSION
            && control.ring_bytes as usize == ring_bytes
            && ring_bytes.is_power_of_two()
            && control.state.load(Ordering::Acquire) == PENDING;
        valid.then_some(region)
    }

    fn map(fd: libc::c_int, len: usize, ring_bytes: usize) -> Option<Region> {
        // SAFETY: mapping a file we hold open, shared.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return None;
        }
        Some(Region {
            base: base.cast(),
            len,
            ring_bytes,
        })
    }

    pub fn control(&self) -> &Control {
        // SAFETY: the mapping holds a Control at offset 0 for its whole lifetime.
        unsafe { &*self.base.cast::<Control>() }
    }

    pub fn direction(&self, index: usize) -> Ring<'_> {
        let index = index & 1;
        Ring {
            control: &self.control().directions[index],
            // SAFETY: inside the mapping.
            data: unsafe { self.base.add(CONTROL_BYTES + index * self.ring_bytes) },
            capacity: self.ring_bytes as u64,
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: we own the mapping.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// One direction's ring: a single-producer single-consumer byte queue.
pub struct Ring<'a> {
    pub control: &'a Direction,
    data: *mut u8,
    capacity: u64,
}

/// A spin lock word in shared memory, held only while copying bytes (never across a syscall).
pub struct SpinGuard<'a>(&'a AtomicU32);

impl<'a> SpinGuard<'a> {
    pub fn lock(word: &'a AtomicU32) -> Self {
        while word
            .compare_exchange_weak(0, 1, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::hint::spin_loop();
        }
        SpinGuard(word)
    }
}

impl Drop for SpinGuard<'_> {
    fn drop(&mut self) {
        self.0.store(0, Ordering::Release);
    }
}

impl Ring<'_> {
    pub fn readable(&self) -> u64 {
        let written = self.control.written.0.load(Ordering::Acquire);
        written.wrapping_sub(self.control.consumed.0.load(Ordering::Acquire))
    }

    pub fn writable(&self) -> u64 {
        self.capacity - self.readable().min(self.capacity)
    }

    pub fn written(&self) -> u64 {
        self.control.written.0.load(Ordering::Acquire)
    }

    pub fn consumed(&self) -> u64 {
        self.control.consumed.0.load(Ordering::Acquire)
    }

    /// Appends as much of `chunks` as fits; returns the byte count.
    pub fn write(&self, chunks: &[(*const u8, usize)]) -> usize {
        let _guard = SpinGuard::lock(&self.control.control.0.write_lock);
        let written = self.control.written.0.load(Ordering::Relaxed);
        let consumed = self.control.consumed.0.load(Ordering::Acquire);
        let mut free = self.capacity - written.wrapping_sub(consumed).min(self.capacity);
        let mut position = written;
        for &(ptr, len) in chunks {
            if free == 0 {
                break;
            }
            let take = (len as u64).min(free);
            self.copy_in(position, ptr, take as usize);
            position += take;
            free -= take;
        }
        let total = position - written;
        if total > 0 {
            self.control.written.0.store(position, Ordering::Release);
        }
        total as usize
    }

    /// Copies up to the buffers' size out; consumes it unless `peek`. Returns the byte count.
    pub fn read(&self, buffers: &[(*mut u8, usize)], peek: bool) -> usize {
        let _guard = SpinGuard::lock(&self.control.control.0.read_lock);
        let consumed = self.control.consumed.0.load(Ordering::Relaxed);
        let written = self.control.written.0.load(Ordering::Acquire);
        let mut available = written.wrapping_sub(consumed).min(self.capacity);
        let mut position = consumed;
        for &(ptr, len) in buffers {
            if available == 0 {
                break;
            }
            let take = (len as u64).min(available);
            self.copy_out(position, ptr, take as usize);
            position += take;
            available -= take;
        }
        let total = position - consumed;
        if total > 0 && !peek {
            self.control.consumed.0.store(position, Ordering::Release);
        }
        total as usize
    }

    fn copy_in(&self, position: u64, src: *const u8, len: usize) {
        let offset = (position % self.capacity) as usize;
        let first = len.min(self.capacity as usize - offset);
        // SAFETY: offset+first <= capacity and the rest wraps to the start; src has len bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(src, self.data.add(offset), first);
            std::ptr::copy_nonoverlapping(src.add(first), self.data, len - first);
        }
    }

    fn copy_out(&self, position: u64, dst: *mut u8, len: usize) {
        let offset = (position % self.capacity) as usize;
        let first = len.min(self.capacity as usize - offset);
        // SAFETY: as in copy_in.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data.add(offset), dst, first);
            std::ptr::copy_nonoverlapping(self.data, dst.add(first), len - first);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn temp_region(ring: usize) -> (Region, std::ffi::CString) {
        let path = std::ffi::CString::new(format!(
            "/dev/shm/flatmesh-shm-unit-{}-{ring}",
            std::process::id()
        ))
        .unwrap();
        (Region::create(&path, ring).unwrap(), path)
    }

    #[test]
    fn ring_wraps_and_preserves_order() {
        let (region, path) = temp_region(4096);
        unsafe { libc::unlink(path.as_ptr()) };
        let ring = region.direction(0);
        let mut expected = Vec::new();
        let mut got = Vec::new();
        let mut next = 0u8;
        for round in 0..200 {
            let chunk: Vec<u8> = (0..(round * 37 % 3000 + 1))
                .map(|_| {
                    next = next.wrapping_add(1);
                    next
                })
                .collect();
            let n = ring.write(&[(chunk.as_ptr(), chunk.len())]);
            expected.extend_from_slice(&chunk[..n]);
            let mut buf = vec![0u8; round * 53 % 4000 + 1];
            let m = ring.read(&[(buf.as_mut_ptr(), buf.len())], false);
            got.extend_from_slice(&buf[..m]);
        }
        let mut rest = vec![0u8; 8192];
        let m = ring.read(&[(rest.as_mut_ptr(), rest.len())], false);
        got.extend_from_slice(&rest[..m]);
        assert_eq!(got, expected);
        assert_eq!(ring.readable(), 0);
        assert_eq!(ring.writable(), 4096);
    }

    #[test]
    fn full_ring_refuses_and_peek_does_not_consume() {
        let (region, path) = temp_region(4096);
        unsafe { libc::unlink(path.as_ptr()) };
        let ring = region.direction(1);
        let data = vec![7u8; 5000];
        assert_eq!(ring.write(&[(data.as_ptr(), data.len())]), 4096);
        assert_eq!(ring.write(&[(data.as_ptr(), 1)]), 0);
        let mut buf = [0u8; 10];
        assert_eq!(ring.read(&[(buf.as_mut_ptr(), 10)], true), 10);
        assert_eq!(ring.readable(), 4096);
        assert_eq!(
            ring.read(
                &[(buf.as_mut_ptr(), 4), (buf.as_mut_ptr().wrapping_add(4), 6)],
                false
            ),
            10
        );
        assert_eq!(ring.readable(), 4086);
    }

    #[test]
    fn attach_rejects_foreign_files() {
        let path = std::ffi::CString::new(format!(
            "/dev/shm/flatmesh-shm-unit-bad-{}",
            std::process::id()
        ))
        .unwrap();
        std::fs::write(path.to_str().unwrap(), vec![0u8; CONTROL_BYTES + 2 * 4096]).unwrap();
        let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR) };
        assert!(Region::attach(fd).is_none());
        unsafe { libc::close(fd) };
        unsafe { libc::unlink(path.as_ptr()) };
    }
}
