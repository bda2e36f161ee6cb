//! The per-PU daemon (`flatmesh pu agent`): keep this PU's rules in step with the global port
//! table, claim ports the bind hook could not see (bound as port 0), and release this PU's ports
//! once nothing on it holds them. Claiming a port at bind() and refusing another PU's port are the
//! kernel's (the bind hook, `table`), not the agent's: they work while no agent runs. It is
//! control plane only: packets never pass through it, and the rules it wrote keep working while
//! it is down or restarting.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::backend::PuBackend;
use crate::config::SplitConfig;
use crate::error::{PuError, Result};
use crate::probe;
use crate::rules::{self, Desired};
use crate::scan;
use crate::shm_proof::ProofService;
use crate::table::{PortTable, TableState};
use crate::topology::Topology;

/// What one pass of the agent did.
#[derive(Debug, Clone, Default)]
pub struct TickReport {
    pub listening: usize,
    /// Ports listening here that no bind had claimed (bound as port 0), now this PU's.
    pub claimed: Vec<u16>,
    pub released: Vec<u16>,
    /// Ports this PU listens on that another PU owns (only possible for ports bound before
    /// the hook was attached, or bound as port 0 after another PU bound them explicitly).
    pub conflicts: Vec<(u16, String)>,
    /// Ports owned by other PUs, mapped by this PU's rules.
    pub remote: usize,
    pub rules_changed: bool,
    pub full_rebuild: bool,
    pub rule_update: Duration,
}

pub struct Agent {
    config: SplitConfig,
    topo: Topology,
    me: usize,
    table: PortTable,
    applied: Option<Desired>,
    /// `agent-<pu>.lock` in the table directory, flocked while this agent runs: one agent per PU.
    /// The kernel drops the lock when the process dies, so a crashed agent never blocks its
    /// successor.
    instance: Option<File>,
    /// The network namespace the agent was started in (checked by `start` to be its PU's);
    /// every pass checks it is still there before touching a rule.
    netns: Option<(u64, u64)>,
    /// This PU's ports that nothing listened on at the last pass. A port is probed (and
    /// released if free) only on its second such pass in a row, which leaves an app that
    /// closes a listener and binds the port again a poll interval to do so undisturbed.
    unheld: BTreeSet<u16>,
}

impl Agent {
    pub fn new(config: &SplitConfig, pu: &str) -> Result<Agent> {
        let me = config.pu_index(pu).ok_or_else(|| PuError::Config {
            path: "--pu".to_string(),
            message: format!(
                "no PU named `{pu}` in namespace `{}`; the PUs are: {}",
                config.namespace,
                config.pu_names().join(", ")
            ),
        })?;
        Ok(Agent {
            topo: Topology::new(config),
            table: PortTable::new(config),
            config: config.clone(),
            me,
            applied: None,
            instance: None,
            netns: None,
            unheld: BTreeSet::new(),
        })
    }

    pub fn pu(&self) -> &str {
        &self.topo.pus[self.me]
    }

    /// Checks that the calling thread is on this agent's PU, takes the PU's agent lock (failing if
    /// another agent of this PU runs), registers, and rebuilds this PU's rules from the table as
    /// it is now (after a restart: the table the previous run left). Calling it
    /// again on a started agent resynchronises it.
    pub fn start(&mut self, backend: &dyn PuBackend) -> Result<TickReport> {
        self.register(backend)?;
        self.applied = None;
        self.tick()
    }

    /// The first half of `start`: the PU check and the agent lock, without a pass.
    fn register(&mut self, backend: &dyn PuBackend) -> Result<()> {
        backend.check_on(self.me)?;
        self.netns = Some(
            crate::netns::current_id()
                .map_err(|e| PuError::io("cannot identify this thread's network namespace", e))?,
        );
        if self.instance.is_none() {
            self.instance = Some(self.lock_instance()?);
        }
        Ok(())
    }

    /// Takes the PU's agent lock and writes this process's pid into it (for `status`).
    fn lock_instance(&self) -> Result<File> {
        let dir = self.config.table_dir();
        let path = self.table.agent_file(self.pu());
        let io = |e| PuError::StateIo {
            path: path.clone(),
            source: e,
        };
        std::fs::create_dir_all(&dir).map_err(io)?;
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(io)?;
        match file.try_lock() {
            Ok(()) => {
                let mut file = file;
                file.set_len(0).map_err(io)?;
                write!(file, "{}", std::process::id()).map_err(io)?;
                Ok(file)
            }
            Err(TryLockError::WouldBlock) => {
                let pid = self
                    .table
                    .agent_pid(self.pu())
                    .map_or(String::new(), |p| format!(" (pid {p})"));
                Err(PuError::AgentRunning {
                    pu: self.pu().to_string(),
                    pid,
                })
            }
            Err(TryLockError::Error(e)) => Err(io(e)),
        }
    }

