//! hetero-socket (HeteroNet §4.2): shared-memory sockets for unmodified programs.
//!
//! Loaded with `LD_PRELOAD` (or `flatmesh shm run -- CMD`), this library keeps connection
//! set-up in the kernel and moves the data path of TCP connections between two cooperating
//! local processes onto shared memory. See `docs/shm.md` for the design and its limits.
//!
//! Modules, one concept each:
//! - [`region`]: the shared region of one connection (two local records) and the pipe of one
//!   direction (the local record as a ring, plus chained arena records);
//! - [`arena`]: per-core shared arenas, speculative allocation, commit, per-process limits;
//! - [`conn`]: a connection as one process sees it, and the fd table;
//! - [`negotiate`]: rendezvous at connect/accept, with fallback to plain TCP;
//! - [`group`]: the same between the network namespaces (PUs) of one split namespace;
//!   [`intercept`]: the split namespace's interception rules, as the connector reads them;
//! - [`proof`]: the kernel's word that an accepted connection is the one a region was made for;
//! - [`io`]: send/receive and the poll-then-sleep waits (user-mode NAPI);
//!   [`notify`]: how a sleeping waiter is woken (wake-up byte, signal, or Notify-on-RW);
//! - [`multiplex`]: epoll/poll/select over kernel and shared-memory fds;
//! - `interpose`: the exported libc functions;
//! - [`real`]: the real libc functions behind them; [`settings`]: environment knobs;
//! - [`lock`]: a shared-memory spin lock that survives a dead holder; [`process`]: pids and
//!   liveness; [`stats`]: counters of the slow events (system calls, records).
//!
//! Errors surface as errno values, exactly as libc's would, so the crate has no error enum.
//!
//! Unsafe code: every `unsafe` block says in a `// SAFETY:` comment why it is sound (enforced
//! by `clippy::undocumented_unsafe_blocks`, see Cargo.toml). The interposers' arguments carry
//! the contract of the libc function they replace (`interpose`); caller buffers travel on as
//! `(pointer, length)` pairs valid for their length (`io::Chunks`, `io::Buffers`).
#![cfg_attr(test, allow(dead_code))]

// The module list lives in modules.rs so that examples/flatmesh_shm_preload.rs can build the
// same library once more (see Cargo.toml).
include!("modules.rs");
