//! The shared-memory region of one connection: two page-aligned local records, one per
//! direction (§4.2.3 "two local records per connection"), and the arena records a sender
//! chains behind them when a local record is full.
//!
//! Layout: `[record 0: header + ring][record 1: header + ring]`, each record
//! `FLATMESH_SHM_LOCAL_KIB` long (64 KiB by default, so a connection takes 128 KiB). A record's
//! first 1 KiB is its metadata: the direction's counters, wake-up flags, locks and chain state;
//! record 0's header also holds the connection-wide words. Direction 0 carries the connector's
//! bytes to the acceptor, direction 1 the reverse.
//!
//! One direction is a [`Pipe`]: a byte stream with one writing side and one reading side. Every
//! byte has a stream offset; `written` and `consumed` count them. Bytes live either in the local
//! record, used as a ring, or in arena records chained in stream order (each with its first
//! offset). The writer fills the ring; when the ring is full it appends arena records
//! (speculative allocation, see `arena`) and keeps writing there until the reader has drained
//! the ring, then goes back to the ring. So at most one run of ring bytes is ever unconsumed and
//! ring positions never collide.

use crate::arena::{self, RecordRef};
use crate::lock::{SpinGuard, Stuck};
use crate::process;
use std::ffi::CStr;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

pub const MAGIC: u64 = 0x3268_736d_7461_6c66; // "flatmsh2"
pub const VERSION: u32 = 5;
/// Metadata at the start of each local record.
pub const HEADER_BYTES: usize = 1024;
/// Default size of each local record (header included); `FLATMESH_SHM_LOCAL_KIB` overrides it.
pub const DEFAULT_LOCAL_BYTES: usize = 64 * 1024;
pub const MIN_LOCAL_BYTES: usize = 8 * 1024;
pub const MAX_LOCAL_BYTES: usize = 64 * 1024 * 1024;
/// Regions up to this size are reserved at creation (no SIGBUS if /dev/shm fills up later).
const POPULATE_LIMIT: usize = 1 << 20;
/// Processes per side whose liveness is tracked (fork adds one).
pub const PIDS_PER_SIDE: usize = 4;

/// The connection state word: the acceptor flips it once it has mapped the region.
pub const PENDING: u32 = 0;
pub const ATTACHED: u32 = 1;
/// An acceptor has claimed the region and is filling in its side (one claim per region).
pub const ATTACHING: u32 = 2;

/// Longest chain a reader walks; anything longer is a corrupt (cyclic) chain.
const MAX_CHAIN: usize = 1 << 16;

/// Writer modes of a pipe.
const MODE_RING: u32 = 0;
const MODE_CHAIN: u32 = 1;

/// A write at least this long goes to arena records, not through the local ring, when the ring
/// is smaller than [`BULK_RING_LIMIT`]. A small ring is rewritten right after the reader's CPU
/// read it, and taking those cache lines back costs more than the copy itself (see
/// `arena::COOLING`); arena records come back only after 3 MiB of others. Small writes keep the
/// ring (their few lines are the message; latency, not bandwidth, counts there).
const BULK_BYTES: usize = 32 * 1024;
/// Rings at least this large give the reuse distance by themselves.
const BULK_RING_LIMIT: u64 = 1 << 20;

#[repr(C, align(64))]
pub struct CacheLine<T>(pub T);

/// Control words of one direction, one cache line per writer: a waiting reader polls
/// `written` (and glances at `control`), so nothing the writer stores on every message may
/// share a line with what the reader stores on every message, and the locks (stored by their
/// side on every call) sit on lines of their own. (With the locks in `control`, each 16-byte
/// message moved that line between the CPUs four times.)
#[repr(C)]
pub struct Direction {
    /// Bytes ever written (only the writer stores).
    pub written: CacheLine<AtomicU64>,
    /// Bytes ever consumed (only the reader stores).
    pub consumed: CacheLine<AtomicU64>,
    /// Read-mostly: wake-up flags, shutdown, the connector's switch.
    pub control: CacheLine<DirectionControl>,
    /// Held (pid) by the writing side while it writes; serialises threads and forked processes.
    pub write_lock: CacheLine<AtomicU32>,
    /// Held (pid) by the reading side while it reads.
    pub read_lock: CacheLine<AtomicU32>,
    pub chain: CacheLine<ChainState>,
}

#[repr(C)]
pub struct DirectionControl {
    /// Set by a reader before it sleeps; the writer that clears it wakes it, as the value
    /// says (`notify::WAKE_*`: a wake-up byte or a signal; nothing for a fault).
    pub reader_wants_wake: AtomicU32,
    /// Set by a writer before it sleeps on a full pipe; the reader that clears it wakes it.
    pub writer_wants_wake: AtomicU32,
    /// The writer called shutdown(SHUT_WR): after the pipe drains the reader sees EOF.
    pub shut_wr: AtomicU32,
    /// Direction 0 only: the connector moved from the kernel socket to the pipe.
    pub switched: AtomicU32,
    /// Direction 0 only: bytes the connector sent over the kernel socket before switching.
    pub kernel_prefix: AtomicU64,
    /// Direction 0 only: bytes the connector has sent over the kernel socket so far.
    pub kernel_sent: AtomicU64,
    /// Direction 0 only: prefix bytes the acceptor has consumed from the kernel socket.
    pub kernel_consumed: AtomicU64,
    /// The sleeping reader's thread (`tgid << 32 | tid`) when it asked for a signal.
    pub reader_thread: AtomicU64,
    /// Likewise for a sleeping writer.
    pub writer_thread: AtomicU64,
}

const _: () = assert!(std::mem::size_of::<DirectionControl>() <= 64);

/// The arena-record chain of one direction.
#[repr(C)]
pub struct ChainState {
    /// Writer only (under `write_lock`): ring or chain.
    pub mode: AtomicU32,
    /// Held (pid) by whoever relinks records: the writer appending, the reader releasing.
    pub lock: AtomicU32,
    /// Writer only: first stream offset of the current ring run.
    pub ring_start: AtomicU64,
    /// Writer only, in chain mode: the offset where the ring run ended.
    pub ring_end: AtomicU64,
    /// Under `lock`: first and last record of the chain ([`RecordRef`]).
    pub head: AtomicU32,
    pub tail: AtomicU32,
    /// Under `lock`: the reading side closed; nothing may be appended any more.
    pub reader_gone: AtomicU32,
    /// Records ever linked and ever released (their difference is what the direction holds).
    pub linked: AtomicU32,
    pub released: AtomicU32,
}

