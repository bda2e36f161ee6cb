//! The body types every layer shares: what a request body sent upstream is, and what a body
//! fails with.

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt as _, Empty};

/// Why a body stopped early: the client's framing, or a peer went away.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Body of a request sent upstream: the client's body streamed through, or empty.
pub type UpstreamBody = UnsyncBoxBody<Bytes, BoxError>;

/// The body of a request that has none.
pub fn empty() -> UpstreamBody {
    Empty::<Bytes>::new()
        .map_err(|never| match never {})
        .boxed_unsync()
}
