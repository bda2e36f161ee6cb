//! Single-flight dials: while a connection to a key (an endpoint, a peer node) is being
//! opened, the requests that find no connection for the same key wait for that dial instead
//! of each opening their own (a burst of new requests would otherwise cost a TCP, TLS and
//! HTTP/2 handshake apiece), and share its failure. Used by the HTTP/2 clusters' client and
//! by the HBONE tunnel pool.

use std::collections::HashMap;
use std::hash::Hash;

use parking_lot::Mutex;
use tokio::sync::watch;

/// The dials in progress, per key, each with its outcome for the requests waiting on it.
pub struct Dials<K, E> {
    dialing: Mutex<HashMap<K, watch::Receiver<Outcome<E>>>>,
}

/// How a dial ended (`None` until it does): on success the waiters look for the connection
/// again.
type Outcome<E> = Option<Result<(), E>>;

/// What a request that found no connection does.
pub enum Turn<'a, K: Eq + Hash, E> {
    /// No dial was in progress: this request dials, and reports how it went with
    /// [`Dial::finish`].
    Lead(Dial<'a, K, E>),
    /// Another request's dial ended: on `Ok` (or when that request went away before it
    /// ended), look for a connection again; on `Err`, that is this request's failure too.
    Waited(Result<(), E>),
}

/// The one dial in progress to a key: taken out of the map when it ends or is cancelled, and
/// its outcome sent to the waiting requests (dropped unsent when cancelled, so that they
/// look again and one of them dials).
pub struct Dial<'a, K: Eq + Hash, E> {
    dials: &'a Dials<K, E>,
    key: K,
    outcome: Option<Result<(), E>>,
    tell: watch::Sender<Outcome<E>>,
}

impl<K: Eq + Hash, E> Default for Dials<K, E> {
    fn default() -> Self {
        Dials {
            dialing: Mutex::default(),
        }
    }
}

impl<K: Eq + Hash + Clone, E: Clone> Dials<K, E> {
    /// This request's turn for `key`: lead a new dial, or wait for the one in progress
    /// (bounded by the dialer's own connect and handshake timeouts).
    pub async fn turn(&self, key: K) -> Turn<'_, K, E> {
        let in_progress = {
            let mut dialing = self.dialing.lock();
            match dialing.get(&key) {
                Some(dial) => Ok(dial.clone()),
                None => {
                    let (tell, waiting) = watch::channel(None);
                    dialing.insert(key.clone(), waiting);
                    Err(tell)
                }
            }
        };
        match in_progress {
            Ok(mut dial) => match dial.wait_for(Option::is_some).await {
                Ok(outcome) => Turn::Waited(outcome.clone().unwrap_or(Ok(()))),
                // The dialer was cancelled (its request went away): look again.
                Err(_) => Turn::Waited(Ok(())),
            },
            Err(tell) => Turn::Lead(Dial {
                dials: self,
                key,
                outcome: None,
                tell,
            }),
        }
    }
}

impl<K: Eq + Hash, E> Dial<'_, K, E> {
    /// How the dial ended, for the requests waiting on it (sent when the dial is dropped,
    /// after the caller has pooled what it opened).
    pub fn finish(&mut self, outcome: Result<(), E>) {
        self.outcome = Some(outcome);
    }
}

impl<K: Eq + Hash, E> Drop for Dial<'_, K, E> {
    fn drop(&mut self) {
        // Out of the map before the waiters wake: one that finds no room must start a new
        // dial, not join this finished one.
        self.dials.dialing.lock().remove(&self.key);
        if let Some(outcome) = self.outcome.take() {
            let _ = self.tell.send(Some(outcome));
        }
    }
}
