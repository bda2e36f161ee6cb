//! Per-core shared arenas (HeteroNet §4.2.3): pools of page-aligned records that a sender
//! appends to a connection when the connection's local record is full.
//!
//! One arena per (user, core): the file `/dev/shm/flatmesh-shm-arena-v1-<uid>-<core>` (mode
//! 0600), created by the first process that needs it and shared by every preloaded process of
//! that user. It holds a header (geometry, the free list, per-process usage slots), one
//! descriptor per record (the record's metadata: state, owner, `next`, stream offset, fill)
//! and the records themselves.
//!
//! The life of a record, as in the paper's Fig. 5:
//! 1. **Speculative allocation** ([`allocate`]): a sender pops a free record from the arena of
//!    the core it runs on (`sched_getcpu`, no system call) with one compare-and-swap, stamps it
//!    with the connection's token and links it behind the connection's chain. No system call,
//!    no helper, no peer involved.
//! 2. **Commit** ([`commit`]): the receiver, the first time it reaches a record, validates it:
//!    the reference is inside an arena it may map, the record is owned by *this* connection's
//!    token, it is speculative (not free, not someone else's), its fill is in bounds, and the
//!    allocating process is within its record limit. Only then does it flip the record to
//!    committed and read it. In the paper the kernel commits (on a context switch or on the
//!    receiver's page fault); here the receiving peer does, at the same moment the paper's
//!    receiver would fault: its first access. Mapping an arena the process has not mapped yet
//!    happens here too, like the paper's fault-time remap.
//! 3. **Release** ([`release`]): the reader frees a record it has consumed (or the last closer
//!    frees what is left), checking the owner token again; the record returns to its arena.
//!
//! Governance: every process has a usage slot in each arena (pid + records held). A sender
//! stops appending records when its total reaches `FLATMESH_SHM_PROCESS_RECORDS` (it then waits
//! for its reader, as with a full TCP buffer), and a receiver refuses to commit a record from a
//! process whose usage exceeds the limit recorded in the arena header.

use crate::lock::SpinGuard;
use crate::process;
use crate::real::{self, errno};
use crate::region::CacheLine;
use crate::settings;
use crate::stats;
use parking_lot::Mutex;
use std::ffi::CString;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};

const MAGIC: u64 = 0x316e_7261_7461_6c66; // "flatarn1"
/// Bumped by hand when the arena's meaning changes; [`LAYOUT_HASH`] catches layout changes too.
pub const VERSION: u32 = 2;
/// Size of an arena record (page-aligned; its metadata lives in its descriptor).
pub const RECORD_BYTES: usize = 64 * 1024;
/// Arenas a process can address (one per core).
pub const MAX_ARENAS: usize = 1024;
const INDEX_BITS: u32 = 20;
const INDEX_MASK: u32 = (1 << INDEX_BITS) - 1;
/// Records per arena, exclusive bound (the index part of a [`RecordRef`]).
pub const MAX_RECORDS: u32 = 1 << INDEX_BITS;
/// Usage slots (processes) per arena.
pub const SLOTS: usize = 256;
/// Released records wait in a per-arena FIFO (up to this many) before they are handed out
/// again, so that a writer does not rewrite memory the reader's CPU has just read.
///
/// Why: taking such cache lines back from the other CPU costs more than the copy itself. How
/// far back a record must have been released depends on where the two CPUs sit, which a VM
/// cannot see: measured on the 2-vCPU test VM with a pipe of 64 KiB slots, when the vCPUs
/// share an L3, 1-4 slots in rotation move ~50 Gbit/s, 32-128 slots (2-8 MiB) ~280, 512 (32
/// MiB, out of every cache) ~75; when the hypervisor puts them on different L3s, 32-128 slots
/// fall to 30-50 and 512 give ~75. So a writer takes a record released [`SHALLOW`] releases
/// ago (3 MiB) or one released [`COOLING`] ago (32 MiB), whichever its copies measure faster
/// (see [`Tuner`]). The free list alone is a stack: the record released last would come back
/// first.
pub const COOLING: usize = 512;
/// The shallow reuse distance, in records.
pub const SHALLOW: usize = 48;
/// Tries at the cooling FIFO's lock before a caller goes around it.
const COOLING_LOCK_ATTEMPTS: u32 = 2000;
const PAGE: usize = 4096;
const DESCRIPTORS_OFFSET: usize = 2 * PAGE;

/// Record states.
pub const FREE: u32 = 0;
pub const SPECULATIVE: u32 = 1;
pub const COMMITTED: u32 = 2;

/// A record's name in shared memory: arena id and index. 0 is "none".
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct RecordRef(pub u32);

impl RecordRef {
    pub fn new(arena: usize, index: u32) -> RecordRef {
        debug_assert!(arena < MAX_ARENAS && index < MAX_RECORDS);
        RecordRef(((arena as u32 + 1) << INDEX_BITS) | index)
    }

    pub fn is_none(self) -> bool {
        self.0 == 0
    }

    /// The arena id, if the reference names one this process can address.
    pub fn arena(self) -> Option<usize> {
        let id = ((self.0 >> INDEX_BITS) as usize).checked_sub(1)?;
        (id < MAX_ARENAS).then_some(id)
    }

    pub fn index(self) -> u32 {
        self.0 & INDEX_MASK
    }
}

#[repr(C)]
pub struct Slot {
    pub pid: AtomicU32,
    pub records: AtomicU32,
}

#[repr(C)]
struct Header {
    magic: u64,
    version: u32,
    core: u32,
    record_bytes: u32,
    record_count: u32,
    process_limit: u32,
    _reserved: u32,
    records_offset: u64,
    total_bytes: u64,
    /// Free list head: (ABA tag << 32) | (index + 1); index part 0 = empty.
    free_head: CacheLine<AtomicU64>,
    free_count: CacheLine<AtomicU32>,
    /// Claiming a usage slot (rare) is serialised by this lock.
    slot_lock: CacheLine<AtomicU32>,
    slots: [Slot; SLOTS],
    /// Released records on their way back to the free list (see [`COOLING`]).
    cooling: CacheLine<Cooling>,
}