/// Connection-wide words (in record 0's header).
#[repr(C)]
pub struct Control {
    pub magic: u64,
    pub version: u32,
    pub local_bytes: u32,
    pub state: AtomicU32,
    pub _reserved: u32,
    /// A random number that names the connection; arena records carry it as their owner.
    pub token: u64,
    /// The kernel's cookie of the connector's TCP socket: the acceptor attaches only if the
    /// connection it accepted ends in that socket (`proof`).
    pub connector_cookie: u64,
    /// Pid namespace of each side (liveness by pid is judged only when they match).
    pub pid_namespace: [AtomicU64; 2],
    /// Processes holding each side (0: connector, 1: acceptor); fork adds one.
    pub holders: [AtomicU32; 2],
    /// Pids of the processes holding each side (0 = empty slot), for crash detection.
    pub pids: [[AtomicU32; PIDS_PER_SIDE]; 2],
    /// More processes held a side than there are pid slots: liveness is unknown.
    pub pids_overflow: [AtomicU32; 2],
    /// Notify-on-RW (`notify`): each side's userfaultfd over its mapping of the region
    /// (`pid << 32 | fd number + 1`, 0 = none), how far the hand-over got, and where that
    /// mapping starts in the owner's memory.
    pub fault_owner: [AtomicU64; 2],
    pub fault_state: [AtomicU32; 2],
    pub mapping: [AtomicU64; 2],
}

#[repr(C)]
struct RecordHeader {
    control: Control,
    direction: Direction,
}

const _: () = assert!(std::mem::size_of::<RecordHeader>() <= HEADER_BYTES);

/// A mapped connection region. Unmapped on drop.
pub struct Region {
    base: *mut u8,
    len: usize,
    local_bytes: usize,
}

// SAFETY: a Region owns its mapping (base and length, unmapped once on drop); nothing in it is
// tied to the thread that made it.
unsafe impl Send for Region {}
// SAFETY: through `&Region` the mapping is only reached through atomics, header fields that are
// written before `magic` is published, and ring copies made under the direction's write or read
// lock (`SpinGuard`), so threads of this process sharing it race no more than the peer does.
unsafe impl Sync for Region {}

fn random_token() -> u64 {
    let mut token = 0u64;
    // SAFETY: getrandom writes at most 8 bytes, into `token`, a live local u64.
    let got = unsafe { libc::getrandom((&mut token as *mut u64).cast(), 8, libc::GRND_NONBLOCK) };
    if got != 8 || token == 0 {
        // Not secret, only unique: fall back to time and pid.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        token = now ^ ((process::pid() as u64) << 32) | 1;
    }
    token
}

impl Region {
    /// Creates the backing file at `path` (exclusively; a stale file is replaced), maps it and
    /// initialises the header for the connector socket whose kernel cookie is
    /// `connector_cookie`. Returns `None` on any failure: the caller then uses TCP.
    pub fn create(path: &CStr, local_bytes: usize, connector_cookie: u64) -> Option<Region> {
        let len = 2 * local_bytes;
        let flags =
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC | libc::O_NOFOLLOW;
        // SAFETY: `path` is a CStr, so NUL-terminated; open reads nothing else.
        let mut fd = unsafe { libc::open(path.as_ptr(), flags, 0o600) };
        if fd < 0 && crate::real::errno() == libc::EEXIST {
            // A crashed connector left it behind; the name (4-tuple) is ours now.
            // SAFETY: as above, a NUL-terminated path.
            unsafe { libc::unlink(path.as_ptr()) };
            // SAFETY: as above, a NUL-terminated path.
            fd = unsafe { libc::open(path.as_ptr(), flags, 0o600) };
        }
        if fd < 0 {
            return None;
        }
        // SAFETY: `fd` is the file opened above, owned here; ftruncate takes no pointer.
        let sized = unsafe { libc::ftruncate(fd, len as libc::off_t) } == 0;
        let region = if sized {
            Self::map(fd, len, local_bytes)
        } else {
            None
        };
        // SAFETY: `fd` is ours and closed once, here; the mapping stays valid without it.
        unsafe { crate::real::close(fd) };
        let region = region.filter(|r| len > POPULATE_LIMIT || arena::populate(r.base, r.len));
        let Some(region) = region else {
            // SAFETY: `path` is a CStr, so NUL-terminated.
            unsafe { libc::unlink(path.as_ptr()) };
            return None;
        };
        // SAFETY: the mapping of the new file is page-aligned, zero-filled and `2 * local_bytes`
        // (>= 2 * MIN_LOCAL_BYTES) long, so a Control (inside HEADER_BYTES, asserted) sits at
        // offset 0; no attacher uses it before `magic` is published last (`valid_header`).
        unsafe {
            let control = &mut *region.base.cast::<Control>();
            control.version = VERSION;
            control.local_bytes = local_bytes as u32;
            control.token = random_token();
            control.connector_cookie = connector_cookie;
            control.pid_namespace[0].store(process::pid_namespace(), Ordering::Relaxed);
            control.holders[0].store(1, Ordering::Relaxed);
            control.pids[0][0].store(process::pid(), Ordering::Relaxed);
            fence(Ordering::Release);
            control.magic = MAGIC;
        }
        Some(region)
    }

    /// A region in anonymous shared memory (no file), initialised as `create` does; for the
    /// fuzzer, which then plays the peer.
    #[cfg(fuzzing)]
    pub fn anonymous(local_bytes: usize) -> Option<Region> {
        let len = 2 * local_bytes;
        // SAFETY: a fresh anonymous mapping of `len` bytes, used only once it is known not to
        // be MAP_FAILED: page-aligned and zero-filled, with room for the Control at offset 0 as
        // in `create`. Only this process maps it.
        unsafe {
            let base = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if base == libc::MAP_FAILED {
                return None;
            }
            let region = Region {
                base: base.cast(),
                len,
                local_bytes,
            };
            let control = &mut *region.base.cast::<Control>();
            control.version = VERSION;
            control.local_bytes = local_bytes as u32;
            control.token = random_token();
            control.pid_namespace[0].store(process::pid_namespace(), Ordering::Relaxed);
            control.pid_namespace[1].store(process::pid_namespace(), Ordering::Relaxed);
            control.magic = MAGIC;
            Some(region)
        }
    }

    /// The region's bytes, as the peer could scribble on them (fuzzer only).
    #[cfg(fuzzing)]
    pub fn raw(&self) -> (*mut u8, usize) {
        (self.base, self.len)
    }

