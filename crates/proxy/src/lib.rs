//! flatmesh node data plane: listeners, shared-nothing workers, the L4 relay, the L7 HTTP
//! path, upstream pools and load balancing, tier K's hand-offs, telemetry and the admin
//! endpoint. Callers start a [`Node`]; the rest is the node's inside.
//!
//! Follow one request (the README's "Architecture" walks it with file names):
//! `node.rs` binds and swaps config snapshots (`control.rs`, `snapshot.rs`) → `worker.rs`
//! accepts on a SO_REUSEPORT socket → `dispatch.rs` picks the path: the L4 relay (`tcp.rs`,
//! which hands a tunnel cluster's connections to `hbone/client.rs`, presenting the identity of
//! the workload `workload/` found for the client), HBONE tunnels in
//! (`hbone/server.rs`), tier K's first-request hand-off (`kernel/`), or the protocol sniff (`sniff.rs`) → the
//! HTTP/1 codec (`h1/`) or the HTTP/2 codec (`h2/`, on the `h2` crate), thin adapters over the
//! codec-neutral L7 layer (`l7/`: decide, retry driver, error type, replies) → `lb.rs` picks
//! an endpoint and `upstream.rs` a pooled connection (a socket, or for a tunnel cluster an
//! HBONE stream: `upstream/transport.rs`) → the response streams back. A QNP request (UDP)
//! takes `qnp/`: decided by the kernel's sk_reuseport program or by the user-space matcher,
//! then relayed to its local worker through the client's session.
//!
//! Files depend on each other in one direction only: base pieces (`snapshot`, `metrics`,
//! `lb`, `tap`, `relay`, `read_ahead` (under TLS), `sniff`, `body`, `trailers`, the HTTP/1 framing in `h1/head`, `h1/chunked`, `h1/body`)
//! → HBONE's stream and tunnel pool (`hbone/stream`, `hbone/pool`) → the upstream transport
//! (`upstream/transport`) → upstream pools and clients (`h1/pool`, `h1/client`, `h2/client`, `upstream`) and tier K
//! (`kernel/`) → `workload` → `context` → the L7 layer (`l7/`), the L4 relay (`tcp`, `hbone/client`, `hbone/server`) and the QNP relay (`qnp/serve`, `qnp/session`, `qnp/group`; the plan in `qnp/mod` is a base piece of `snapshot`) → the codecs'
//! server sides (`h1/conn`, `h2`) → `dispatch` → `worker` → `control` → `admin`, `node`.
// One exception, with its SAFETY note: `limits::release_free_heap` (glibc's malloc_trim).
#![deny(unsafe_code)]

mod access_log;
mod admin;
mod body;
mod context;
mod control;
mod dispatch;
mod drain;
mod error;
mod h1;
mod h2;
mod hbone;
mod idle;
mod kernel;
mod ktls;
mod l7;
mod lb;
mod limits;
mod listener;
mod load_report;
pub mod logging;
mod metrics;
mod node;
mod original_dst;
mod qnp;
mod read_ahead;
mod relay;
mod resilience;
mod snapshot;
mod sniff;
mod tap;
mod tcp;
#[cfg(any(test, fuzzing))]
mod testing;
mod tls;
mod trace;
mod trailers;
mod upstream;
mod worker;
mod workload;

pub use drain::Draining;
pub use error::ProxyError;
pub use load_report::EndpointReport;
pub use node::{ConfigSource, Node};
pub use tls::check_files as check_tls_files;
/// The OTLP trace messages the node exports (for a receiver in tests and tools).
pub use trace::otlp;

/// What the fuzz targets in `crates/proxy/fuzz` exercise: the HTTP/1 head analysis and
/// upstream head writer, the chunked-body parser, the trailer filter, HBONE's
/// `:authority` parser and the trace context parsers (W3C, B3). Not an API for
/// anything else.
pub mod fuzz {
    pub use crate::h1::chunked::ChunkedParser;
    pub use crate::h1::head::{analyze_request, write_request_head, MAX_HEADERS};
    pub use crate::hbone::authority::parse as hbone_authority;
    pub use crate::trace::{check_tracestate, parse_b3_multi, parse_b3_single, parse_traceparent};
    pub use crate::trailers::{filter_section, line_goes_on};

    /// What the node sends upstream in place of a request's trace headers (tracing on,
    /// sampling drawn as `sampled`): `crate::trace::Started::propagation`.
    pub fn trace_propagation(
        headers: &http::HeaderMap,
        sampled: bool,
    ) -> Vec<(http::HeaderName, http::HeaderValue)> {
        crate::trace::Started::new(headers.into(), &http::Method::GET, || sampled)
            .propagation()
            .into_vec()
    }

    /// The first listener of a config, served in process (cargo-fuzz builds with
    /// `--cfg fuzzing`): each [`Listener::connect`] is one client connection through the
    /// protocol sniff into the HTTP/1 or HTTP/2 server, as `crate::testing` serves them.
    #[cfg(fuzzing)]
    pub struct Listener(std::sync::Arc<arc_swap::ArcSwap<crate::context::WorkerView>>);

    #[cfg(fuzzing)]
    impl Listener {
        pub fn new(yaml: &str) -> Listener {
            Listener(crate::testing::view(yaml))
        }

        /// Serves a new connection on the current tokio runtime; returns the client's end.
        pub fn connect(&self) -> tokio::io::DuplexStream {
            crate::testing::http_client(crate::testing::context(&self.0))
        }
    }
}