    /// One pass: scan, claim ports bound as port 0, release ports nothing holds, rewrite rules.
    pub fn tick(&mut self) -> Result<TickReport> {
        // Never write a rule from anywhere but the PU the agent was started on.
        let here = crate::netns::current_id().ok();
        if self.netns.is_none() || here != self.netns {
            return Err(PuError::NotOnPu {
                pu: self.pu().to_string(),
                netns: self.topo.netns(self.me),
            });
        }
        let listening: BTreeSet<u16> = scan::listening_ports()?;
        let pu = self.pu().to_string();
        let before = self.table.read()?;
        let plan = before.plan(&pu, &listening);
        let mut report = TickReport {
            listening: listening.len(),
            conflicts: plan.conflicts,
            ..TickReport::default()
        };
        for port in plan.claim {
            match self.table.claim(port, &pu)? {
                None => report.claimed.push(port),
                Some(owner) => report.conflicts.push((port, owner)),
            }
        }
        let unheld: BTreeSet<u16> = plan.maybe_released.into_iter().collect();
        for &port in unheld.intersection(&self.unheld) {
            // Held by the probe while it is released, so no bind here slips in between.
            let probe = probe::hold_if_free(port)
                .map_err(|e| PuError::io(format!("cannot probe port {port} on this PU"), e))?;
            if probe.is_some() && self.table.release(port, &pu)? {
                report.released.push(port);
            }
        }
        self.unheld = unheld;
        for port in &report.released {
            self.unheld.remove(port);
        }
        for (port, owner) in &report.conflicts {
            tracing::warn!(port, owner, pu = %pu, "a process on this PU listens on a port another PU owns (bound before the bind hook was attached, or bound as port 0); connections to localhost:{port} keep going to `{owner}`. Stop one of the two listeners");
        }
        let state = if report.claimed.is_empty() && report.released.is_empty() {
            before
        } else {
            self.table.read()?
        };
        self.sync(&state, &mut report)?;
        Ok(report)
    }

    /// Brings the rules in line with `state`.
    fn sync(&mut self, state: &TableState, report: &mut TickReport) -> Result<()> {
        let desired = Desired::from_table(&self.topo, self.me, state, &self.config.intercept);
        report.remote = desired.remote.len();

        let started = Instant::now();
        let script = match &self.applied {
            Some(applied) if applied.proxy_owner == desired.proxy_owner => {
                rules::delta_script(&self.topo, &applied.remote, &desired.remote)
            }
            _ => {
                report.full_rebuild = true;
                Some(rules::full_script(
                    &self.topo,
                    self.me,
                    &self.config.intercept,
                    &desired,
                ))
            }
        };
        if let Some(script) = script {
            if let Err(e) = rules::apply(&script) {
                if report.full_rebuild {
                    self.applied = None;
                    return Err(e);
                }
                // Someone changed the table behind our back; rebuild it whole.
                tracing::warn!(error = %e, "incremental rule update failed; rebuilding the table");
                report.full_rebuild = true;
                rules::apply(&rules::full_script(
                    &self.topo,
                    self.me,
                    &self.config.intercept,
                    &desired,
                ))?;
            }
            report.rules_changed = true;
        }
        report.rule_update = started.elapsed();
        self.applied = Some(desired);
        Ok(())
    }

    /// Deregisters the agent. Rules and the table stay: traffic keeps flowing, binds are still
    /// checked by the hook, and the next agent of this PU picks up where this one stopped.
    pub fn stop(&mut self) -> Result<()> {
        if let Some(file) = self.instance.take() {
            let path = self.table.agent_file(self.pu());
            file.set_len(0)
                .map_err(|e| PuError::StateIo { path, source: e })?;
        }
        Ok(())
    }

    /// Runs the agent on the calling thread until `stop` is set: enters the PU, starts, and ticks
    /// every poll interval. Failed passes are logged and retried.
    pub fn run(
        config: &SplitConfig,
        pu: &str,
        backend: &dyn PuBackend,
        stop: &AtomicBool,
    ) -> Result<()> {
        let mut agent = Agent::new(config, pu)?;
        backend.enter_thread(agent.me)?;
        // hetero-socket's proof service for this PU's acceptors (`shm_proof`), bound once this
        // agent holds the PU's lock (it replaces a dead service's socket) and before the first
        // pass claims a port, so that it is there for the first connection between PUs. It
        // serves on a thread of its own that inherits this thread's PU, and stops with the agent.
        agent.register(backend)?;
        let service = match ProofService::bind(config, agent.me, backend) {
            Ok(service) => Some(service),
            Err(e) => {
                tracing::warn!(pu, error = %e, "no shm proof service: connections from other PUs stay on TCP");
                None
            }
        };
        let first = agent.start(backend)?;
        tracing::info!(
            pu,
            listening = first.listening,
            remote = first.remote,
            "pu agent started"
        );
        std::thread::scope(|scope| {
            if let Some(service) = service {
                scope.spawn(move || service.serve(stop));
            }
            agent.poll(config, pu, stop)
        })
    }

    /// The agent's loop: a pass every poll interval until `stop` is set.
    fn poll(&mut self, config: &SplitConfig, pu: &str, stop: &AtomicBool) -> Result<()> {
        let interval = Duration::from_millis(config.poll_interval_ms);
        let mut last_error: Option<String> = None;
        while !stop.load(Ordering::Relaxed) {
            std::thread::sleep(interval);
            match self.tick() {
                Ok(report) => {
                    last_error = None;
                    if !report.claimed.is_empty() || !report.released.is_empty() {
                        tracing::info!(pu, claimed = ?report.claimed, released = ?report.released, remote = report.remote, rule_update_us = report.rule_update.as_micros() as u64, "port table changed");
                    }
                }
                Err(e) => {
                    // Log a failure once, not every poll.
                    let text = e.to_string();
                    if last_error.as_deref() != Some(&text) {
                        tracing::error!(pu, error = %text, "agent pass failed; retrying");
                    }
                    last_error = Some(text);
                }
            }
        }
        self.stop()
    }
}

static STOP_SIGNALLED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop_signal(_: libc::c_int) {
    STOP_SIGNALLED.store(true, Ordering::Relaxed);
}

/// A flag that SIGINT or SIGTERM sets, for `Agent::run` in a daemon process.
pub fn stop_on_signals() -> &'static AtomicBool {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(
            libc::SIGINT,
            on_stop_signal as *const () as libc::sighandler_t,
        );
        libc::signal(
            libc::SIGTERM,
            on_stop_signal as *const () as libc::sighandler_t,
        );
    }
    &STOP_SIGNALLED
}