    /// Maps the region a connector created and checks that it is one. `None`: use TCP.
    pub fn attach(fd: libc::c_int) -> Option<Region> {
        // SAFETY: `struct stat` is plain integers, for which all-zero bytes are a valid value.
        let mut stat: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat writes one `struct stat` into `stat`, a live local of that type (a bad
        // fd only fails); geteuid has no preconditions.
        if unsafe { libc::fstat(fd, &mut stat) } != 0 || stat.st_uid != unsafe { libc::geteuid() } {
            return None;
        }
        let len = usize::try_from(stat.st_size).ok()?;
        if !(2 * MIN_LOCAL_BYTES..=2 * MAX_LOCAL_BYTES).contains(&len) {
            return None;
        }
        let local_bytes = len / 2;
        let region = Self::map(fd, len, local_bytes)?;
        region.valid_header().then_some(region)
    }

    /// Whether a mapped region's header describes this region (a connector's fresh one).
    fn valid_header(&self) -> bool {
        let control = self.control();
        control.magic == MAGIC
            && control.version == VERSION
            && control.local_bytes as usize == self.local_bytes
            && self.local_bytes.is_power_of_two()
            && control.token != 0
            && control.state.load(Ordering::Acquire) == PENDING
    }

    fn map(fd: libc::c_int, len: usize, local_bytes: usize) -> Option<Region> {
        let base = crate::arena::map_file(fd, len)?;
        Some(Region {
            base,
            len,
            local_bytes,
        })
    }

    /// Where this process mapped the region, and its length.
    pub fn mapping(&self) -> (usize, usize) {
        (self.base as usize, self.len)
    }

    /// Offset of record `index` (direction `index`'s header) in the region.
    pub fn record_offset(&self, index: usize) -> usize {
        (index & 1) * self.local_bytes
    }

    pub fn control(&self) -> &Control {
        // SAFETY: `base` is page-aligned (mmap) and the mapping, at least 2 * MIN_LOCAL_BYTES
        // long, holds a Control at offset 0 (within HEADER_BYTES, asserted) until `self` drops,
        // which outlives the borrow. The fields a peer writes after set-up are atomics.
        unsafe { &*self.base.cast::<Control>() }
    }

    /// Liveness by pid can be judged: both sides are in this process's pid namespace.
    pub fn same_pid_namespace(&self) -> bool {
        let ours = process::pid_namespace();
        self.control()
            .pid_namespace
            .iter()
            .all(|ns| ns.load(Ordering::Relaxed) == ours)
    }

    pub fn direction(&self, index: usize) -> Pipe<'_> {
        let index = index & 1;
        // SAFETY: `index` is 0 or 1 and the mapping is `2 * local_bytes` long, so record `index`
        // starts inside it at `index * local_bytes`, a multiple of 4096 (a power of two of at
        // least MIN_LOCAL_BYTES: checked at attach, validated in settings), which suits the
        // RecordHeader's 64-byte alignment; the header fits in HEADER_BYTES (asserted). It lives
        // as long as `&self`, like the returned Pipe.
        let header = unsafe {
            &*self
                .base
                .add(index * self.local_bytes)
                .cast::<RecordHeader>()
        };
        Pipe {
            control: &header.direction,
            // SAFETY: HEADER_BYTES < MIN_LOCAL_BYTES <= local_bytes, so the offset is inside
            // record `index`; the ring is the `capacity` bytes from there to the record's end.
            data: unsafe { self.base.add(index * self.local_bytes + HEADER_BYTES) },
            capacity: (self.local_bytes - HEADER_BYTES) as u64,
            token: self.control().token,
            robust: self.same_pid_namespace(),
        }
    }

    /// Registers this process as a holder of `side` (pid slot for crash detection).
    pub fn add_pid(&self, side: usize) {
        let me = process::pid();
        let control = self.control();
        let slots = &control.pids[side & 1];
        if slots.iter().any(|s| s.load(Ordering::Relaxed) == me) {
            return;
        }
        for slot in slots {
            let pid = slot.load(Ordering::Relaxed);
            if (pid == 0 || (self.same_pid_namespace() && !process::alive(pid)))
                && slot
                    .compare_exchange(pid, me, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            {
                return;
            }
        }
        control.pids_overflow[side & 1].store(1, Ordering::Relaxed);
    }

    /// This process no longer holds `side`.
    pub fn remove_pid(&self, side: usize) {
        let me = process::pid();
        for slot in &self.control().pids[side & 1] {
            let _ = slot.compare_exchange(me, 0, Ordering::AcqRel, Ordering::Relaxed);
        }
    }

    /// Whether some process may still hold `side`. "No" only when every recorded holder is
    /// known to be dead (same pid namespace, no slot overflow).
    pub fn side_may_live(&self, side: usize) -> bool {
        let control = self.control();
        if !self.same_pid_namespace()
            || control.pids_overflow[side & 1].load(Ordering::Relaxed) != 0
        {
            return true;
        }
        let pids: Vec<u32> = control.pids[side & 1]
            .iter()
            .map(|s| s.load(Ordering::Relaxed))
            .filter(|&p| p != 0)
            .collect();
        pids.is_empty() && control.holders[side & 1].load(Ordering::Relaxed) > 0
            || pids.iter().any(|&p| process::alive(p))
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: `base` and `len` are the mapping this Region made and owns; every borrow of
        // it (Pipe, &Control) borrows `self`, so none outlives this single unmap.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// One direction: the local record as a ring plus chained arena records.
pub struct Pipe<'a> {
    pub control: &'a Direction,
    data: *mut u8,
    capacity: u64,
    token: u64,
    /// Lock holders' pids can be judged (take over a dead holder's lock).
    robust: bool,
}

/// A pointer into a caller's buffer that can be advanced (`*const u8` for outgoing bytes,
/// `*mut u8` for incoming ones).
pub(crate) trait BytePointer: Copy {
    fn advanced(self, n: usize) -> Self;
}

impl BytePointer for *const u8 {
    fn advanced(self, n: usize) -> Self {
        self.wrapping_add(n)
    }
}

impl BytePointer for *mut u8 {
    fn advanced(self, n: usize) -> Self {
        self.wrapping_add(n)
    }
}

/// A scatter/gather list of (pointer, length) pairs, walked front to back: the bytes a
/// writer sends ([`Source`]) or the buffers a reader fills ([`Sink`]).
struct Chunks<'a, P> {
    chunks: &'a [(P, usize)],
    index: usize,
    offset: usize,
}

/// Outgoing bytes, consumed front to back.
type Source<'a> = Chunks<'a, *const u8>;
/// Incoming buffers, filled front to back.
type Sink<'a> = Chunks<'a, *mut u8>;

impl<'a, P: BytePointer> Chunks<'a, P> {
    fn new(chunks: &'a [(P, usize)]) -> Self {
        Chunks {
            chunks,
            index: 0,
            offset: 0,
        }
    }

    /// Some byte (or room for one) is left.
    fn remaining(&self) -> bool {
        self.chunks[self.index..]
            .iter()
            .enumerate()
            .any(|(i, c)| c.1 > if i == 0 { self.offset } else { 0 })
    }

    /// Hands up to `max` bytes to `copy(pointer, len)` calls; returns the count.
    fn take(&mut self, mut max: usize, mut copy: impl FnMut(P, usize)) -> usize {
        let mut total = 0;
        while max > 0 && self.index < self.chunks.len() {
            let (pointer, len) = self.chunks[self.index];
            let left = len - self.offset;
            if left == 0 {
                self.index += 1;
                self.offset = 0;
                continue;
            }
            let n = left.min(max);
            copy(pointer.advanced(self.offset), n);
            self.offset += n;
            total += n;
            max -= n;
        }
        total
    }
}

/// The connection's shared state is broken: a record that is not this connection's to read,
/// or a lock that a live peer never lets go of. The connection is then reset.
#[derive(Debug, PartialEq, Eq)]
pub struct Corrupt;

impl From<Stuck> for Corrupt {
    fn from(_: Stuck) -> Self {
        Corrupt
    }
}

impl Pipe<'_> {
    fn chain(&self) -> &ChainState {
        &self.control.chain.0
    }