/// A FIFO of released record indexes, under `lock` (one lock operation per 64 KiB record
/// released, held for a few stores). Its records are free (state FREE, no owner) but not yet in
/// the free list; an allocation takes from it only when the free list is empty. The FIFO is
/// only an optimisation, so the lock is never waited for long: whoever cannot take it at once
/// skips the FIFO (a released record goes straight to the free list), and a lock word left
/// set by a crashed or misbehaving process costs speed, never a hang.
#[repr(C)]
struct Cooling {
    lock: AtomicU32,
    /// Index in `ring` of the oldest entry, and the number of entries.
    first: AtomicU32,
    len: AtomicU32,
    ring: [AtomicU32; COOLING],
}

impl Cooling {
    /// (index in `ring` of the oldest entry, number of entries), clamped: a peer may have
    /// scribbled on the header. Under `lock`.
    fn span(&self) -> (usize, usize) {
        (
            self.first.load(Ordering::Relaxed) as usize % COOLING,
            (self.len.load(Ordering::Relaxed) as usize).min(COOLING),
        )
    }

    /// Removes the entry `at` places after the oldest (`at < len`), from the FIFO `span()`
    /// gave: the oldest takes its slot, and the FIFO starts one later. Under `lock`.
    fn take(&self, first: usize, len: usize, at: usize) -> u32 {
        let oldest = self.ring[first].load(Ordering::Relaxed);
        let taken = self.ring[(first + at) % COOLING].swap(oldest, Ordering::Relaxed);
        self.first
            .store(((first + 1) % COOLING) as u32, Ordering::Relaxed);
        self.len.store(len as u32 - 1, Ordering::Relaxed);
        taken
    }
}

const _: () = assert!(std::mem::size_of::<Header>() <= DESCRIPTORS_OFFSET);

/// A hash of everything that fixes the arena file's layout, part of the file name: two builds
/// whose layouts differ never map each other's arenas (arenas outlive processes and are shared
/// by every preloaded program of a user, so an older build may still be running).
pub const LAYOUT_HASH: u32 = {
    let words: [u64; 12] = [
        MAGIC,
        VERSION as u64,
        RECORD_BYTES as u64,
        SLOTS as u64,
        COOLING as u64,
        INDEX_BITS as u64,
        DESCRIPTORS_OFFSET as u64,
        std::mem::size_of::<Header>() as u64,
        std::mem::offset_of!(Header, free_head) as u64,
        std::mem::offset_of!(Header, cooling) as u64,
        std::mem::size_of::<Descriptor>() as u64,
        std::mem::offset_of!(Descriptor, populated) as u64,
    ];
    // FNV-1a over the words' bytes.
    let mut hash: u32 = 0x811c_9dc5;
    let mut i = 0;
    while i < words.len() {
        let mut byte = 0;
        while byte < 8 {
            hash ^= ((words[i] >> (byte * 8)) & 0xff) as u32;
            hash = hash.wrapping_mul(0x0100_0193);
            byte += 1;
        }
        i += 1;
    }
    hash
};

/// A record's metadata (the paper's `nextRecord` and friends), one cache line.
#[repr(C, align(64))]
pub struct Descriptor {
    pub state: AtomicU32,
    /// The allocating process's usage slot.
    pub slot: AtomicU32,
    pub next_free: AtomicU32,
    /// The next record of the connection's chain ([`RecordRef`]).
    pub next: AtomicU32,
    /// The connection token of the owning connection.
    pub owner: AtomicU64,
    /// Stream offset of the record's first byte.
    pub start: AtomicU64,
    /// Bytes written into the record (only the writer stores).
    pub filled: AtomicU32,
    /// The writer has moved on: `filled` is final.
    pub sealed: AtomicU32,
    /// The record's pages were reserved (MADV_POPULATE_WRITE) once.
    pub populated: AtomicU32,
}

const _: () = assert!(std::mem::size_of::<Descriptor>() == 64);

/// Where the records start and how large the file is, for a geometry.
pub fn geometry(record_bytes: usize, record_count: u32) -> (usize, usize) {
    let descriptors = record_count as usize * std::mem::size_of::<Descriptor>();
    let records_offset = (DESCRIPTORS_OFFSET + descriptors).div_ceil(PAGE) * PAGE;
    (
        records_offset,
        records_offset + record_count as usize * record_bytes,
    )
}

/// One mapped arena. Mapped once per process and kept for the process's lifetime.
pub struct Arena {
    base: *mut u8,
    len: usize,
    pub id: usize,
    pub record_bytes: usize,
    pub record_count: u32,
    records_offset: usize,
}

// SAFETY: an Arena owns its mapping (base and length); nothing in it is tied to a thread.
unsafe impl Send for Arena {}
// SAFETY: through `&Arena` the mapping is reached through atomics (header words, descriptors,
// usage slots, the cooling FIFO under its lock) and record bytes, which only the record's
// writer fills and its reader reads below the published `filled`.
unsafe impl Sync for Arena {}

impl Arena {
    fn header(&self) -> &Header {
        // SAFETY: `base` is page-aligned (mmap) and the mapping holds a Header at offset 0:
        // `map_validated` maps at least DESCRIPTORS_OFFSET >= size_of::<Header>() bytes
        // (asserted), `anonymous` a whole geometry. It stays mapped while `self` lives.
        unsafe { &*self.base.cast::<Header>() }
    }

    pub fn descriptor(&self, index: u32) -> Option<&Descriptor> {
        if index >= self.record_count {
            return None;
        }
        // SAFETY: `index < record_count`, and the geometry (checked against the file's length
        // by `valid`, or made by `anonymous`) puts `record_count` 64-byte descriptors from
        // DESCRIPTORS_OFFSET (page-aligned) up to `records_offset <= len`: in bounds, aligned.
        Some(unsafe {
            &*self
                .base
                .add(DESCRIPTORS_OFFSET + index as usize * std::mem::size_of::<Descriptor>())
                .cast::<Descriptor>()
        })
    }

    /// The bytes of a record (`record_bytes` long).
    pub fn record(&self, index: u32) -> *mut u8 {
        debug_assert!(index < self.record_count);
        // SAFETY: callers pass `index < record_count` (`allocate` and `lookup` got
        // `descriptor(index)` first, which checks it; debug-asserted), and `records_offset +
        // record_count * record_bytes == len` (`valid`, or `anonymous`'s geometry): the
        // record lies inside the mapping.
        unsafe {
            self.base
                .add(self.records_offset + index as usize * self.record_bytes)
        }
    }

