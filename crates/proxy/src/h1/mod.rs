//! flatmesh's own HTTP/1.x codec and connection handling: the proxy's hot path.
//! HTTP/2 is on the `h2` crate (`crate::h2`); both share the rule program and replies of
//! `crate::l7`.

pub mod body;
pub mod chunked;
pub mod client;
mod conn;
pub mod head;
pub mod pool;

pub use conn::serve;
pub(crate) use conn::IDLE_BUFFER;
