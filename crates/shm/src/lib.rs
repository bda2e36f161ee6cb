//! hetero-socket (HeteroNet §4.2): shared-memory sockets for unmodified programs.
//!
//! Loaded with `LD_PRELOAD` (or `flatmesh shm run -- CMD`), this library keeps connection
//! set-up in the kernel and moves the data path of TCP connections between two cooperating
//! local processes onto shared memory. See `docs/shm.md` for the design and its limits.
//!
//! Modules, one concept each:
//! - [`region`]: the shared region of one connection (control page + two records/rings);
//! - [`conn`]: a connection as one process sees it, and the fd table;
//! - [`negotiate`]: rendezvous at connect/accept, with fallback to plain TCP;
//! - [`io`]: send/receive and the poll-then-sleep waits (user-mode NAPI);
//! - [`multiplex`]: epoll/poll/select over kernel and shared-memory fds;
//! - `interpose`: the exported libc functions;
//! - [`real`]: the real libc functions behind them; [`settings`]: environment knobs.
//!
//! Errors surface as errno values, exactly as libc's would, so the crate has no error enum.
#![cfg_attr(test, allow(dead_code))]

mod conn;
#[cfg(not(test))]
mod interpose;
mod io;
mod multiplex;
mod negotiate;
mod real;
mod region;
mod settings;