    pub fn free_records(&self) -> u32 {
        self.header().free_count.0.load(Ordering::Relaxed)
    }

    pub fn process_limit(&self) -> u32 {
        self.header().process_limit
    }

    fn pop(&self) -> Option<u32> {
        let head = &self.header().free_head.0;
        let mut current = head.load(Ordering::Acquire);
        loop {
            let index = (current as u32).checked_sub(1)?;
            let next = self.descriptor(index)?.next_free.load(Ordering::Acquire);
            if next > self.record_count {
                return None; // corrupt free list: treat as exhausted
            }
            let tag = (current >> 32).wrapping_add(1);
            match head.compare_exchange_weak(
                current,
                (tag << 32) | next as u64,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.header().free_count.0.fetch_sub(1, Ordering::Relaxed);
                    return Some(index);
                }
                Err(seen) => current = seen,
            }
        }
    }

    fn push(&self, index: u32) {
        let Some(descriptor) = self.descriptor(index) else {
            return;
        };
        let head = &self.header().free_head.0;
        let mut current = head.load(Ordering::Acquire);
        loop {
            descriptor
                .next_free
                .store(current as u32, Ordering::Release);
            let tag = (current >> 32).wrapping_add(1);
            match head.compare_exchange_weak(
                current,
                (tag << 32) | (index as u64 + 1),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.header().free_count.0.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                Err(seen) => current = seen,
            }
        }
    }

    /// Puts a released record at the back of the cooling FIFO; the oldest one, if the FIFO is
    /// full, goes to the free list.
    fn retire(&self, index: u32) {
        let cooling = &self.header().cooling.0;
        let evicted = {
            let Some(_guard) = SpinGuard::lock_briefly(&cooling.lock, COOLING_LOCK_ATTEMPTS) else {
                self.push(index);
                return;
            };
            let (first, len) = cooling.span();
            let evicted = (len == COOLING).then(|| cooling.take(first, len, 0));
            let (first, len) = cooling.span();
            cooling.ring[(first + len) % COOLING].store(index, Ordering::Relaxed);
            cooling.len.store(len as u32 + 1, Ordering::Relaxed);
            evicted
        };
        if let Some(oldest) = evicted {
            self.push(oldest);
        }
    }

    /// A record from the cooling FIFO at the writer's reuse distance: with `deep`, the oldest
    /// once the FIFO is full (until then `None`: the free list's records are colder still);
    /// otherwise the one released `SHALLOW` releases ago (its slot takes the oldest, which
    /// stays cooling). `None` when the FIFO is not that long yet.
    fn take_cooled(&self, deep: bool) -> Option<u32> {
        let cooling = &self.header().cooling.0;
        let _guard = SpinGuard::lock_briefly(&cooling.lock, COOLING_LOCK_ATTEMPTS)?;
        let (first, len) = cooling.span();
        let back = if deep {
            (len == COOLING).then_some(0)?
        } else {
            (len > SHALLOW).then(|| len - SHALLOW)?
        };
        Some(cooling.take(first, len, back))
    }

    /// The oldest record of the cooling FIFO (when the free list is empty).
    fn pop_cooling(&self) -> Option<u32> {
        let cooling = &self.header().cooling.0;
        let _guard = SpinGuard::lock_briefly(&cooling.lock, COOLING_LOCK_ATTEMPTS)?;
        let (first, len) = cooling.span();
        (len > 0).then(|| cooling.take(first, len, 0))
    }

    /// Records an allocation can have: the free list and the cooling FIFO (saturating: a peer
    /// may have scribbled on the free count).
    pub fn available_records(&self) -> u32 {
        self.free_records().saturating_add(self.cooling_records())
    }

    /// Records waiting in the cooling FIFO.
    pub fn cooling_records(&self) -> u32 {
        (self.header().cooling.0.len.load(Ordering::Relaxed) as usize).min(COOLING) as u32
    }

    /// This process's usage slot, claimed on first use. `None` when all slots are taken by
    /// live processes, or the slot lock is stuck (`lock::PATIENCE`).
    fn my_slot(&self) -> Option<usize> {
        let cached = MY_SLOT[self.id].load(Ordering::Relaxed);
        if cached != 0 {
            return Some(cached as usize - 1);
        }
        let me = process::pid();
        let slots = &self.header().slots;
        // A stuck arena-wide lock: use no record of this arena (the caller tries the next).
        let _guard = SpinGuard::lock(&self.header().slot_lock.0, true).ok()?;
        let found = slots
            .iter()
            .position(|s| s.pid.load(Ordering::Relaxed) == me)
            .or_else(|| {
                slots.iter().position(|s| {
                    let pid = s.pid.load(Ordering::Relaxed);
                    pid == 0 || (s.records.load(Ordering::Relaxed) == 0 && !process::alive(pid))
                })
            })?;
        slots[found].pid.store(me, Ordering::Relaxed);
        MY_SLOT[self.id].store(found as u32 + 1, Ordering::Relaxed);
        Some(found)
    }

    /// Records the slot's process holds in this arena.
    fn slot_usage(&self, slot: usize) -> u32 {
        self.header()
            .slots
            .get(slot)
            .map_or(0, |s| s.records.load(Ordering::Relaxed))
    }

    fn valid(&self, core: usize, file_len: usize) -> bool {
        let header = self.header();
        let record_bytes = header.record_bytes as usize;
        let count = header.record_count;
        if header.magic != MAGIC
            || header.version != VERSION
            || header.core as usize != core
            || record_bytes == 0
            || !record_bytes.is_multiple_of(PAGE)
            || record_bytes > 64 << 20
            || count == 0
            || count >= MAX_RECORDS
        {
            return false;
        }
        let (records_offset, total) = geometry(record_bytes, count);
        records_offset as u64 == header.records_offset
            && total as u64 == header.total_bytes
            && total == file_len
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: `base` and `len` are the mapping this Arena made and owns. Arenas in use are
        // leaked (`open`, the fuzzer's `install`) and never dropped, so what is unmapped here is
        // one that failed validation or a test's private arena that nothing borrows any more.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

static MAPPED: [AtomicPtr<Arena>; MAX_ARENAS] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; MAX_ARENAS];
/// This process's usage slot in each arena, plus one (0: none claimed yet).
static MY_SLOT: [AtomicU32; MAX_ARENAS] = [const { AtomicU32::new(0) }; MAX_ARENAS];
/// Arenas this process could not create or map (not retried for allocation).
static BROKEN: [AtomicBool; MAX_ARENAS] = [const { AtomicBool::new(false) }; MAX_ARENAS];
static MAP_LOCK: Mutex<()> = Mutex::new(());

