//! The node's graceful drain (SIGTERM, SIGINT, `POST /drain`): one signal, set once, that every
//! part of the node reads. When it is set:
//! - `/ready` answers 503, so a load balancer or Kubernetes takes the node out of rotation;
//! - the workers stop accepting (their listening sockets close);
//! - HTTP/1 connections answer the request in hand with `Connection: close` and close, and a
//!   connection that sits idle between requests closes at once;
//! - HTTP/2 connections (and HBONE tunnels) get GOAWAY: streams already open finish, no new
//!   one is taken;
//! - tcp relays and spliced connections carry on until they end by themselves.
//!
//! The node owner then waits up to `drain_timeout` for the open connections to end and stops;
//! what is still open at that point is closed, and each worker logs how many it closed.

use tokio::sync::watch;

/// The writing side, held by the node.
pub(crate) struct DrainSignal(watch::Sender<bool>);

/// The reading side, one per connection (a cheap clone).
#[derive(Clone)]
pub struct Draining(watch::Receiver<bool>);

impl DrainSignal {
    pub fn new() -> DrainSignal {
        DrainSignal(watch::channel(false).0)
    }

    /// Starts the drain. True the first time, false when it had started already.
    pub fn start(&self) -> bool {
        !self.0.send_replace(true)
    }

    pub fn started(&self) -> bool {
        *self.0.borrow()
    }

    pub fn subscribe(&self) -> Draining {
        Draining(self.0.subscribe())
    }
}

impl Draining {
    /// The drain has begun.
    pub fn now(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves once the drain has begun (at once if it has). Never resolves if the node
    /// goes away without draining.
    pub async fn begun(&mut self) {
        if self.0.wait_for(|started| *started).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn every_reader_sees_the_drain_once_it_starts() {
        let signal = DrainSignal::new();
        let mut early = signal.subscribe();
        assert!(!early.now());
        let waiting = tokio::spawn(async move { early.begun().await });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        assert!(signal.start(), "the first start starts it");
        assert!(!signal.start(), "a second start is a no-op");
        waiting.await.unwrap();
        let mut late = signal.subscribe();
        assert!(late.now());
        late.begun().await;
    }
}
