//! HBONE, as Istio's ztunnel speaks it: TCP connections carried as HTTP/2 `CONNECT` streams
//! inside mutual TLS, one stream per connection, many streams per tunnel connection. The
//! `:authority` of each CONNECT is the destination `IP:PORT`.
//!
//! `server` accepts tunnels on an `hbone` listener and delivers each stream to its
//! destination (only within the listener's `hbone.destinations`: never an open relay);
//! `client` carries a `tcp` listener's connections to a `tunnel: hbone` cluster's peers over
//! the worker's tunnel connections (`pool`, kept with the worker's other upstream pools); an
//! `http` listener's upstream connections to such a cluster take their streams from the same
//! pool (`crate::upstream::transport`). `stream` makes one CONNECT stream a byte stream for
//! the relay and the HTTP pools; `authority` reads a destination out of `:authority`.

pub mod authority;
pub mod client;
pub mod pool;
pub mod server;
pub mod stream;

/// Why a stream was refused: a bounded label for the `reason` of the refusal counters.
pub type Refusal = &'static str;