/// `arena_count()`, computed once (0: not yet).
static ARENA_COUNT: AtomicUsize = AtomicUsize::new(0);

/// Number of per-core arenas: the configured CPUs. Computed once: glibc's
/// `sysconf(_SC_NPROCESSORS_CONF)` opens and reads sysfs, three system calls, and the data path
/// (every record allocation) asks for it.
pub fn arena_count() -> usize {
    let known = ARENA_COUNT.load(Ordering::Relaxed);
    if known != 0 {
        return known;
    }
    // SAFETY: sysconf has no preconditions.
    let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) };
    let count = (cpus.max(1) as usize).min(MAX_ARENAS);
    ARENA_COUNT.store(count, Ordering::Relaxed);
    count
}

fn path(id: usize) -> Option<CString> {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    CString::new(format!(
        "/dev/shm/flatmesh-shm-arena-v{VERSION}-{LAYOUT_HASH:08x}-{uid}-{id}"
    ))
    .ok()
}

/// Maps `len` bytes of the file `fd` shared, read-write (arenas and connection regions alike).
pub(crate) fn map_file(fd: libc::c_int, len: usize) -> Option<*mut u8> {
    // SAFETY: a new mapping at an address the kernel picks (null hint, no MAP_FIXED), so no
    // existing memory is touched; a bad fd or length only fails, and MAP_FAILED is checked.
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
    (base != libc::MAP_FAILED).then_some(base.cast())
}

/// Reserves the pages of `[base, base+len)` now, so that a full /dev/shm shows up as an error
/// here instead of a SIGBUS in the application later.
pub fn populate(base: *mut u8, len: usize) -> bool {
    // SAFETY: MADV_POPULATE_WRITE only prefaults pages and leaves their contents as they are;
    // on a range that is not mapped writable it fails without touching anything.
    unsafe { libc::madvise(base.cast(), len, libc::MADV_POPULATE_WRITE) == 0 }
}

/// Creates and initialises an arena file under a temporary name, then links it into place, so
/// other processes only ever see a complete arena.
fn create(id: usize, final_path: &CString) -> libc::c_int {
    let config = settings::get();
    let record_count = config.arena_records_per_core();
    if record_count == 0 {
        return -1;
    }
    let Ok(temp) = CString::new(format!(
        "{}.tmp-{}",
        final_path.to_string_lossy(),
        process::pid()
    )) else {
        return -1;
    };
    let (records_offset, total) = geometry(RECORD_BYTES, record_count);
    // SAFETY: `temp` and `final_path` are CStrings (NUL-terminated). `fd` is the new file,
    // ours, closed at most once. Its mapping is `total` bytes, page-aligned and zero-filled, so
    // the Header at offset 0 and the `record_count` descriptors from DESCRIPTORS_OFFSET lie
    // inside it (`geometry`); nobody else maps the file before it is linked into place, and
    // the mapping is gone before that.
    unsafe {
        libc::unlink(temp.as_ptr());
        let fd = libc::open(
            temp.as_ptr(),
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC | libc::O_NOFOLLOW,
            0o600,
        );
        if fd < 0 {
            return -1;
        }
        let ready = libc::ftruncate(fd, total as libc::off_t) == 0;
        let mapped = if ready { map_file(fd, total) } else { None };
        let initialised = mapped.is_some_and(|base| {
            if !populate(base, records_offset) {
                return false;
            }
            let header = &mut *base.cast::<Header>();
            header.version = VERSION;
            header.core = id as u32;
            header.record_bytes = RECORD_BYTES as u32;
            header.record_count = record_count;
            header.process_limit = config.process_records;
            header.records_offset = records_offset as u64;
            header.total_bytes = total as u64;
            for index in 0..record_count {
                let descriptor = &*base
                    .add(DESCRIPTORS_OFFSET + index as usize * std::mem::size_of::<Descriptor>())
                    .cast::<Descriptor>();
                let next = if index + 1 < record_count {
                    index + 2
                } else {
                    0
                };
                descriptor.next_free.store(next, Ordering::Relaxed);
            }
            header.free_head.0.store(1, Ordering::Relaxed);
            header.free_count.0.store(record_count, Ordering::Relaxed);
            std::sync::atomic::fence(Ordering::Release);
            header.magic = MAGIC;
            true
        });
        if let Some(base) = mapped {
            libc::munmap(base.cast(), total);
        }
        let linked = initialised && libc::link(temp.as_ptr(), final_path.as_ptr()) == 0;
        libc::unlink(temp.as_ptr());
        if linked {
            return fd;
        }
        real::close(fd);
        // Lost the race to another creator (EEXIST): use theirs.
        libc::open(
            final_path.as_ptr(),
            libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOFOLLOW,
        )
    }
}

