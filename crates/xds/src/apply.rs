//! [`crate::client::Apply`] for the real node proxy: the first config starts it, every later one
//! is a zero-drop reload (`Node::reload`, the same swap a file reload uses).

use std::sync::Arc;

use flatmesh_config::Config;
use flatmesh_proxy::{ConfigSource, Node};
use parking_lot::Mutex;

/// The node the client drives; shared so the CLI (and tests) can reach it and shut it down.
pub type SharedNode = Arc<Mutex<Option<Node>>>;

pub struct NodeApply {
    node: SharedNode,
}

impl NodeApply {
    pub fn new() -> (NodeApply, SharedNode) {
        let node: SharedNode = Arc::new(Mutex::new(None));
        (NodeApply { node: node.clone() }, node)
    }
}

impl crate::client::Apply for NodeApply {
    fn apply(&mut self, config: Config) -> Result<(), String> {
        let mut node = self.node.lock();
        match node.as_ref() {
            Some(running) => running.reload(config).map_err(|e| e.to_string()),
            None => {
                *node = Some(Node::start(config, ConfigSource::Inline).map_err(|e| e.to_string())?);
                Ok(())
            }
        }
    }
}