    /// Bytes waiting to be read.
    pub fn readable(&self) -> u64 {
        let written = self.control.written.0.load(Ordering::Acquire);
        written.wrapping_sub(self.control.consumed.0.load(Ordering::Acquire))
    }

    /// Bytes a write could place right now without appending a new arena record (used for
    /// POLLOUT; a write itself may also append records).
    pub fn writable(&self) -> u64 {
        let chain = self.chain();
        let written = self.control.written.0.load(Ordering::Acquire);
        let consumed = self.control.consumed.0.load(Ordering::Acquire);
        if chain.mode.load(Ordering::Acquire) == MODE_RING {
            let ring_start = chain.ring_start.load(Ordering::Acquire);
            let used = written.saturating_sub(consumed.max(ring_start));
            return self.capacity.saturating_sub(used);
        }
        if consumed >= chain.ring_end.load(Ordering::Acquire) {
            return self.capacity;
        }
        let tail = RecordRef(chain.tail.load(Ordering::Acquire));
        arena::writer_view(tail, self.token).map_or(0, |record| {
            record
                .capacity
                .saturating_sub(record.descriptor.filled.load(Ordering::Relaxed) as u64)
        })
    }

    /// Whether a writer waiting for room may retry now: there is room in the ring or the tail
    /// record, or the reader has drained the pipe to [`Pipe::wake_threshold`]. The second half
    /// is the reader's own wake-up condition (`io::wake_writer`): a writer that arms its wake-up
    /// flag and then finds this false may sleep, because the reader, seeing the flag, will wake
    /// it once the condition holds. (Looking at `writable()` alone lost wake-ups: with the tail
    /// record full, a reader could drain the pipe below the threshold just before the writer
    /// armed, and the writer then slept although it could append records.)
    pub fn write_ready(&self) -> bool {
        self.writable() > 0 || self.readable() <= self.wake_threshold()
    }

    /// A writer that went to sleep on a full pipe is woken once no more than this is unread:
    /// half of what the direction can hold (like TCP's send-buffer low-water mark), so that
    /// each wake-up lets it move many messages instead of one.
    pub fn wake_threshold(&self) -> u64 {
        let arena = crate::settings::get().conn_records as u64 * arena::RECORD_BYTES as u64;
        (self.capacity + arena) / 2
    }

    pub fn written(&self) -> u64 {
        self.control.written.0.load(Ordering::Acquire)
    }

    pub fn consumed(&self) -> u64 {
        self.control.consumed.0.load(Ordering::Acquire)
    }

    /// Arena records this direction holds now.
    pub fn records_held(&self) -> u32 {
        let chain = self.chain();
        chain
            .linked
            .load(Ordering::Acquire)
            .wrapping_sub(chain.released.load(Ordering::Acquire))
    }

    fn copy_in(&self, position: u64, src: *const u8, len: usize) {
        debug_assert!(len as u64 <= self.capacity);
        let offset = (position % self.capacity) as usize;
        let first = len.min(self.capacity as usize - offset);
        // SAFETY: `offset < capacity` and `first <= capacity - offset`, so the first part stays
        // in the ring; the rest, `len - first`, goes to its start, and `len <= capacity`
        // (debug-asserted; `write` copies at most the free room). `src` is a caller chunk,
        // valid for `len` bytes (see `write`), and never inside the ring.
        unsafe {
            std::ptr::copy_nonoverlapping(src, self.data.add(offset), first);
            std::ptr::copy_nonoverlapping(src.add(first), self.data, len - first);
        }
    }