/// The arena with this id, mapped on first use. `create`: make the file if it does not exist
/// (senders do; receivers only map what a sender made).
pub fn open(id: usize, create_missing: bool) -> Option<&'static Arena> {
    if id >= MAX_ARENAS {
        return None;
    }
    let mapped = MAPPED[id].load(Ordering::Acquire);
    if !mapped.is_null() {
        // SAFETY: a non-null entry of MAPPED is an Arena leaked below (or installed `'static`
        // by the fuzzer), never freed nor unmapped: valid for `'static`.
        return Some(unsafe { &*mapped });
    }
    if create_missing && BROKEN[id].load(Ordering::Relaxed) {
        return None;
    }
    let _guard = MAP_LOCK.lock();
    let mapped = MAPPED[id].load(Ordering::Acquire);
    if !mapped.is_null() {
        // SAFETY: as above: leaked, never freed.
        return Some(unsafe { &*mapped });
    }
    if cfg!(fuzzing) {
        // The fuzzer installs its own arenas and must not touch this user's real ones.
        return None;
    }
    let path = path(id)?;
    // SAFETY: `path` is a CString, so NUL-terminated.
    let mut fd = unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOFOLLOW,
        )
    };
    if fd < 0 && errno() == libc::ENOENT && create_missing {
        fd = create(id, &path);
    }
    if fd < 0 {
        if create_missing {
            BROKEN[id].store(true, Ordering::Relaxed);
        }
        return None;
    }
    let arena = map_validated(fd, id);
    // SAFETY: `fd` was opened above and is ours, closed once; the mapping outlives it.
    unsafe { real::close(fd) };
    match arena {
        Some(arena) => {
            let leaked: &'static Arena = Box::leak(Box::new(arena));
            MAPPED[id].store((leaked as *const Arena).cast_mut(), Ordering::Release);
            Some(leaked)
        }
        None => {
            BROKEN[id].store(true, Ordering::Relaxed);
            None
        }
    }
}

/// Maps an arena file and checks that it is one, of this user, with a consistent geometry.
pub(crate) fn map_validated(fd: libc::c_int, id: usize) -> Option<Arena> {
    // SAFETY: `struct stat` is plain integers, for which all-zero bytes are a valid value.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes one `struct stat` into `stat`, a live local of that type (a bad fd
    // only fails); geteuid has no preconditions.
    if unsafe { libc::fstat(fd, &mut stat) } != 0 || stat.st_uid != unsafe { libc::geteuid() } {
        return None;
    }
    let len = usize::try_from(stat.st_size).ok()?;
    if len < DESCRIPTORS_OFFSET {
        return None;
    }
    let base = map_file(fd, len)?;
    // SAFETY: `len >= DESCRIPTORS_OFFSET >= size_of::<Header>()` (checked above; asserted), so
    // the page-aligned mapping holds the Header at offset 0; its plain fields are copied out.
    let (record_bytes, record_count, records_offset) = unsafe {
        let header = &*base.cast::<Header>();
        (
            header.record_bytes as usize,
            header.record_count,
            header.records_offset as usize,
        )
    };
    let arena = Arena {
        base,
        len,
        id,
        record_bytes,
        record_count,
        records_offset,
    };
    arena.valid(id, len).then_some(arena)
}

/// A private arena in anonymous shared memory (not a file), initialised like a new one, for
/// unit tests and the fuzzer.
#[cfg(any(test, fuzzing))]
pub(crate) fn anonymous(id: usize, count: u32) -> Arena {
    let (records_offset, total) = geometry(RECORD_BYTES, count);
    // SAFETY: a new anonymous mapping at an address the kernel picks; MAP_FAILED is checked
    // before the pointer is used.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            total,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED, "mmap of a private arena failed");
    let arena = Arena {
        base: base.cast(),
        len: total,
        id,
        record_bytes: RECORD_BYTES,
        record_count: count,
        records_offset,
    };
    arena.reset();
    arena
}

#[cfg(any(test, fuzzing))]
impl Arena {
    /// Back to a fresh arena: every record free, header valid.
    pub(crate) fn reset(&self) {
        // SAFETY: `records_offset <= len` (the geometry), so the header and descriptor pages
        // are inside this private mapping (tests and the fuzzer only); no reference into them is
        // live while `reset` runs (callers hold no descriptor across it).
        unsafe { std::ptr::write_bytes(self.base, 0, self.records_offset) };
        // SAFETY: as above: the Header at offset 0 is inside the mapping, page-aligned, and no
        // other reference to it is live during `reset`.
        let header = unsafe { &mut *self.base.cast::<Header>() };
        header.magic = MAGIC;
        header.version = VERSION;
        header.core = self.id as u32;
        header.record_bytes = self.record_bytes as u32;
        header.record_count = self.record_count;
        header.process_limit = self.record_count;
        header.records_offset = self.records_offset as u64;
        header.total_bytes = self.len as u64;
        for index in 0..self.record_count {
            if let Some(descriptor) = self.descriptor(index) {
                let next = if index + 1 < self.record_count {
                    index + 2
                } else {
                    0
                };
                descriptor.next_free.store(next, Ordering::Relaxed);
            }
        }
        header.free_head.0.store(1, Ordering::Relaxed);
        header
            .free_count
            .0
            .store(self.record_count, Ordering::Relaxed);
    }

    /// The header and descriptor bytes, as a peer could scribble on them.
    pub(crate) fn metadata(&self) -> (*mut u8, usize) {
        (self.base, self.records_offset)
    }
}

/// Makes `arena` the one this process uses for its id (fuzzer only).
#[cfg(fuzzing)]
pub(crate) fn install(arena: &'static Arena) {
    MAPPED[arena.id].store((arena as *const Arena).cast_mut(), Ordering::Release);
}

/// An arena already mapped by this process (no system call).
pub fn mapped(id: usize) -> Option<&'static Arena> {
    let pointer = MAPPED.get(id)?.load(Ordering::Acquire);
    // SAFETY: as in `open`: a non-null entry is a leaked Arena, never freed.
    (!pointer.is_null()).then(|| unsafe { &*pointer })
}

/// Records this process holds across all arenas.
pub fn process_usage() -> u32 {
    (0..arena_count())
        .filter_map(|id| {
            let slot = MY_SLOT[id].load(Ordering::Relaxed);
            let arena = mapped(id)?;
            (slot != 0).then(|| arena.slot_usage(slot as usize - 1))
        })
        .sum()
}

/// In a forked child: usage slots belong to the parent's pid.
pub fn after_fork_in_child() {
    for slot in &MY_SLOT {
        slot.store(0, Ordering::Relaxed);
    }
}

fn current_core() -> usize {
    // SAFETY: sched_getcpu takes no arguments and has no preconditions (glibc reads the cpu id
    // from rseq: no system call on this kernel).
    let cpu = unsafe { libc::sched_getcpu() };
    usize::try_from(cpu).unwrap_or(0) % arena_count()
}

