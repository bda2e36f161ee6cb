//! A split namespace brought up for a while: the PUs, agents running as threads (each on its
//! own PU), extra processes, and a guard that removes everything when dropped, also on panic.
//! The demo, the tests and the benchmarks use it; `flatmesh pu up`/`agent`/`down` are the
//! long-running equivalents.

use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::agent::Agent;
use crate::backend::{for_config, remove_netns, run_on, PuBackend};
use crate::config::SplitConfig;
use crate::error::{PuError, Result};
use crate::table::{PortTable, TableState};

struct AgentThread {
    pu: usize,
    stop: Arc<AtomicBool>,
    handle: JoinHandle<Result<()>>,
}

pub struct Pod {
    pub config: SplitConfig,
    pub backend: Arc<dyn PuBackend>,
    agents: Vec<AgentThread>,
    /// Network namespaces outside the pod made for it (e.g. the demo's "rest of the cluster").
    extra_netns: Vec<String>,
    children: Vec<Child>,
}

impl Pod {
    /// Creates the PUs (removing leftovers of an earlier run of the same namespace first).
    pub fn up(config: SplitConfig) -> Result<Pod> {
        let backend = for_config(&config);
        Pod::with_backend(config, backend)
    }

    /// As `up`, on a given backend.
    pub fn with_backend(config: SplitConfig, backend: Arc<dyn PuBackend>) -> Result<Pod> {
        let _ = std::fs::remove_dir_all(config.table_dir());
        let pod = Pod {
            config,
            backend,
            agents: Vec::new(),
            extra_netns: Vec::new(),
            children: Vec::new(),
        };
        pod.backend.up()?;
        Ok(pod)
    }

    pub fn pu(&self, name: &str) -> Result<usize> {
        self.config.pu_index(name).ok_or_else(|| PuError::Config {
            path: "pod".into(),
            message: format!("no PU named `{name}`"),
        })
    }

    pub fn table(&self) -> PortTable {
        PortTable::new(&self.config)
    }

    /// Starts the agent of PU `name` on its own thread.
    pub fn start_agent(&mut self, name: &str) -> Result<()> {
        let pu = self.pu(name)?;
        let stop = Arc::new(AtomicBool::new(false));
        let (config, backend, flag) = (
            self.config.clone(),
            Arc::clone(&self.backend),
            Arc::clone(&stop),
        );
        let name = name.to_string();
        let handle = std::thread::Builder::new()
            .name(format!("pu-agent-{name}"))
            .spawn(move || Agent::run(&config, &name, backend.as_ref(), &flag))
            .map_err(|e| PuError::io("cannot start an agent thread", e))?;
        self.agents.push(AgentThread { pu, stop, handle });
        Ok(())
    }

    /// Stops the agent of PU `name` (rules and table stay, as after a crash).
    pub fn stop_agent(&mut self, name: &str) -> Result<()> {
        let pu = self.pu(name)?;
        let (mine, rest): (Vec<_>, Vec<_>) = self.agents.drain(..).partition(|a| a.pu == pu);
        self.agents = rest;
        for a in mine {
            a.stop.store(true, Ordering::Relaxed);
            a.handle
                .join()
                .map_err(|_| PuError::io("agent thread", std::io::Error::other("panicked")))??;
        }
        Ok(())
    }

    /// Runs `f` on a thread inside PU `name`.
    pub fn on<T: Send>(&self, name: &str, f: impl FnOnce() -> T + Send) -> Result<T> {
        run_on(self.backend.as_ref(), self.pu(name)?, f)
    }

    /// Waits (bounded) until the port table satisfies `cond`, then one more poll interval plus
    /// margin so every agent has applied it. False on timeout.
    pub fn wait_for_table(&self, timeout: Duration, cond: impl Fn(&TableState) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        let table = self.table();
        while Instant::now() < deadline {
            if table.read().map(|s| cond(&s)).unwrap_or(false) {
                std::thread::sleep(Duration::from_millis(3 * self.config.poll_interval_ms + 50));
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    /// Keeps `child` to be killed when the pod goes.
    pub fn adopt(&mut self, child: Child) {
        self.children.push(child);
    }

    /// Records an extra network namespace to delete with the pod.
    pub fn adopt_netns(&mut self, netns: &str) {
        self.extra_netns.push(netns.to_string());
    }

    /// Tears everything down now (also done on drop).
    pub fn down(mut self) -> Result<()> {
        self.teardown()
    }

    fn teardown(&mut self) -> Result<()> {
        for a in self.agents.drain(..) {
            a.stop.store(true, Ordering::Relaxed);
            let _ = a.handle.join();
        }
        for mut c in self.children.drain(..) {
            let _ = c.kill();
            let _ = c.wait();
        }
        for ns in self.extra_netns.drain(..) {
            let _ = remove_netns(&ns);
        }
        let result = self.backend.down();
        let _ = std::fs::remove_dir_all(self.config.table_dir());
        result
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            tracing::warn!(error = %e, "pod clean-up failed; run `flatmesh pu cleanup`");
        }
    }
}
