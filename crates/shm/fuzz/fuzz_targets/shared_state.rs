//! Fuzzes what a peer can write into shared memory: the connection region (header, counters,
//! chain state, ring bytes), region files offered at accept, arena files, the descriptors
//! of arena records, and the netlink answers that prove an accepted connection's peer. The library must never read or write outside a mapping, panic, or loop
//! forever, whatever the peer wrote; at worst it refuses (TCP fallback) or resets the
//! connection.
//!
//! The library is a cdylib, so its modules are compiled into this target directly (the
//! interposers are left out). A private arena in anonymous memory is installed as arena 0;
//! `cfg(fuzzing)` keeps the library away from this user's real arena files.
#![no_main]
#![allow(dead_code, unused_imports, clippy::all)]

#[path = "../../src/arena.rs"]
mod arena;
#[path = "../../src/intercept.rs"]
mod intercept;
#[path = "../../src/lock.rs"]
mod lock;
#[path = "../../src/process.rs"]
mod process;
#[path = "../../src/proof.rs"]
mod proof;
#[path = "../../src/real.rs"]
mod real;
#[path = "../../src/region.rs"]
mod region;
#[path = "../../src/settings.rs"]
mod settings;
#[path = "../../src/stats.rs"]
mod stats;

use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

/// Arena 0 exists on every machine, so the writer's speculative allocation uses it too.
const ARENA_ID: usize = 0;
const RECORDS: u32 = 4;

fn arena() -> &'static arena::Arena {
    static ARENA: OnceLock<&'static arena::Arena> = OnceLock::new();
    ARENA.get_or_init(|| {
        let arena: &'static arena::Arena = Box::leak(Box::new(arena::anonymous(ARENA_ID, RECORDS)));
        arena::install(arena);
        arena
    })
}

/// Reads the input front to back; zeros once it runs out.
struct Input<'a>(&'a [u8]);
impl Input<'_> {
    fn byte(&mut self) -> u8 {
        let (first, rest) = self.0.split_first().map_or((0, &[][..]), |(f, r)| (*f, r));
        self.0 = rest;
        first
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.byte(), self.byte(), self.byte(), self.byte()])
    }
    fn u64(&mut self) -> u64 {
        (self.u32() as u64) | ((self.u32() as u64) << 32)
    }
    fn take(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        head
    }
    /// A value that is often meaningful (near a real one) and sometimes anything.
    fn near(&mut self, real: u64) -> u64 {
        match self.byte() % 4 {
            0 => real,
            1 => real.wrapping_add(self.u32() as u64 % 70_000),
            2 => real.wrapping_sub(self.u32() as u64 % 70_000),
            _ => self.u64(),
        }
    }
    /// A record reference: none, a real record of the fuzz arena, or anything.
    fn reference(&mut self) -> u32 {
        match self.byte() % 4 {
            0 => 0,
            1 | 2 => arena::RecordRef::new(ARENA_ID, self.u32() % (RECORDS + 1)).0,
            _ => self.u32(),
        }
    }
}

/// Bytes as a memfd, for the `attach` and arena-file parsers.
fn memfd(bytes: &[u8], len: usize) -> libc::c_int {
    // SAFETY: memfd_create reads a NUL-terminated literal and makes an fd the caller owns (and
    // closes); ftruncate takes no pointer; pwrite reads at most `bytes.len()` bytes of `bytes`.
    unsafe {
        let fd = libc::memfd_create(c"fuzz".as_ptr(), libc::MFD_CLOEXEC);
        assert!(fd >= 0);
        assert_eq!(libc::ftruncate(fd, len as libc::off_t), 0);
        if !bytes.is_empty() {
            libc::pwrite(fd, bytes.as_ptr().cast(), bytes.len().min(len), 0);
        }
        fd
    }
}