/// Chooses, per writing thread, between the shallow and the deep reuse distance (see
/// [`COOLING`]) by measuring how fast it goes through arena records, like a two-armed bandit:
/// it runs on one choice for a while, tries the other for [`Tuner::PROBE`] records, and keeps
/// whichever went faster (by a margin). Each probe that does not win doubles the run before
/// the next one (from [`Tuner::FIRST_RUN`] up to [`Tuner::LONGEST_RUN`] records), so probing
/// the slower choice costs little once the choice is settled, and a change of placement is
/// still noticed. The measure is the time between two record allocations of the thread: it
/// includes the reader's side (a writer ahead of its reader waits for room), which the writer's
/// copy alone does not (with far-away records the writer's copy can be quick and the reader's
/// slow). Gaps of [`Tuner::IDLE_NS`] or more (the program paused) are not samples. One clock
/// read per 64 KiB record.
#[derive(Clone, Copy)]
pub struct Tuner {
    deep: bool,
    probing: bool,
    count: u32,
    /// Copies to run before the next probe.
    run: u32,
    /// Moving averages of nanoseconds per record, [shallow, deep]; 0 = no sample yet.
    cost: [u64; 2],
    /// When this thread last allocated a record.
    last: Option<std::time::Instant>,
}

impl Tuner {
    const FIRST_RUN: u32 = 1024;
    const LONGEST_RUN: u32 = 65536;
    const PROBE: u32 = 128;
    const IDLE_NS: u64 = 1_000_000;

    pub const fn new() -> Tuner {
        Tuner {
            deep: false,
            probing: false,
            count: 0,
            run: Self::FIRST_RUN,
            cost: [0, 0],
            last: None,
        }
    }

    pub fn deep(&self) -> bool {
        self.deep
    }

    /// The thread allocated a record now.
    fn tick(&mut self) {
        let now = std::time::Instant::now();
        if let Some(last) = self.last.replace(now) {
            self.observe((now - last).as_nanos().min(u64::MAX as u128) as u64);
        }
    }

    /// One record took `nanos`.
    pub fn observe(&mut self, nanos: u64) {
        if nanos >= Self::IDLE_NS {
            return;
        }
        let slot = &mut self.cost[usize::from(self.deep)];
        *slot = if *slot == 0 {
            nanos.max(1)
        } else {
            (*slot * 15 + nanos) / 16
        };
        self.count += 1;
        if !self.probing && self.count >= self.run {
            self.probing = true;
            self.count = 0;
            self.deep = !self.deep;
            self.cost[usize::from(self.deep)] = 0;
        } else if self.probing && self.count >= Self::PROBE {
            self.probing = false;
            self.count = 0;
            let tried = self.cost[usize::from(self.deep)];
            let before = self.cost[usize::from(!self.deep)];
            // Keep the new choice only if it is clearly faster.
            if before != 0 && tried * 100 >= before * 85 {
                self.deep = !self.deep;
                self.run = (self.run * 2).min(Self::LONGEST_RUN);
            } else {
                self.run = Self::FIRST_RUN;
            }
        }
    }
}

thread_local! {
    static TUNER: std::cell::Cell<Tuner> = const { std::cell::Cell::new(Tuner::new()) };
}

fn tuner_deep() -> bool {
    TUNER.try_with(|t| t.get().deep()).unwrap_or(false)
}

/// This thread allocated a record.
fn tuner_tick() {
    let _ = TUNER.try_with(|t| {
        let mut tuner = t.get();
        tuner.tick();
        t.set(tuner);
    });
}

/// Why a sender could not append a record.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    Disabled,
    ProcessLimit,
    Exhausted,
}

/// Speculatively allocates a record for the connection `owner`, whose first byte will be stream
/// offset `start`: from this core's arena, else from another core's existing arena.
pub fn allocate(owner: u64, start: u64) -> Result<RecordRef, Refused> {
    let config = settings::get();
    if config.arena_bytes == 0 {
        return Err(Refused::Disabled);
    }
    if process_usage() >= config.process_records {
        stats::bump(&stats::get().refused_limit);
        return Err(Refused::ProcessLimit);
    }
    let home = current_core();
    let count = arena_count();
    for step in 0..count {
        let id = (home + step) % count;
        let Some(arena) = (if step == 0 {
            open(id, true)
        } else {
            mapped(id).or_else(|| open(id, false))
        }) else {
            continue;
        };
        if arena.available_records() == 0 {
            continue;
        }
        let Some(slot) = arena.my_slot() else {
            continue;
        };
        if arena.slot_usage(slot) >= arena.process_limit() {
            // The limit the arena's receivers enforce at commit (see `commit`).
            continue;
        }
        let deep = tuner_deep();
        let Some(index) = arena
            .take_cooled(deep)
            .or_else(|| arena.pop())
            .or_else(|| arena.pop_cooling())
        else {
            continue;
        };
        let Some(descriptor) = arena.descriptor(index) else {
            continue;
        };
        // Claim it: a free list a peer scribbled on could name a record that is in use (it is
        // then left to its owner, who returns it).
        if descriptor
            .state
            .compare_exchange(FREE, SPECULATIVE, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            continue;
        }
        if descriptor.populated.load(Ordering::Acquire) == 0 {
            if !populate(arena.record(index), arena.record_bytes) {
                descriptor.state.store(FREE, Ordering::Release);
                arena.push(index);
                stats::bump(&stats::get().refused_exhausted);
                return Err(Refused::Exhausted);
            }
            descriptor.populated.store(1, Ordering::Release);
        }
        descriptor.owner.store(owner, Ordering::Relaxed);
        descriptor.start.store(start, Ordering::Relaxed);
        descriptor.filled.store(0, Ordering::Relaxed);
        descriptor.sealed.store(0, Ordering::Relaxed);
        descriptor.next.store(0, Ordering::Relaxed);
        descriptor.slot.store(slot as u32, Ordering::Relaxed);
        descriptor.state.store(SPECULATIVE, Ordering::Release);
        arena.header().slots[slot]
            .records
            .fetch_add(1, Ordering::Relaxed);
        stats::bump(&stats::get().records_allocated);
        tuner_tick();
        return Ok(RecordRef::new(id, index));
    }
    stats::bump(&stats::get().refused_exhausted);
    Err(Refused::Exhausted)
}