    fn copy_out(&self, position: u64, dst: *mut u8, len: usize) {
        debug_assert!(len as u64 <= self.capacity);
        let offset = (position % self.capacity) as usize;
        let first = len.min(self.capacity as usize - offset);
        // SAFETY: as in `copy_in`, with `dst` a caller buffer valid for `len` writable bytes;
        // `read` copies at most one ring run, and refuses a run longer than the ring.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data.add(offset), dst, first);
            std::ptr::copy_nonoverlapping(self.data, dst.add(first), len - first);
        }
    }

    /// Writer, ring full: append an arena record whose first byte is `start`. False when the
    /// direction, the process or the arena is at its limit, or the reader is gone.
    fn extend(&self, start: u64) -> Result<bool, Corrupt> {
        let chain = self.chain();
        let limit = crate::settings::get().conn_records;
        if self.records_held() >= limit || chain.reader_gone.load(Ordering::Acquire) != 0 {
            return Ok(false);
        }
        let Ok(reference) = arena::allocate(self.token, start) else {
            return Ok(false);
        };
        {
            let Ok(_guard) = SpinGuard::lock(&chain.lock, self.robust) else {
                arena::release(reference, self.token);
                return Err(Corrupt);
            };
            if chain.reader_gone.load(Ordering::Acquire) == 0 {
                let tail = RecordRef(chain.tail.load(Ordering::Acquire));
                match arena::writer_view(tail, self.token) {
                    Some(previous) => {
                        previous
                            .descriptor
                            .next
                            .store(reference.0, Ordering::Release);
                        previous.descriptor.sealed.store(1, Ordering::Release);
                    }
                    None => chain.head.store(reference.0, Ordering::Release),
                }
                chain.tail.store(reference.0, Ordering::Release);
                chain.linked.fetch_add(1, Ordering::AcqRel);
                if chain.mode.load(Ordering::Relaxed) == MODE_RING {
                    chain.ring_end.store(start, Ordering::Release);
                    chain.mode.store(MODE_CHAIN, Ordering::Release);
                }
                return Ok(true);
            }
        }
        arena::release(reference, self.token);
        Ok(false)
    }

    /// Writer: the ring has drained, so seal the chain's tail and go back to the ring.
    fn back_to_ring(&self, written: u64) -> Result<(), Stuck> {
        let chain = self.chain();
        {
            let _guard = SpinGuard::lock(&chain.lock, self.robust)?;
            let tail = RecordRef(chain.tail.load(Ordering::Acquire));
            if let Some(record) = arena::writer_view(tail, self.token) {
                record.descriptor.sealed.store(1, Ordering::Release);
            }
        }
        chain.ring_start.store(written, Ordering::Release);
        chain.mode.store(MODE_RING, Ordering::Release);
        Ok(())
    }

    /// Appends as much of `chunks` as fits; returns the byte count, or `Corrupt` when a lock
    /// stays held by a peer (see `lock::PATIENCE`) or the byte counter is near its end (no real
    /// stream reaches 2^64 bytes: a peer wrote it). Never makes a system call (except the
    /// one-time mapping or reservation of an arena record). Each `(pointer, length)` chunk must
    /// be valid for reads of `length` bytes (the interposers pass their caller's buffers, which
    /// libc's contract makes so).
    pub fn write(&self, chunks: &[(*const u8, usize)]) -> Result<usize, Corrupt> {
        let _guard = SpinGuard::lock(&self.control.write_lock.0, self.robust)?;
        let chain = self.chain();
        let mut source = Source::new(chunks);
        let start = self.control.written.0.load(Ordering::Relaxed);
        let mut written = start;
        let total: usize = chunks.iter().map(|c| c.1).sum();
        // Every position below stays within start + total.
        start.checked_add(total as u64).ok_or(Corrupt)?;
        // Bulk: into arena records while they can be had (see BULK_BYTES).
        let mut bulk = total >= BULK_BYTES && self.capacity < BULK_RING_LIMIT;
        while source.remaining() {
            let consumed = self.control.consumed.0.load(Ordering::Acquire);
            let mode = chain.mode.load(Ordering::Relaxed);
            let ring_drained = consumed >= chain.ring_end.load(Ordering::Relaxed);
            if mode == MODE_CHAIN && ring_drained && !bulk {
                self.back_to_ring(written)?;
                continue;
            }
            if mode == MODE_RING {
                if bulk {
                    if !self.extend(written)? {
                        bulk = false;
                    }
                    continue;
                }
                let ring_start = chain.ring_start.load(Ordering::Relaxed);
                let used = written - consumed.max(ring_start).min(written);
                let free = self.capacity.saturating_sub(used);
                if free > 0 {
                    let mut position = written;
                    let n = source.take(free as usize, |pointer, len| {
                        self.copy_in(position, pointer, len);
                        position += len as u64;
                    });
                    written += n as u64;
                    continue;
                }
                if !self.extend(written)? {
                    break;
                }
                continue;
            }
            let tail = RecordRef(chain.tail.load(Ordering::Acquire));
            let Some(record) = arena::writer_view(tail, self.token) else {
                // Our own tail is gone (the reader released everything at close).
                break;
            };
            let filled = record.descriptor.filled.load(Ordering::Relaxed) as u64;
            let room = record.capacity.saturating_sub(filled);
            if room > 0 {
                let mut at = filled;
                let n = source.take(room as usize, |pointer, len| {
                    // SAFETY: `take` hands out at most `room = capacity - filled` bytes in all,
                    // and `at` starts at `filled`, so `at + len <= capacity`: inside the record
                    // that `writer_view` validated as ours, which only this writer fills (under
                    // write_lock). `pointer` is a caller chunk, valid for `len` bytes.
                    unsafe {
                        std::ptr::copy_nonoverlapping(pointer, record.data.add(at as usize), len)
                    };
                    at += len as u64;
                });
                record
                    .descriptor
                    .filled
                    .store((filled + n as u64) as u32, Ordering::Release);
                written += n as u64;
                continue;
            }
            if self.extend(written)? {
                continue;
            }
            if bulk && ring_drained {
                // No record to be had, but the ring is free: use it.
                bulk = false;
                self.back_to_ring(written)?;
                continue;
            }
            break;
        }
        if written != start {
            self.control.written.0.store(written, Ordering::Release);
        }
        Ok((written - start) as usize)
    }

    /// Copies up to the buffers' size out; consumes it unless `peek`. Returns the byte count,
    /// or `Corrupt` when the chain names a record this connection may not read or a lock stays
    /// held by a peer. Each `(pointer, length)` buffer must be valid for writes of `length`
    /// bytes, as for [`Pipe::write`].
    pub fn read(&self, buffers: &[(*mut u8, usize)], peek: bool) -> Result<usize, Corrupt> {
        let _guard = SpinGuard::lock(&self.control.read_lock.0, self.robust)?;
        let chain = self.chain();
        let start = self.control.consumed.0.load(Ordering::Relaxed);
        let written = self.control.written.0.load(Ordering::Acquire);
        let mut sink = Sink::new(buffers);
        let mut position = start;
        let mut current = RecordRef(chain.head.load(Ordering::Acquire));
        let mut passed = 0usize;
        while position < written && sink.remaining() {
            let mut limit = written;
            if !current.is_none() {
                let record = arena::commit(current, self.token).ok_or(Corrupt)?;
                let first = record.descriptor.start.load(Ordering::Acquire);
                // Clamped: the peer could change it after `commit` looked.
                let filled =
                    (record.descriptor.filled.load(Ordering::Acquire) as u64).min(record.capacity);
                let end = first.checked_add(filled).ok_or(Corrupt)?;
                if position >= end {
                    // The writer has moved on (bytes past `end` exist): the next record or
                    // the ring holds them. A chain longer than any real one is a cycle.
                    if record.descriptor.sealed.load(Ordering::Acquire) == 0 || passed >= MAX_CHAIN
                    {
                        return Err(Corrupt);
                    }
                    current = RecordRef(record.descriptor.next.load(Ordering::Acquire));
                    passed += 1;
                    continue;
                }
                if position >= first {
                    let n = sink.take((end.min(written) - position) as usize, |pointer, len| {
                        // SAFETY: `first <= position < end = first + filled` and `take`
                        // hands out at most `end - position` bytes, so `position - first + len
                        // <= filled`, clamped to `capacity`: inside the record `commit`
                        // validated. `pointer` is a caller buffer, valid for `len` bytes.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                record.data.add((position - first) as usize),
                                pointer,
                                len,
                            )
                        };
                        position += len as u64;
                    });
                    if n == 0 {
                        break;
                    }
                    continue;
                }
                limit = limit.min(first);
            }
            // A ring run never holds more than the ring: a peer claiming so is corrupt (and
            // copying that much would read past the ring).
            if limit - position > self.capacity {
                return Err(Corrupt);
            }
            let n = sink.take((limit - position) as usize, |pointer, len| {
                self.copy_out(position, pointer, len);
                position += len as u64;
            });
            if n == 0 {
                break;
            }
        }
        if !peek && position != start {
            self.control.consumed.0.store(position, Ordering::Release);
            if passed > 0 {
                self.release_passed(passed)?;
            }
            if position == written && chain.mode.load(Ordering::Acquire) == MODE_CHAIN {
                self.reclaim_idle_tail();
            }
        }
        Ok((position - start) as usize)
    }

    /// Reader: give the first `count` records (fully consumed and sealed) back to their arena.
    fn release_passed(&self, count: usize) -> Result<(), Stuck> {
        let chain = self.chain();
        let _guard = SpinGuard::lock(&chain.lock, self.robust)?;
        for _ in 0..count {
            let head = RecordRef(chain.head.load(Ordering::Acquire));
            let Some(record) = arena::writer_view(head, self.token) else {
                return Ok(());
            };
            let next = record.descriptor.next.load(Ordering::Acquire);
            if chain.tail.load(Ordering::Acquire) == head.0 {
                chain.tail.store(0, Ordering::Release);
            }
            chain.head.store(next, Ordering::Release);
            if arena::release(head, self.token) {
                chain.released.fetch_add(1, Ordering::AcqRel);
            }
        }
        Ok(())
    }

    /// Reader, everything consumed while the writer is still in chain mode: if the writer is not
    /// inside write() now, end its chain run for it, so that an idle connection holds no arena
    /// record.
    fn reclaim_idle_tail(&self) {
        let Some(_writer) = SpinGuard::try_lock(&self.control.write_lock.0) else {
            return;
        };
        let chain = self.chain();
        let written = self.control.written.0.load(Ordering::Acquire);
        if chain.mode.load(Ordering::Acquire) != MODE_CHAIN
            || self.control.consumed.0.load(Ordering::Acquire) != written
        {
            return;
        }
        // A stuck lock here is left to the next read or write, which reports it.
        if self.back_to_ring(written).is_ok() {
            self.release_all_locked(false);
        }
    }

    /// Releases every record of the chain. `reader_gone`: also forbid appending more (the
    /// reading side has closed). Takes the writer's lock so that no write is inside a record.
    /// When a peer holds a lock past `lock::PATIENCE`, the records are left where they are:
    /// the connection is closing, and a stuck lock must not hang the close.
    pub fn release_all(&self, reader_gone: bool) {
        let Ok(_writer) = SpinGuard::lock(&self.control.write_lock.0, self.robust) else {
            return;
        };
        let chain = self.chain();
        if chain.mode.load(Ordering::Acquire) == MODE_CHAIN {
            let written = self.control.written.0.load(Ordering::Acquire);
            chain.ring_start.store(written, Ordering::Release);
            chain.mode.store(MODE_RING, Ordering::Release);
        }
        self.release_all_locked(reader_gone);
    }

    fn release_all_locked(&self, reader_gone: bool) {
        let chain = self.chain();
        let Ok(_guard) = SpinGuard::lock(&chain.lock, self.robust) else {
            return;
        };
        if reader_gone {
            chain.reader_gone.store(1, Ordering::Release);
        }
        let mut current = RecordRef(chain.head.load(Ordering::Acquire));
        // Bounded: a corrupt (cyclic) chain cannot hold us here.
        for _ in 0..=arena::MAX_RECORDS {
            if current.is_none() {
                break;
            }
            let next = arena::writer_view(current, self.token)
                .map_or(0, |r| r.descriptor.next.load(Ordering::Acquire));
            if arena::release(current, self.token) {
                chain.released.fetch_add(1, Ordering::AcqRel);
            }
            current = RecordRef(next);
        }
        chain.head.store(0, Ordering::Release);
        chain.tail.store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn temp_region(local: usize) -> Region {
        let path = std::ffi::CString::new(format!(
            "/dev/shm/flatmesh-shm-unit-{}-{local}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ))
        .unwrap();
        let region = Region::create(&path, local, 1).unwrap();
        // SAFETY: `path` is a CString, so NUL-terminated.
        unsafe { libc::unlink(path.as_ptr()) };
        region
    }

    fn write_all(pipe: &Pipe<'_>, data: &[u8]) -> usize {
        pipe.write(&[(data.as_ptr(), data.len())]).unwrap()
    }

    fn read_some(pipe: &Pipe<'_>, max: usize) -> Vec<u8> {
        let mut buf = vec![0u8; max];
        let n = pipe.read(&[(buf.as_mut_ptr(), buf.len())], false).unwrap();
        buf.truncate(n);
        buf
    }

    #[test]
    fn ring_wraps_and_preserves_order() {
        let region = temp_region(8192);
        let pipe = region.direction(0);
        let mut expected = Vec::new();
        let mut got = Vec::new();
        let mut next = 0u8;
        for round in 0..300 {
            let chunk: Vec<u8> = (0..(round * 37 % 5000 + 1))
                .map(|_| {
                    next = next.wrapping_add(1);
                    next
                })
                .collect();
            let n = write_all(&pipe, &chunk);
            expected.extend_from_slice(&chunk[..n]);
            got.extend(read_some(&pipe, round * 53 % 6000 + 1));
        }
        got.extend(read_some(&pipe, 1 << 22));
        assert_eq!(got, expected);
        assert_eq!(pipe.readable(), 0);
    }

    #[test]
    fn header_fits_and_records_are_page_aligned() {
        let region = temp_region(DEFAULT_LOCAL_BYTES);
        assert_eq!(region.len, 2 * DEFAULT_LOCAL_BYTES);
        assert_eq!(region.base as usize % 4096, 0);
        let pipe = region.direction(1);
        assert_eq!(
            pipe.data as usize - region.base as usize,
            DEFAULT_LOCAL_BYTES + HEADER_BYTES
        );
        assert_eq!(pipe.writable(), (DEFAULT_LOCAL_BYTES - HEADER_BYTES) as u64);
    }

    #[test]
    fn peek_does_not_consume() {
        let region = temp_region(8192);
        let pipe = region.direction(1);
        assert_eq!(write_all(&pipe, b"hello world"), 11);
        let mut buf = [0u8; 5];
        assert_eq!(pipe.read(&[(buf.as_mut_ptr(), 5)], true), Ok(5));
        assert_eq!(&buf, b"hello");
        assert_eq!(pipe.readable(), 11);
        let mut a = [0u8; 4];
        let mut b = [0u8; 20];
        assert_eq!(
            pipe.read(&[(a.as_mut_ptr(), 4), (b.as_mut_ptr(), 20)], false),
            Ok(11)
        );
        assert_eq!(&a, b"hell");
        assert_eq!(&b[..7], b"o world");
    }

    /// Overflow into arena records and back: order is kept, the ring is used again once
    /// drained, and every record goes back to its arena.
    #[test]
    fn overflow_chains_arena_records_and_returns_them() {
        let region = temp_region(DEFAULT_LOCAL_BYTES);
        let pipe = region.direction(0);
        let capacity = (DEFAULT_LOCAL_BYTES - HEADER_BYTES) as u64;
        let mut expected = Vec::new();
        let mut next = 0u32;
        let mut chunk = |len: usize| -> Vec<u8> {
            (0..len)
                .map(|_| {
                    next = next.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                    (next >> 16) as u8
                })
                .collect()
        };
        // 600 KiB without reading: the ring takes 63 KiB, the arena the rest.
        let burst = chunk(600 * 1024);
        assert_eq!(write_all(&pipe, &burst), burst.len());
        expected.extend_from_slice(&burst);
        assert_eq!(pipe.readable(), burst.len() as u64);
        assert!(pipe.records_held() >= 9, "held {}", pipe.records_held());
        assert_eq!(pipe.chain().mode.load(Ordering::Relaxed), MODE_CHAIN);
        // Read part of it in odd sizes, then write more: it goes back to the ring only after
        // the ring run has drained.
        let mut got = read_some(&pipe, 70_001);
        assert!(pipe.consumed() >= capacity);
        let more = chunk(1000);
        assert_eq!(write_all(&pipe, &more), more.len());
        assert_eq!(pipe.chain().mode.load(Ordering::Relaxed), MODE_RING);
        expected.extend_from_slice(&more);
        while got.len() < expected.len() {
            let part = read_some(&pipe, 33_333);
            assert!(!part.is_empty());
            got.extend(part);
        }
        assert_eq!(got, expected, "bytes out of order or lost");
        assert_eq!(pipe.records_held(), 0, "records not returned");
    }

    /// A writer that stops in chain mode must not keep an arena record once the reader has
    /// drained everything (1,000 idle connections would otherwise pin 1,000 records).
    #[test]
    fn an_idle_connection_holds_no_arena_record() {
        let region = temp_region(DEFAULT_LOCAL_BYTES);
        let pipe = region.direction(1);
        let data = vec![7u8; 100 * 1024];
        assert_eq!(write_all(&pipe, &data), data.len());
        assert!(pipe.records_held() > 0);
        assert_eq!(read_some(&pipe, 200 * 1024).len(), data.len());
        assert_eq!(pipe.records_held(), 0);
        assert_eq!(pipe.chain().mode.load(Ordering::Relaxed), MODE_RING);
        // And the pipe keeps working.
        assert_eq!(write_all(&pipe, b"again"), 5);
        assert_eq!(read_some(&pipe, 10), b"again");
    }

    #[test]
    fn a_direction_holds_at_most_its_record_limit() {
        let region = temp_region(DEFAULT_LOCAL_BYTES);
        let pipe = region.direction(0);
        let limit = crate::settings::get().conn_records;
        let data = vec![1u8; (limit as usize + 8) * arena::RECORD_BYTES];
        let n = write_all(&pipe, &data);
        assert!(n < data.len(), "the writer must stop at the limit");
        assert_eq!(pipe.records_held(), limit);
        assert_eq!(pipe.writable(), 0);
        assert_eq!(read_some(&pipe, data.len()).len(), n);
        assert_eq!(pipe.records_held(), 0);
    }

    /// The lost wake-up behind "a blocking writer sometimes fails or stalls after its reader
    /// half-closed while the pipe was full": the writer found the pipe full, the reader then
    /// drained it to the low-water mark (its condition for waking a writer) while the writer
    /// had not yet armed its flag, so no wake-up was sent; the writer armed, looked at
    /// `writable()`, which is 0 while the ring is full although records can be appended again,
    /// and slept for good. The writer's last look must use the reader's condition.
    #[test]
    fn a_writer_arming_after_the_reader_drained_to_the_low_water_mark_does_not_sleep() {
        let region = temp_region(DEFAULT_LOCAL_BYTES);
        let pipe = region.direction(0);
        let limit = crate::settings::get().conn_records as usize;
        let data = vec![5u8; (limit + 8) * arena::RECORD_BYTES];
        let n = write_all(&pipe, &data);
        assert!(n < data.len(), "the pipe must fill up");
        assert_eq!(write_all(&pipe, &data[..100]), 0);
        assert!(!pipe.write_ready(), "a full pipe is not ready");
        let mut got = 0;
        while pipe.readable() > pipe.wake_threshold() {
            got += read_some(&pipe, 16 * 1024).len();
        }
        assert_eq!(pipe.writable(), 0, "no room without appending a record");
        assert!(
            pipe.write_ready(),
            "the reader's wake-up condition holds: the writer must not sleep"
        );
        assert!(
            write_all(&pipe, &data[..1000]) > 0,
            "a write does go through"
        );
        while pipe.readable() > 0 {
            got += read_some(&pipe, 1 << 20).len();
        }
        assert!(got > n);
        assert_eq!(pipe.records_held(), 0);
    }

    /// A write of 32 KiB or more goes to arena records, not through the 63 KiB ring (which the
    /// reader's CPU has just read); small ones keep using the ring. Order is kept across both.
    #[test]
    fn bulk_writes_go_to_arena_records_and_small_ones_to_the_ring() {
        let region = temp_region(DEFAULT_LOCAL_BYTES);
        let pipe = region.direction(1);
        let mut expected = Vec::new();
        let small: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        assert_eq!(write_all(&pipe, &small), small.len());
        expected.extend_from_slice(&small);
        assert_eq!(pipe.chain().mode.load(Ordering::Relaxed), MODE_RING);
        let bulk: Vec<u8> = (0..64 * 1024u32).map(|i| (i * 7) as u8).collect();
        assert_eq!(write_all(&pipe, &bulk), bulk.len());
        expected.extend_from_slice(&bulk);
        assert_eq!(pipe.chain().mode.load(Ordering::Relaxed), MODE_CHAIN);
        assert_eq!(pipe.records_held(), 1, "64 KiB fill exactly one record");
        let got = read_some(&pipe, 1 << 20);
        assert_eq!(got, expected);
        // Drained: the next small write goes back to the ring.
        assert_eq!(write_all(&pipe, &small), small.len());
        assert_eq!(pipe.chain().mode.load(Ordering::Relaxed), MODE_RING);
        assert_eq!(read_some(&pipe, 1 << 20), small);
        assert_eq!(pipe.records_held(), 0);
    }

    /// A peer that sets a lock word to a live pid and never clears it (ours, here: alive, and
    /// not a holder to take over) makes reads and writes give up after `lock::PATIENCE` with
    /// `Corrupt` (the connection is reset), and the close not hang.
    #[test]
    fn a_lock_a_live_peer_never_releases_ends_in_corrupt_not_a_hang() {
        let region = temp_region(DEFAULT_LOCAL_BYTES);
        let pipe = region.direction(0);
        assert_eq!(write_all(&pipe, b"before"), 6);
        let me = process::pid();
        let mut buf = [0u8; 16];
        pipe.control.read_lock.0.store(me, Ordering::Relaxed);
        let started = std::time::Instant::now();
        assert_eq!(pipe.read(&[(buf.as_mut_ptr(), 16)], false), Err(Corrupt));
        pipe.control.write_lock.0.store(me, Ordering::Relaxed);
        assert_eq!(pipe.write(&[(b"x".as_ptr(), 1)]), Err(Corrupt));
        pipe.release_all(true);
        let waited = started.elapsed();
        assert!(waited >= crate::lock::PATIENCE * 2, "{waited:?}");
        assert!(waited < crate::lock::PATIENCE * 3 + std::time::Duration::from_secs(5), "{waited:?}");
        // Once the word is cleared, the connection works again: nothing was left half-done.
        pipe.control.read_lock.0.store(0, Ordering::Relaxed);
        pipe.control.write_lock.0.store(0, Ordering::Relaxed);
        assert_eq!(read_some(&pipe, 16), b"before");
    }

    /// The commit step refuses a record that is not this connection's: another connection's
    /// token, a free record, a reference outside any arena.
    #[test]
    fn commit_refuses_records_of_other_connections() {
        let region = temp_region(DEFAULT_LOCAL_BYTES);
        let pipe = region.direction(0);
        let data = vec![3u8; 200 * 1024];
        assert_eq!(write_all(&pipe, &data), data.len());
        let head = RecordRef(pipe.chain().head.load(Ordering::Relaxed));
        let record = arena::writer_view(head, pipe.token).unwrap();
        // Drain the ring part so that the next read reaches the record.
        let ring_part = DEFAULT_LOCAL_BYTES - HEADER_BYTES;
        assert_eq!(read_some(&pipe, ring_part).len(), ring_part);

        record
            .descriptor
            .owner
            .store(pipe.token ^ 1, Ordering::Relaxed);
        let mut buf = [0u8; 16];
        assert_eq!(pipe.read(&[(buf.as_mut_ptr(), 16)], false), Err(Corrupt));
        record.descriptor.owner.store(pipe.token, Ordering::Relaxed);

        pipe.chain().head.store(u32::MAX, Ordering::Relaxed);
        assert_eq!(pipe.read(&[(buf.as_mut_ptr(), 16)], false), Err(Corrupt));
        pipe.chain().head.store(head.0, Ordering::Relaxed);

        assert_eq!(pipe.read(&[(buf.as_mut_ptr(), 16)], false), Ok(16));
        assert_eq!(
            record.descriptor.state.load(Ordering::Relaxed),
            arena::COMMITTED
        );
        // A record whose owner's token does not match cannot be released either.
        assert!(!arena::release(head, pipe.token ^ 1));
        pipe.release_all(true);
        assert_eq!(pipe.records_held(), 0);
        assert_eq!(record.descriptor.state.load(Ordering::Relaxed), arena::FREE);
        // The reader is gone: nothing more is appended (the ring still takes bytes).
        assert!(write_all(&pipe, &data) < data.len());
        assert_eq!(pipe.records_held(), 0);
    }

    /// A writer thread and a reader thread race through ring and chain with random sizes:
    /// every byte arrives once and in order.
    #[test]
    fn concurrent_writer_and_reader_keep_the_stream_intact() {
        let region: &'static Region = Box::leak(Box::new(temp_region(16 * 1024)));
        const TOTAL: usize = 24 << 20;
        fn byte(i: usize) -> u8 {
            (i.wrapping_mul(2_654_435_761) >> 13) as u8
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let writer = std::thread::spawn(move || {
            let pipe = region.direction(0);
            let mut sent = 0usize;
            let mut size = 1usize;
            while sent < TOTAL {
                assert!(std::time::Instant::now() < deadline, "writer stuck");
                size = (size * 7 + 13) % 200_000 + 1;
                let chunk: Vec<u8> = (sent..(sent + size).min(TOTAL)).map(byte).collect();
                let mut off = 0;
                while off < chunk.len() {
                    assert!(std::time::Instant::now() < deadline, "writer stuck");
                    let n = pipe
                        .write(&[(chunk[off..].as_ptr(), chunk.len() - off)])
                        .unwrap();
                    if n == 0 {
                        std::thread::yield_now();
                    }
                    off += n;
                }
                sent += chunk.len();
            }
        });
        let pipe = region.direction(0);
        let mut received = 0usize;
        let mut size = 5usize;
        let mut buf = vec![0u8; 300_000];
        while received < TOTAL {
            assert!(
                std::time::Instant::now() < deadline,
                "reader stuck at {received}"
            );
            size = (size * 11 + 7) % 300_000 + 1;
            let n = pipe.read(&[(buf.as_mut_ptr(), size)], false).unwrap();
            if n == 0 {
                std::thread::yield_now();
            }
            for (i, &b) in buf[..n].iter().enumerate() {
                assert_eq!(b, byte(received + i), "mismatch at offset {}", received + i);
            }
            received += n;
        }
        writer.join().unwrap();
        assert_eq!(pipe.readable(), 0);
        assert_eq!(pipe.records_held(), 0);
    }

    /// A peer that links a record to itself must not hang the reader.
    #[test]
    fn a_cyclic_chain_is_refused_not_followed_forever() {
        let region = temp_region(DEFAULT_LOCAL_BYTES);
        let pipe = region.direction(0);
        // Small writes: the ring first, then one record.
        for chunk in vec![9u8; 100 * 1024].chunks(16 * 1024) {
            assert_eq!(write_all(&pipe, chunk), chunk.len());
        }
        assert_eq!(pipe.records_held(), 1);
        let head = RecordRef(pipe.chain().head.load(Ordering::Relaxed));
        let record = arena::writer_view(head, pipe.token).unwrap();
        // An empty, sealed record that points at itself, while more bytes are announced.
        record.descriptor.filled.store(0, Ordering::Relaxed);
        record.descriptor.sealed.store(1, Ordering::Relaxed);
        record.descriptor.next.store(head.0, Ordering::Relaxed);
        let capacity = (DEFAULT_LOCAL_BYTES - HEADER_BYTES) as u64;
        record.descriptor.start.store(0, Ordering::Relaxed);
        pipe.control.consumed.0.store(capacity, Ordering::Relaxed);
        let mut buf = [0u8; 16];
        let started = std::time::Instant::now();
        assert_eq!(pipe.read(&[(buf.as_mut_ptr(), 16)], false), Err(Corrupt));
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        record.descriptor.next.store(0, Ordering::Relaxed);
        pipe.release_all(true);
        assert_eq!(pipe.records_held(), 0);
    }

    /// Found by the fuzzer: a peer that claims to have written far more than the ring holds
    /// must not make the reader copy past the ring (it used to); the read is refused.
    #[test]
    fn a_peer_claiming_more_than_the_ring_holds_is_refused() {
        let region = temp_region(8192);
        let pipe = region.direction(1);
        let capacity = (8192 - HEADER_BYTES) as u64;
        pipe.control.written.0.store(142_956, Ordering::Relaxed);
        let mut buf = vec![0u8; 200_000];
        assert_eq!(
            pipe.read(&[(buf.as_mut_ptr(), buf.len())], true),
            Err(Corrupt)
        );
        // Exactly a full ring is legitimate.
        pipe.control.written.0.store(capacity, Ordering::Relaxed);
        assert_eq!(
            pipe.read(&[(buf.as_mut_ptr(), buf.len())], false),
            Ok(capacity as usize)
        );
    }

    #[test]
    fn attach_rejects_foreign_files() {
        let path = std::ffi::CString::new(format!(
            "/dev/shm/flatmesh-shm-unit-bad-{}",
            std::process::id()
        ))
        .unwrap();
        std::fs::write(path.to_str().unwrap(), vec![0u8; 2 * MIN_LOCAL_BYTES]).unwrap();
        // SAFETY: `path` is a CString, so NUL-terminated.
        let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR) };
        assert!(Region::attach(fd).is_none());
        // SAFETY: `fd` was opened above and is closed once; `path` is NUL-terminated.
        unsafe { libc::close(fd) };
        // SAFETY: `path` is still a NUL-terminated CString.
        unsafe { libc::unlink(path.as_ptr()) };
    }

    #[test]
    fn own_side_is_alive_and_a_dead_side_is_not() {
        let region = temp_region(8192);
        region.add_pid(0);
        assert!(region.side_may_live(0));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        region.control().pid_namespace[1].store(process::pid_namespace(), Ordering::Relaxed);
        region.control().holders[1].store(1, Ordering::Relaxed);
        region.control().pids[1][0].store(dead, Ordering::Relaxed);
        assert!(!region.side_may_live(1));
        region.control().pids_overflow[1].store(1, Ordering::Relaxed);
        assert!(region.side_may_live(1), "overflowed pid slots mean unknown");
    }
}
