//! The per-PU daemon (`flatmesh pu agent`): watch this PU's listening ports, keep the global port
//! table up to date, hold placeholder sockets for the ports other PUs own, and keep this PU's
//! rules in step with the table. It is control plane only: packets never pass through it, and the
//! rules it wrote keep working while it is down or restarting.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions, TryLockError};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::backend::PuBackend;
use crate::config::SplitConfig;
use crate::error::{PuError, Result};
use crate::placeholder::{raise_fd_limit, Placeholders};
use crate::rules::{self, Desired};
use crate::scan;
use crate::table::{PortTable, TableState};
use crate::topology::Topology;

/// What one pass of the agent did.
#[derive(Debug, Clone, Default)]
pub struct TickReport {
    pub listening: usize,
    pub claimed: Vec<u16>,
    pub released: Vec<u16>,
    /// Ports this PU listens on that another PU already held (bound within one poll interval).
    pub conflicts: Vec<(u16, String)>,
    /// Ports owned by other PUs, mapped by this PU's rules.
    pub remote: usize,
    /// Ports owned elsewhere that a local socket holds, so no placeholder could be bound.
    pub unreserved: Vec<u16>,
    pub rules_changed: bool,
    pub full_rebuild: bool,
    pub rule_update: Duration,
}

pub struct Agent {
    config: SplitConfig,
    topo: Topology,
    me: usize,
    table: PortTable,
    placeholders: Placeholders,
    applied: Option<Desired>,
    /// `agent-<pu>.lock` in the table directory, flocked while this agent runs: one agent per PU.
    /// The kernel drops the lock when the process dies, so a crashed agent never blocks its
    /// successor.
    instance: Option<File>,
    /// The network namespace the agent was started in (checked by `start` to be its PU's);
    /// every pass checks it is still there before touching a rule.
    netns: Option<(u64, u64)>,
    /// Ports owned elsewhere that could not be reserved at the last pass (logged on change).
    unreserved: Vec<u16>,
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
            table: PortTable::new(&config.table_dir()),
            config: config.clone(),
            me,
            placeholders: Placeholders::default(),
            applied: None,
            instance: None,
            netns: None,
            unreserved: Vec::new(),
        })
    }

    pub fn pu(&self) -> &str {
        &self.topo.pus[self.me]
    }

    /// Checks that the calling thread is on this agent's PU, takes the PU's agent lock (failing if
    /// another agent of this PU runs), registers, and rebuilds this PU's rules and placeholders
    /// from the table as it is now (after a restart: the table the previous run left). Calling it
    /// again on a started agent resynchronises it.
    pub fn start(&mut self, backend: &dyn PuBackend) -> Result<TickReport> {
        backend.check_on(self.me)?;
        self.netns = Some(
            crate::netns::current_id()
                .map_err(|e| PuError::io("cannot identify this thread's network namespace", e))?,
        );
        if self.instance.is_none() {
            self.instance = Some(self.lock_instance()?);
        }
        raise_fd_limit(70_000);
        let pu = self.pu().to_string();
        let pid = std::process::id();
        self.table.update(|s| {
            s.agents.insert(pu, pid);
        })?;
        self.applied = None;
        self.tick()
    }

    fn lock_instance(&self) -> Result<File> {
        let dir = self.config.table_dir();
        let path = dir.join(format!("agent-{}.lock", self.pu()));
        let io = |e| PuError::TableIo {
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
            Ok(()) => Ok(file),
            Err(TryLockError::WouldBlock) => {
                let pid = self
                    .table
                    .read()
                    .ok()
                    .and_then(|s| s.agents.get(self.pu()).copied())
                    .map_or(String::new(), |p| format!(" (pid {p})"));
                Err(PuError::AgentRunning {
                    pu: self.pu().to_string(),
                    pid,
                })
            }
            Err(TryLockError::Error(e)) => Err(io(e)),
        }
    }

    /// One pass: scan, claim, reserve, rewrite rules.
    pub fn tick(&mut self) -> Result<TickReport> {
        // Never write a rule from anywhere but the PU the agent was started on.
        let here = crate::netns::current_id().ok();
        if self.netns.is_none() || here != self.netns {
            return Err(PuError::NotOnPu {
                pu: self.pu().to_string(),
                netns: self.topo.netns(self.me),
            });
        }
        let listening: BTreeSet<u16> = scan::listening_ports()?
            .into_iter()
            .filter(|p| !self.placeholders.holds(*p))
            .collect();
        let pu = self.pu().to_string();
        let (outcome, state) = self.table.update(|s| s.claim(&pu, &listening))?;
        let mut report = TickReport {
            listening: listening.len(),
            claimed: outcome.claimed,
            released: outcome.released,
            conflicts: outcome.conflicts,
            ..TickReport::default()
        };
        for (port, owner) in &report.conflicts {
            tracing::warn!(port, owner, pu = %pu, "a process on this PU listens on a port another PU already holds; connections to localhost:{port} keep going to `{owner}`. Stop one of the two listeners");
        }
        self.sync(&state, &mut report)?;
        Ok(report)
    }

    /// Brings placeholders and rules in line with `state`.
    fn sync(&mut self, state: &TableState, report: &mut TickReport) -> Result<()> {
        let desired = Desired::from_table(&self.topo, self.me, state, &self.config.intercept);
        report.remote = desired.remote.len();

        let stale: Vec<u16> = self
            .placeholders
            .ports()
            .filter(|p| !desired.remote.contains_key(p))
            .collect();
        for port in stale {
            self.placeholders.release(port);
        }
        let mut first_error = None;
        for &port in desired.remote.keys() {
            if let Err(e) = self.placeholders.reserve(port) {
                report.unreserved.push(port);
                first_error.get_or_insert(e);
            }
        }
        if report.unreserved != self.unreserved {
            if let Some(e) = first_error {
                let hint = if e.raw_os_error() == Some(libc::EMFILE) {
                    "this agent is out of file descriptors (one per port owned elsewhere); raise its open-file limit (ulimit -n)"
                } else {
                    "a socket on this PU already holds them, so binds here are not refused for these ports"
                };
                tracing::warn!(pu = %self.pu(), count = report.unreserved.len(), first = report.unreserved[0], error = %e, "cannot reserve ports owned by other PUs: {hint}");
            }
            self.unreserved = report.unreserved.clone();
        }

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

    /// Deregisters the agent. Rules and the table stay: traffic keeps flowing, and the next agent
    /// of this PU picks up where this one stopped. Placeholders close with the process.
    pub fn stop(&mut self) -> Result<()> {
        let pu = self.pu().to_string();
        let pid = std::process::id();
        self.table.update(|s| {
            if s.agents.get(&pu) == Some(&pid) {
                s.agents.remove(&pu);
            }
        })?;
        self.instance = None;
        Ok(())
    }

    pub fn placeholders(&self) -> usize {
        self.placeholders.len()
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
        let first = agent.start(backend)?;
        tracing::info!(
            pu,
            listening = first.listening,
            remote = first.remote,
            "pu agent started"
        );
        let interval = Duration::from_millis(config.poll_interval_ms);
        let mut last_error: Option<String> = None;
        while !stop.load(Ordering::Relaxed) {
            std::thread::sleep(interval);
            match agent.tick() {
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
        agent.stop()
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