/// A validated record: its metadata and its bytes.
#[derive(Clone, Copy)]
pub struct Record {
    pub descriptor: &'static Descriptor,
    pub data: *mut u8,
    pub capacity: u64,
}

fn lookup(reference: RecordRef, owner: u64) -> Option<(&'static Arena, u32, Record)> {
    let arena = open(reference.arena()?, false)?;
    let index = reference.index();
    let descriptor = arena.descriptor(index)?;
    if descriptor.owner.load(Ordering::Acquire) != owner {
        return None;
    }
    let filled = descriptor.filled.load(Ordering::Acquire) as usize;
    if filled > arena.record_bytes {
        return None;
    }
    Some((
        arena,
        index,
        Record {
            descriptor,
            data: arena.record(index),
            capacity: arena.record_bytes as u64,
        },
    ))
}

/// The sender's view of a record it allocated (ownership checked, no state change).
pub fn writer_view(reference: RecordRef, owner: u64) -> Option<Record> {
    let (_, _, record) = lookup(reference, owner)?;
    (record.descriptor.state.load(Ordering::Acquire) != FREE).then_some(record)
}

/// The commit step, done by the receiver on its first access to a record: validate that it
/// belongs to this connection and to a process within its limit, then mark it committed.
/// `None`: the record is not this connection's to read (a broken or misbehaving peer).
pub fn commit(reference: RecordRef, owner: u64) -> Option<Record> {
    let (arena, _, record) = lookup(reference, owner)?;
    let descriptor = record.descriptor;
    match descriptor.state.load(Ordering::Acquire) {
        COMMITTED => return Some(record),
        SPECULATIVE => {}
        _ => return None,
    }
    let slot = descriptor.slot.load(Ordering::Relaxed) as usize;
    if slot >= SLOTS || arena.slot_usage(slot) > arena.process_limit() {
        stats::bump(&stats::get().commits_rejected);
        return None;
    }
    match descriptor.state.compare_exchange(
        SPECULATIVE,
        COMMITTED,
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        Ok(_) => {
            stats::bump(&stats::get().records_committed);
            Some(record)
        }
        Err(COMMITTED) => Some(record),
        Err(_) => None,
    }
}