fn run(data: &[u8]) {
    let mut input = Input(data);
    match input.byte() % 4 {
        // A region file offered at accept: header bytes from the input.
        0 => {
            let local = [8usize << 10, 16 << 10, 64 << 10][input.byte() as usize % 3];
            let len = if input.byte() % 8 == 0 {
                input.u32() as usize % (300 << 10)
            } else {
                2 * local
            };
            let header = input.take(2048).to_vec();
            let fd = memfd(&header, len);
            if let Some(region) = region::Region::attach(fd) {
                exercise(&region, &mut input);
            }
            // SAFETY: the memfd made above, ours and closed once; the region mapped from it
            // (if any) is gone already, and a mapping would outlive the fd anyway.
            unsafe { libc::close(fd) };
        }
        // An arena file as another process left it.
        1 => {
            let bytes = input.take(16 << 10).to_vec();
            let len = if input.byte() % 2 == 0 {
                arena::geometry(arena::RECORD_BYTES, 1 + input.u32() % 3).1
            } else {
                input.u32() as usize % (1 << 20)
            };
            let fd = memfd(&bytes, len.max(1));
            if let Some(mapped) = arena::map_validated(fd, input.byte() as usize % 4) {
                let _ = mapped.descriptor(input.u32());
                drop(mapped);
            }
            // SAFETY: the memfd made above, ours and closed once; nothing uses it any more.
            unsafe { libc::close(fd) };
        }
        // The kernel's answers to the accept-time proof (the socket table's and, across the
        // PUs of a split namespace, the connection tracking table's), as bytes of any shape.
        3 => {
            let bytes = input.take(4096);
            let _ = flatmesh_netlink::sock_diag::parse_answer(bytes);
            let _ = flatmesh_netlink::conntrack::parse_answer(bytes);
            // The interception rules a PU agent writes into the (world-writable) group
            // directory.
            if let Ok(text) = std::str::from_utf8(bytes) {
                let rules = intercept::parse(text);
                let server = std::net::SocketAddr::from((input.u32().to_be_bytes(), 80));
                let _ = intercept::proxy_port(&rules, server);
            }
        }
        // A live connection whose peer scribbles on the shared state between our calls.
        _ => {
            let local = [8usize << 10, 16 << 10][input.byte() as usize % 2];
            let Some(region) = region::Region::anonymous(local) else {
                return;
            };
            exercise(&region, &mut input);
        }
    }
}

fn exercise(region: &region::Region, input: &mut Input<'_>) {
    let arena = arena();
    arena.reset();
    let token = region.control().token;
    for _ in 0..8 {
        let side = input.byte() as usize % 2;
        let pipe = region.direction(side);
        match input.byte() % 8 {
            0 => {
                // The peer rewrites the counters and the chain state.
                let written = pipe.written();
                pipe.control
                    .written
                    .0
                    .store(input.near(written), std::sync::atomic::Ordering::Relaxed);
                pipe.control
                    .consumed
                    .0
                    .store(input.near(written), std::sync::atomic::Ordering::Relaxed);
                let chain = &pipe.control.chain.0;
                chain
                    .mode
                    .store(input.u32() % 3, std::sync::atomic::Ordering::Relaxed);
                chain
                    .ring_start
                    .store(input.near(written), std::sync::atomic::Ordering::Relaxed);
                chain
                    .ring_end
                    .store(input.near(written), std::sync::atomic::Ordering::Relaxed);
                chain
                    .head
                    .store(input.reference(), std::sync::atomic::Ordering::Relaxed);
                chain
                    .tail
                    .store(input.reference(), std::sync::atomic::Ordering::Relaxed);
                chain
                    .reader_gone
                    .store(input.u32() % 2, std::sync::atomic::Ordering::Relaxed);
            }
            1 => {
                // The peer rewrites a record's descriptor (owner: this connection or not).
                let index = input.u32() % RECORDS;
                if let Some(descriptor) = arena.descriptor(index) {
                    use std::sync::atomic::Ordering::Relaxed;
                    descriptor.state.store(input.u32() % 4, Relaxed);
                    descriptor.slot.store(input.u32() % 300, Relaxed);
                    descriptor.owner.store(
                        if input.byte() % 4 == 0 {
                            input.u64()
                        } else {
                            token
                        },
                        Relaxed,
                    );
                    let start = pipe.written();
                    descriptor.start.store(input.near(start), Relaxed);
                    descriptor
                        .filled
                        .store(input.u32() % (arena::RECORD_BYTES as u32 + 2000), Relaxed);
                    descriptor.sealed.store(input.u32() % 2, Relaxed);
                    descriptor.next.store(input.reference(), Relaxed);
                }
            }
            2 => {
                // Raw bytes anywhere in the arena's metadata.
                let (base, len) = arena.metadata();
                let at = input.u32() as usize % len;
                let bytes = input.take(64).to_vec();
                let n = bytes.len().min(len - at);
                // SAFETY: `at < len` and `n <= len - at`, so the copy stays in the first `len`
                // bytes of the arena's mapping (its header and descriptors, `metadata`); `bytes`
                // is a separate Vec of at least `n` bytes. No reference into that memory is
                // held across the copy (the peer's scribble that the fuzzer plays).
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), base.add(at), n) };
            }
            3 | 4 => {
                let len = input.u32() as usize % 200_000;
                let mut buffer = vec![0u8; len];
                let peek = input.byte() % 3 == 0;
                let _ = pipe.read(&[(buffer.as_mut_ptr(), len)], peek);
            }
            5 => {
                let len = input.u32() as usize % 200_000;
                let buffer = vec![0xABu8; len];
                let _ = pipe.write(&[(buffer.as_ptr(), len)]);
            }
            6 => {
                let _ = (
                    pipe.readable(),
                    pipe.writable(),
                    pipe.write_ready(),
                    pipe.records_held(),
                    pipe.wake_threshold(),
                    arena.cooling_records(),
                );
            }
            _ => pipe.release_all(input.byte() % 2 == 0),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    // The private arena is installed before anything could look for a real one.
    arena();
    run(data);
});
