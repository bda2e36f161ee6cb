//! The two-way copy every relay in user space runs on (the L4 relay of `tcp`, HBONE's
//! streams in `hbone`, upgraded HTTP connections in `h1`): its buffers and idle timeout, how
//! it ended, the byte counts, and turning a close into a reset.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use crate::idle::{idle, Activity, ActivityTap};
use crate::tap::{Tap, Tapped};

/// Counts the bytes read through a socket, so totals are known even when the relay ends in error.
#[derive(Default)]
pub struct ByteCount(pub u64);

impl Tap for ByteCount {
    fn on_read(&mut self, bytes: &[u8]) {
        self.0 += bytes.len() as u64;
    }
}

/// Make dropping the socket send a RST instead of a FIN.
pub fn reset_on_close(stream: &TcpStream) {
    let _ = socket2::SockRef::from(stream).set_linger(Some(std::time::Duration::ZERO));
}

/// Each direction's buffer of a relay in user space, unless the per-connection buffer
/// limit asks for less.
const RELAY_BUFFER: usize = 64 * 1024;

/// Each direction's buffer for a relay under `limits`.
fn relay_buffer(limits: &flatmesh_config::Limits) -> usize {
    RELAY_BUFFER.min(limits.per_connection_buffer_bytes / 2)
}

/// How a relay in user space runs: its buffers and its idle timeout.
#[derive(Clone, Copy)]
pub struct Relay {
    /// Each direction's buffer.
    pub buffer: usize,
    /// Nothing moved either way for this long: the relay ends (`limits.tcp_idle_timeout`).
    pub idle: Duration,
}

impl Relay {
    /// A relay under `limits` (a listener's: `Limits::for_listener`).
    pub fn of(limits: &flatmesh_config::Limits) -> Relay {
        Relay {
            buffer: relay_buffer(limits),
            idle: limits.tcp_idle_timeout,
        }
    }
}

/// How a two-way copy ended.
#[derive(Debug)]
pub enum RelayEnd {
    /// Both sides closed (each FIN was passed on).
    Closed,
    /// Nothing moved either way for the idle timeout.
    Idle,
    /// One side reset or failed.
    Failed(std::io::Error),
}

/// Copies bytes both ways between `a` and `b` until both sides are done, or until no byte
/// has moved for `relay.idle`. A FIN on one side becomes a shutdown(WR) on the other. The
/// TCP relay and upgraded HTTP connections (`crate::h1`) both run on it.
pub async fn copy_until_idle<A, B>(a: &mut A, b: &mut B, relay: Relay) -> RelayEnd
where
    A: AsyncRead + AsyncWrite + Unpin + ?Sized,
    B: AsyncRead + AsyncWrite + Unpin + ?Sized,
{
    // Both directions pass through `a` (read from it one way, written to it the other), so
    // its tap sees every byte moved.
    let activity = Arc::new(Activity::default());
    let mut a = Tapped {
        inner: a,
        tap: ActivityTap(activity.clone()),
    };
    tokio::select! {
        copied = tokio::io::copy_bidirectional_with_sizes(&mut a, b, relay.buffer, relay.buffer) => match copied {
            Ok(_) => RelayEnd::Closed,
            Err(err) => RelayEnd::Failed(err),
        },
        _ = idle(&activity, relay.idle) => RelayEnd::Idle,
    }
}
