//! [`crate::client::Apply`] for a node proxy: the first config starts it, every later one reloads
//! it (in flatmesh's proxy, the same zero-drop swap a file reload uses). The xds crate does not
//! know the proxy: whoever wires the two (the `flatmesh node --xds` command, a test) says how to
//! start a node and how to reload one.

use std::sync::Arc;

use flatmesh_config::Config;
use parking_lot::Mutex;

/// The node the client drives, `None` until the first config started it; shared so that the
/// caller can reach it (its admin address) and shut it down.
pub type SharedNode<N> = Arc<Mutex<Option<N>>>;

type Start<N> = Box<dyn FnMut(Config) -> Result<N, String> + Send>;
type Reload<N> = Box<dyn FnMut(&N, Config) -> Result<(), String> + Send>;

pub struct StartThenReload<N> {
    node: SharedNode<N>,
    start: Start<N>,
    reload: Reload<N>,
}

impl<N: Send + 'static> StartThenReload<N> {
    /// `start` makes a running node from its first config; `reload` hands a running node a new
    /// one. Either's error is what the client NACKs with.
    pub fn new(
        start: impl FnMut(Config) -> Result<N, String> + Send + 'static,
        reload: impl FnMut(&N, Config) -> Result<(), String> + Send + 'static,
    ) -> (StartThenReload<N>, SharedNode<N>) {
        let node: SharedNode<N> = Arc::new(Mutex::new(None));
        let apply = StartThenReload {
            node: node.clone(),
            start: Box::new(start),
            reload: Box::new(reload),
        };
        (apply, node)
    }
}

impl<N: Send + 'static> crate::client::Apply for StartThenReload<N> {
    fn apply(&mut self, config: Config) -> Result<(), String> {
        let mut node = self.node.lock();
        match node.as_ref() {
            Some(running) => (self.reload)(running, config),
            None => {
                *node = Some((self.start)(config)?);
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::client::Apply as _;

    /// A stand-in node: the configs it was started with and reloaded with.
    struct Fake {
        configs: Mutex<Vec<usize>>,
    }

    fn config(workers: usize) -> Config {
        let mut c = crate::bootstrap::empty_config();
        c.workers = Some(workers);
        c
    }

    #[test]
    fn the_first_config_starts_the_node_and_later_ones_reload_it() {
        let starts = Arc::new(Mutex::new(0));
        let counted = starts.clone();
        let (mut apply, node) = StartThenReload::new(
            move |c: Config| {
                *counted.lock() += 1;
                match c.workers {
                    Some(0) => Err("no workers".to_string()),
                    w => Ok(Fake {
                        configs: Mutex::new(vec![w.unwrap_or(1)]),
                    }),
                }
            },
            |n: &Fake, c: Config| match c.workers {
                Some(w) if w > 8 => Err(format!("{w} workers is too many")),
                w => {
                    n.configs.lock().push(w.unwrap_or(1));
                    Ok(())
                }
            },
        );
        assert_eq!(apply.apply(config(0)).unwrap_err(), "no workers");
        assert!(node.lock().is_none(), "a failed start leaves no node");
        apply.apply(config(1)).unwrap();
        apply.apply(config(2)).unwrap();
        assert_eq!(apply.apply(config(9)).unwrap_err(), "9 workers is too many");
        assert_eq!(
            *starts.lock(),
            2,
            "started once more after the failure, then reloaded"
        );
        let node = node.lock();
        assert_eq!(*node.as_ref().unwrap().configs.lock(), [1, 2]);
    }
}
