//! flatmesh's own HTTP/1.x codec and connection handling: the proxy's hot path.
//! HTTP/2 stays on hyper (`crate::http`); both share the rule program and replies there.

pub mod body;
pub mod chunked;
pub mod client;
mod conn;
pub mod head;
pub mod pool;

pub use conn::serve;
pub(crate) use conn::IDLE_BUFFER;
