//! The codec-neutral L7 layer, FlatProxy's PPM chain between the parser and the deparser,
//! shared by the HTTP/1 codec (`crate::h1`) and the HTTP/2 codec (`crate::h2`), which are
//! thin adapters over it:
//! - [`decide`]: the rule program's match on a request, turned into an action (a local
//!   reply, or a cluster);
//! - [`retry`]: the one retry loop, driving each codec's tries at the upstream with the
//!   route's timeout and retry policy;
//! - [`error`]: the one error type of an upstream exchange (source, kind, retry safety,
//!   connection reuse);
//! - [`reply`]: the answers the proxy makes itself, failures included;
//! - [`headers`]: header edits on requests and responses held in `http` types;
//! - [`forward`]: a request held in `http` types sent to either kind of cluster;
//! - [`fault`]: a route's injected faults (abort, delay);
//! - [`mirror`]: a copy of a request sent fire-and-forget to a route's mirror cluster;
//! - [`log`]: the stats and the access log line of a finished request;
//! - [`body`]: the body of a response sent downstream;
//! - [`upload`]: the body of a request sent upstream (when it is complete, trailers checked).

pub(crate) mod body;
pub(crate) mod decide;
pub(crate) mod error;
pub(crate) mod fault;
pub(crate) mod forward;
pub(crate) mod headers;
pub(crate) mod log;
pub(crate) mod mirror;
pub(crate) mod reply;
pub(crate) mod retry;
pub(crate) mod upload;