/// Returns a record of connection `owner` to its arena. False if it is not that connection's
/// (already free, or someone else's): nothing is changed then.
pub fn release(reference: RecordRef, owner: u64) -> bool {
    let Some((arena, index, record)) = lookup(reference, owner) else {
        return false;
    };
    let descriptor = record.descriptor;
    let state = descriptor.state.load(Ordering::Acquire);
    if state == FREE
        || descriptor
            .state
            .compare_exchange(state, FREE, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
    {
        return false;
    }
    descriptor.owner.store(0, Ordering::Release);
    let slot = descriptor.slot.load(Ordering::Relaxed) as usize;
    if let Some(slot) = arena.header().slots.get(slot) {
        let _ = slot
            .records
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }
    arena.retire(index);
    stats::bump(&stats::get().records_freed);
    true
}

/// One line per mapped arena, for the stats report; first the exiting thread's reuse choice
/// (see [`Tuner`]) if it ever allocated a record.
pub fn report() -> String {
    let mut out = String::new();
    if let Ok(tuner) = TUNER.try_with(|t| t.get()) {
        if tuner.last.is_some() {
            out.push_str(&format!(
                "reuse {} ns_per_record shallow {} deep {} next_probe_after {}\n",
                if tuner.deep { "deep" } else { "shallow" },
                tuner.cost[0],
                tuner.cost[1],
                tuner.run
            ));
        }
    }
    for (id, my_slot) in MY_SLOT.iter().enumerate().take(arena_count()) {
        let Some(arena) = mapped(id) else { continue };
        let slot = my_slot.load(Ordering::Relaxed);
        let mine = if slot == 0 {
            0
        } else {
            arena.slot_usage(slot as usize - 1)
        };
        let processes = arena
            .header()
            .slots
            .iter()
            .filter(|s| s.records.load(Ordering::Relaxed) > 0)
            .count();
        out.push_str(&format!(
            "arena {id} records {} free {} record_bytes {} process_limit {} held_here {mine} holding_processes {processes}\n",
            arena.record_count,
            arena.available_records(),
            arena.record_bytes,
            arena.process_limit()
        ));
    }
    out
}

/// Every existing arena of this user, mapped if need be: geometry, free records and the
/// processes holding records (pid, records, alive).
pub fn status() -> String {
    let mut out = String::new();
    let mut found = 0;
    for id in 0..arena_count() {
        let Some(arena) = mapped(id).or_else(|| open(id, false)) else {
            continue;
        };
        found += 1;
        let header = arena.header();
        out.push_str(&format!(
            "arena {id} path {} records {} record_bytes {} free {} in_use {} process_limit {}\n",
            path(id)
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default(),
            arena.record_count,
            arena.record_bytes,
            arena.available_records(),
            arena.record_count.saturating_sub(arena.available_records()),
            arena.process_limit()
        ));
        for slot in &header.slots {
            let records = slot.records.load(Ordering::Relaxed);
            let pid = slot.pid.load(Ordering::Relaxed);
            if records > 0 {
                out.push_str(&format!(
                    "  process {pid} records {records} {}\n",
                    if process::alive(pid) { "alive" } else { "dead" }
                ));
            }
        }
    }
    if found == 0 {
        out.push_str("no arena yet (one is created the first time a local record overflows)\n");
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn references_round_trip_and_reject_garbage() {
        let reference = RecordRef::new(3, 77);
        assert_eq!(reference.arena(), Some(3));
        assert_eq!(reference.index(), 77);
        assert!(RecordRef(0).arena().is_none() && RecordRef(0).is_none());
        assert!(
            RecordRef(u32::MAX).arena().is_none(),
            "arena id past MAX_ARENAS"
        );
    }

    #[test]
    fn geometry_is_page_aligned() {
        for count in [1u32, 63, 64, 1000, 1024] {
            let (offset, total) = geometry(RECORD_BYTES, count);
            assert_eq!(offset % PAGE, 0);
            assert!(offset >= DESCRIPTORS_OFFSET + count as usize * 64);
            assert_eq!(total, offset + count as usize * RECORD_BYTES);
        }
    }

    fn private_arena(count: u32) -> Arena {
        anonymous(MAX_ARENAS - 1, count)
    }

    #[test]
    fn free_list_hands_out_each_record_once() {
        let arena = private_arena(8);
        let mut taken: Vec<u32> = std::iter::from_fn(|| arena.pop()).collect();
        taken.sort_unstable();
        assert_eq!(taken, (0..8).collect::<Vec<_>>());
        assert_eq!(arena.free_records(), 0);
        for index in [5, 2, 7] {
            arena.push(index);
        }
        assert_eq!(arena.free_records(), 3);
        let again: Vec<u32> = std::iter::from_fn(|| arena.pop()).collect();
        assert_eq!(again, vec![7, 2, 5]);
    }

    /// A released record is not handed out again at once: the shallow choice takes the one
    /// released `SHALLOW` releases ago, the deep one the oldest of a full FIFO; the free list
    /// (colder still) serves until the FIFO is that long.
    #[test]
    fn released_records_cool_before_they_come_back() {
        let arena = private_arena(COOLING as u32 + 8);
        let all: Vec<u32> = (0..COOLING + 8).filter_map(|_| arena.pop()).collect();
        assert_eq!(all.len(), COOLING + 8);
        for &index in &all[..SHALLOW] {
            arena.retire(index);
        }
        assert_eq!(arena.take_cooled(false), None, "not SHALLOW + 1 long yet");
        arena.retire(all[SHALLOW]);
        assert_eq!(
            arena.take_cooled(false),
            Some(all[1]),
            "released SHALLOW ago"
        );
        assert_eq!(arena.take_cooled(true), None, "the FIFO is not full");
        // The FIFO is now all[0], all[2..=SHALLOW]: fill it, then one more.
        for &index in &all[SHALLOW + 1..=COOLING] {
            arena.retire(index);
        }
        assert_eq!(arena.cooling_records() as usize, COOLING);
        assert_eq!(arena.pop(), None);
        arena.retire(all[COOLING + 1]);
        assert_eq!(arena.pop(), Some(all[0]), "the oldest left the full FIFO");
        assert_eq!(arena.take_cooled(true), Some(all[2]), "the oldest");
        assert_eq!(arena.cooling_records() as usize, COOLING - 1);
        assert_eq!(arena.pop_cooling(), Some(all[3]));
    }

    /// The tuner keeps the faster reuse distance and goes back when a probe is not faster.
    #[test]
    fn tuner_keeps_the_faster_reuse_distance() {
        let mut tuner = Tuner::new();
        let copy = |tuner: &mut Tuner, shallow_ns: u64, deep_ns: u64| {
            let ns = if tuner.deep() { deep_ns } else { shallow_ns };
            tuner.observe(ns);
        };
        for _ in 0..(Tuner::FIRST_RUN + Tuner::PROBE) {
            copy(&mut tuner, 20_000, 8_000);
        }
        assert!(tuner.deep(), "deep copies were faster: keep deep");
        for _ in 0..(Tuner::FIRST_RUN + Tuner::PROBE) * 2 {
            copy(&mut tuner, 3_000, 8_000);
        }
        assert!(
            !tuner.deep(),
            "shallow copies became faster: back to shallow"
        );
        for _ in 0..(Tuner::LONGEST_RUN + Tuner::PROBE) * 3 {
            copy(&mut tuner, 3_000, 8_000);
        }
        assert!(!tuner.deep(), "probes of the slower choice do not stick");
        assert_eq!(tuner.run, Tuner::LONGEST_RUN, "and come ever more rarely");
        for _ in 0..(Tuner::LONGEST_RUN + Tuner::PROBE) * 2 {
            tuner.observe(Tuner::IDLE_NS);
        }
        assert!(!tuner.deep(), "pauses are not samples");
    }

    /// A peer that scribbles on the cooling FIFO cannot make it index out of bounds, nor hang
    /// a releaser with a lock word it left set (found by the fuzzer: our own pid in it).
    #[test]
    fn corrupt_cooling_fifo_stays_in_bounds_and_never_hangs() {
        let arena = private_arena(8);
        let cooling = &arena.header().cooling.0;
        cooling.first.store(u32::MAX, Ordering::Relaxed);
        cooling.len.store(u32::MAX, Ordering::Relaxed);
        arena.retire(3);
        let _ = arena.pop_cooling();
        assert!(arena.cooling_records() as usize <= COOLING);
        // (The scribbled FIFO may have put a record in the free list twice: take a bounded
        // number; allocation's FREE -> SPECULATIVE claim keeps such a record from being used
        // twice.)
        let taken: Vec<u32> = (0..8).filter_map(|_| arena.pop()).collect();
        cooling.lock.store(process::pid(), Ordering::Relaxed);
        let started = std::time::Instant::now();
        for index in taken {
            arena.retire(index);
        }
        assert_eq!(arena.pop_cooling(), None);
        assert!(arena.pop().is_some(), "retired straight to the free list");
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
    }

    #[test]
    fn arena_names_carry_the_layout() {
        let name = path(1).unwrap().into_string().unwrap();
        assert!(
            name.contains(&format!("-v{VERSION}-{LAYOUT_HASH:08x}-")),
            "{name}"
        );
    }

    #[test]
    fn corrupt_free_list_is_treated_as_exhausted() {
        let arena = private_arena(4);
        arena
            .descriptor(0)
            .unwrap()
            .next_free
            .store(1_000, Ordering::Relaxed);
        assert_eq!(arena.pop(), None);
        arena.header().free_head.0.store(99, Ordering::Relaxed);
        assert_eq!(arena.pop(), None, "head past the table");
    }

    #[test]
    fn concurrent_pop_and_push_lose_nothing() {
        let arena = private_arena(64);
        let arena_ref: &'static Arena = Box::leak(Box::new(arena));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        if let Some(index) = arena_ref.pop() {
                            arena_ref.push(index);
                        }
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        let mut all: Vec<u32> = std::iter::from_fn(|| arena_ref.pop()).collect();
        all.sort_unstable();
        assert_eq!(all, (0..64).collect::<Vec<_>>());
    }
}
