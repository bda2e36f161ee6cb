//! The data-plane orchestrator (E3 §3.4): detects SmartNIC overload from heartbeats and migrates the
//! hottest microservice to the host; it also notices dead nodes and hands them to failover (§3.5).
//!
//! Detection, per heartbeat (O(1) each, so 50,000 servers every 50 ms is cheap):
//! - host starvation: a standing queue at the traffic manager (queue length at or above a threshold
//!   for several heartbeats in a row) while network bandwidth is under-used;
//! - microservice overload: an execution time more than 20% above its exponential moving average
//!   (the paper's "difference is negative and larger than 20%"), after a warm-up.
//!
//! Migration is cold, in the paper's steps: push the binary to the destination; tell the old node
//! to remove the instance from its execution engine, clean up local resources and migrate its working
//! state; on its confirmation, restart the instance on the new node and update connections. We
//! restart before publishing the new endpoints so proxies never route to an instance that is not
//! running yet.

use std::future::Future;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::endpoints::{snapshot, EndpointSink};
use crate::error::{ControlError, Result};
use crate::failover::{fail_nodes, Moved, Ring};
use crate::heartbeat::Heartbeat;
use crate::placement::State;
use crate::topology::NodeKind;

#[derive(Debug, Clone)]
pub struct DetectorConfig {
    /// Heartbeat period (E3: 50 ms).
    pub interval: Duration,
    /// Queue length that counts as "standing" when it persists.
    pub standing_queue: u16,
    /// Consecutive heartbeats with a standing queue before starvation is declared.
    pub standing_beats: u32,
    /// Bandwidth utilisation below which the network counts as under-used.
    pub bw_underused_pct: u8,
    /// Overload when exec > EMA x (1 + ratio); E3 found 20% empirically.
    pub overload_ratio: f64,
    /// Consecutive heartbeats a slot must be above that before overload is declared. E3 acts on
    /// one (1, the default); the live demo asks for a few, so that one noisy 50 ms window on a
    /// shared machine does not move a service.
    pub overload_beats: u32,
    /// EMA weight of a new sample.
    pub ema_alpha: f64,
    /// Samples per slot before the EMA is trusted.
    pub warmup: u32,
    /// A node is dead after this long without a heartbeat.
    pub dead_after: Duration,
}

impl Default for DetectorConfig {
    fn default() -> Self {
        DetectorConfig {
            interval: Duration::from_millis(50),
            standing_queue: 32,
            standing_beats: 3,
            bw_underused_pct: 50,
            overload_ratio: 0.2,
            overload_beats: 1,
            ema_alpha: 0.125,
            warmup: 5,
            dead_after: Duration::from_millis(150),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Signal {
    HostStarvation {
        node: usize,
        queue_len: u16,
        bw_util_pct: u8,
    },
    Overload {
        node: usize,
        slot: usize,
        exec_us: u16,
        ema_us: f64,
    },
    NodeDead {
        node: usize,
    },
}

/// One microservice slot's statistics: EMA of its execution time, samples seen, and how many
/// heartbeats in a row it has been above the overload threshold.
#[derive(Debug, Clone, Copy, Default)]
struct SlotStat {
    ema: f64,
    n: u32,
    over: u32,
}

/// Slots kept inline: most nodes run a handful of microservices, and at 50,000 servers the extra
/// pointer chase to a heap Vec per heartbeat is the largest cost of a decision round.
const INLINE_SLOTS: usize = 4;

#[derive(Debug, Clone)]
struct Health {
    last_seen: Instant,
    standing: u32,
    dead: bool,
    /// Per slot; slots past INLINE_SLOTS live in `more`.
    ema: [SlotStat; INLINE_SLOTS],
    more: Vec<SlotStat>,
}

impl Health {
    fn slot(&mut self, slot: usize) -> &mut SlotStat {
        if slot < INLINE_SLOTS {
            &mut self.ema[slot]
        } else {
            let k = slot - INLINE_SLOTS;
            if self.more.len() <= k {
                self.more.resize(k + 1, SlotStat::default());
            }
            &mut self.more[k]
        }
    }
}

/// Heartbeat bookkeeping and the two overload tests. Pure: no I/O, time passed in.
#[derive(Debug)]
pub struct Detector {
    pub cfg: DetectorConfig,
    health: Vec<Option<Health>>,
}

impl Detector {
    pub fn new(cfg: DetectorConfig, nodes: usize) -> Self {
        Detector {
            cfg,
            health: vec![None; nodes],
        }
    }

    /// Records one heartbeat; returns a signal when the node is overloaded.
    pub fn observe(&mut self, hb: &Heartbeat, now: Instant) -> Result<Option<Signal>> {
        let node = hb.node as usize;
        let slots = self.health.len();
        let Some(entry) = self.health.get_mut(node) else {
            return Err(ControlError::Heartbeat {
                node: hb.node,
                message: format!("unknown node (the cluster has {slots} nodes); the agent runs with a stale topology, restart it"),
            });
        };
        let h = entry.get_or_insert_with(|| Health {
            last_seen: now,
            standing: 0,
            dead: false,
            ema: [SlotStat::default(); INLINE_SLOTS],
            more: Vec::new(),
        });
        h.last_seen = now;
        h.dead = false;
        let cfg = &self.cfg;
        if hb.queue_len >= cfg.standing_queue && hb.bw_util_pct < cfg.bw_underused_pct {
            h.standing += 1;
        } else {
            h.standing = 0;
        }
        let mut signal = None;
        if h.standing >= cfg.standing_beats {
            h.standing = 0;
            signal = Some(Signal::HostStarvation {
                node,
                queue_len: hb.queue_len,
                bw_util_pct: hb.bw_util_pct,
            });
        }
        for (slot, exec) in hb.samples() {
            let st = h.slot(slot);
            let x = f64::from(exec);
            if st.n >= cfg.warmup && x > st.ema * (1.0 + cfg.overload_ratio) {
                st.over += 1;
                if st.over >= cfg.overload_beats && signal.is_none() {
                    st.over = 0;
                    signal = Some(Signal::Overload {
                        node,
                        slot,
                        exec_us: exec,
                        ema_us: st.ema,
                    });
                }
                // The EMA is the baseline of normal execution: a sample judged overloaded is not
                // folded into it, or the baseline would learn the very overload it is there to
                // detect (with alpha 1/8 it catches up with a 2x step in about 8 heartbeats, and
                // a confirmation window of `overload_beats` could then never fill).
                continue;
            }
            st.over = 0;
            st.ema = if st.n == 0 {
                x
            } else {
                st.ema + cfg.ema_alpha * (x - st.ema)
            };
            st.n = st.n.saturating_add(1);
        }
        Ok(signal)
    }

    /// Nodes whose heartbeats stopped, each reported once.
    pub fn sweep(&mut self, now: Instant) -> Vec<Signal> {
        let mut out = Vec::new();
        for (node, h) in self.health.iter_mut().enumerate() {
            if let Some(h) = h {
                if !h.dead && now.duration_since(h.last_seen) >= self.cfg.dead_after {
                    h.dead = true;
                    out.push(Signal::NodeDead { node });
                }
            }
        }
        out
    }

    /// The EMA of a slot's execution time in µs, once it has a sample.
    pub fn ema_us(&self, node: usize, slot: usize) -> Option<f64> {
        let h = self.health.get(node)?.as_ref()?;
        let st = if slot < INLINE_SLOTS {
            h.ema.get(slot)?
        } else {
            h.more.get(slot - INLINE_SLOTS)?
        };
        (st.n > 0).then_some(st.ema)
    }

    /// Forgets a node's statistics (its slots changed after a migration).
    pub fn reset(&mut self, node: usize) {
        if let Some(Some(h)) = self.health.get_mut(node) {
            h.ema = [SlotStat::default(); INLINE_SLOTS];
            h.more.clear();
            h.standing = 0;
        }
    }
}

/// How often an overloaded node that nothing can be moved off is noted in the log (a host: E3
/// migrates only off SmartNICs; or a SmartNIC whose migration found no room or failed).
const HOST_NOTE_EVERY: Duration = Duration::from_secs(5);

/// The primaries on `node`, in slot order (the order agents report execution times in).
pub fn slots(st: &State, node: usize) -> Vec<usize> {
    slots_in(st, node, SlotOrder::Workload)
}

/// Which order a node's slots are in: what its agent and the controller agree on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SlotOrder {
    /// The workload's instance order (`flatmesh place --json`), which the demo's agents know.
    #[default]
    Workload,
    /// By instance id (`NS/APP/STAGE-SHARD` on Kubernetes), which an agent can compute from
    /// the pods on its node alone.
    InstanceId,
}

/// The primaries on `node`, in `order`.
pub fn slots_in(st: &State, node: usize, order: SlotOrder) -> Vec<usize> {
    let mut on_node: Vec<usize> = (0..st.wl.instances.len())
        .filter(|&i| st.assign[i] == Some(node) && st.wl.instances[i].is_primary())
        .collect();
    if order == SlotOrder::InstanceId {
        on_node.sort_by(|&a, &b| st.wl.instances[a].id.cmp(&st.wl.instances[b].id));
    }
    on_node
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    PushBinary,
    Remove,
    Cleanup,
    MigrateState,
    Restart,
}

impl Step {
    pub fn name(self) -> &'static str {
        match self {
            Step::PushBinary => "push binary",
            Step::Remove => "remove from execution engine",
            Step::Cleanup => "clean up local resources",
            Step::MigrateState => "migrate working state",
            Step::Restart => "restart on new node",
        }
    }
}

/// The node runtimes, as the orchestrator drives them. The demo implements it with processes.
pub trait Runtime {
    fn step(
        &self,
        step: Step,
        instance: &str,
        from: &str,
        to: &str,
    ) -> impl Future<Output = std::result::Result<(), String>> + Send;

    /// Called once the new endpoints are published after a migration: the old node may now let
    /// go of whatever it kept to bridge the move (the demo's old process relays until then).
    fn connections_updated(
        &self,
        _instance: &str,
        _from: &str,
        _to: &str,
    ) -> impl Future<Output = ()> + Send {
        async {}
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum LogEntry {
    Detected(Signal),
    Migrated {
        instance: String,
        from: String,
        to: String,
        at: Duration,
    },
    NotMigrated {
        node: String,
        reason: String,
    },
    FailedOver {
        node: String,
        moved: Vec<Moved>,
        at: Duration,
    },
    Error(String),
}

impl LogEntry {
    /// Logs the entry; `moved_by` says how a move takes effect where this orchestrator runs
    /// ("endpoints pushed over EDS", "the pod is re-created on its new node").
    pub fn log(&self, moved_by: &str) {
        match self {
            LogEntry::Detected(signal) => tracing::warn!(?signal, "orchestrator: detected"),
            LogEntry::Migrated {
                instance, from, to, ..
            } => tracing::info!(%instance, %from, %to, "orchestrator: migrated; {moved_by}"),
            LogEntry::NotMigrated { node, reason } => {
                tracing::warn!(%node, %reason, "orchestrator: not migrated")
            }
            LogEntry::FailedOver { node, moved, .. } => tracing::warn!(
                %node,
                moved = moved.len(),
                "orchestrator: failed over; {moved_by}"
            ),
            LogEntry::Error(e) => tracing::error!(error = %e, "orchestrator"),
        }
    }
}

/// The control loop: heartbeats in, migrations and failovers out, endpoints published.
pub struct Controller<'a, R: Runtime, E: EndpointSink> {
    pub state: State<'a>,
    pub detector: Detector,
    pub ring: Ring,
    pub runtime: R,
    pub sink: E,
    pub version: u64,
    pub log: Vec<LogEntry>,
    /// Receives a copy of every log entry as it happens (the demo's live view).
    pub observer: Option<mpsc::UnboundedSender<LogEntry>>,
    started: Instant,
    /// No new migration from a node until its statistics have re-settled.
    cooldown_until: Vec<Instant>,
    /// The order of each node's slots in its heartbeats.
    pub slot_order: SlotOrder,
}

impl<'a, R: Runtime, E: EndpointSink> Controller<'a, R, E> {
    pub fn new(state: State<'a>, cfg: DetectorConfig, runtime: R, sink: E) -> Result<Self> {
        let nodes = state.topo.nodes.len();
        let now = Instant::now();
        let mut c = Controller {
            ring: Ring::new(0..state.topo.servers.len()),
            detector: Detector::new(cfg, nodes),
            state,
            runtime,
            sink,
            version: 0,
            log: Vec::new(),
            observer: None,
            started: now,
            cooldown_until: vec![now; nodes],
            slot_order: SlotOrder::Workload,
        };
        c.publish()?;
        Ok(c)
    }

    fn record(&mut self, entry: LogEntry) {
        if let Some(o) = &self.observer {
            let _ = o.send(entry.clone());
        }
        self.log.push(entry);
    }

    /// Time since the controller started; the clock of every log entry.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    fn publish(&mut self) -> Result<()> {
        self.version += 1;
        let snap = snapshot(&self.state, self.version);
        self.sink.publish(&snap)
    }

    /// Runs until the heartbeat channel closes. `beats` carries heartbeats that passed the
    /// receiver's [`crate::agent::Gate`] (authentic, fresh, from the node's address).
    /// Errors of one decision (a failover with no room, an unwritable endpoints file) are logged and
    /// the loop goes on: the controller must outlive them.
    pub async fn run(&mut self, mut beats: mpsc::Receiver<Heartbeat>) -> Result<()> {
        let mut tick = tokio::time::interval(self.detector.cfg.interval);
        loop {
            // Biased: drain queued heartbeats before judging liveness, so a controller that was busy
            // migrating does not mistake its own delay for silent nodes.
            tokio::select! {
                biased;
                hb = beats.recv() => {
                    let Some(hb) = hb else { return Ok(()) };
                    self.on_heartbeat(&hb).await;
                }
                _ = tick.tick() => self.tick().await,
            }
        }
    }

    /// Judges liveness: a node silent for `dead_after` is failed over. Call every `interval`
    /// (what [`Controller::run`] does; a caller with its own loop calls it instead).
    pub async fn tick(&mut self) {
        for s in self.detector.sweep(Instant::now()) {
            self.handle_logged(s).await;
        }
    }

    async fn handle_logged(&mut self, signal: Signal) {
        if let Err(e) = self.handle(signal).await {
            tracing::error!("{e}");
            self.record(LogEntry::Error(e.to_string()));
        }
    }

    pub async fn on_heartbeat(&mut self, hb: &Heartbeat) {
        match self.detector.observe(hb, Instant::now()) {
            Ok(Some(signal)) => self.handle_logged(signal).await,
            Ok(None) => {}
            Err(e) => tracing::warn!("{e}"),
        }
    }

    async fn handle(&mut self, signal: Signal) -> Result<()> {
        match signal {
            Signal::HostStarvation { node, .. } | Signal::Overload { node, .. } => {
                // Within a node's cool-down its signals are the aftermath of the last decision.
                if Instant::now() < self.cooldown_until[node] {
                    return Ok(());
                }
                self.record(LogEntry::Detected(signal.clone()));
                // Nothing can be done for a host, and a SmartNIC whose migration did not happen
                // (no room, a failed step) keeps signalling: say so once per HOST_NOTE_EVERY, not
                // per heartbeat. A migration that happens sets a shorter cool-down instead.
                self.cooldown_until[node] = Instant::now() + HOST_NOTE_EVERY;
                self.migrate_hottest(node).await
            }
            Signal::NodeDead { node } => {
                self.record(LogEntry::Detected(signal.clone()));
                self.fail_over(node).await
            }
        }
    }

    /// Migrates the primary with the highest CPU use on `node` to a host (§3.4).
    async fn migrate_hottest(&mut self, node: usize) -> Result<()> {
        let topo = self.state.topo;
        let n = &topo.nodes[node];
        if n.kind == NodeKind::Host {
            self.record(LogEntry::NotMigrated {
                node: n.id.clone(),
                reason: "overload on a host; E3 migrates only from SmartNICs to hosts".into(),
            });
            return Ok(());
        }
        // The microservice with the highest CPU use: measured (execution time EMA x its request
        // rate = cores busy) when every slot has reported, else the model's (Table 1's cost at
        // its design rate).
        let on_node = slots_in(&self.state, node, self.slot_order);
        let measured: Option<Vec<f64>> = on_node
            .iter()
            .enumerate()
            .map(|(slot, &i)| {
                let ema = self.detector.ema_us(node, slot)?;
                Some(ema * 1e-6 * self.state.wl.instances[i].rps)
            })
            .collect();
        let cpu: Vec<f64> = match measured {
            Some(m) => m,
            None => on_node
                .iter()
                .map(|&i| self.state.wl.instances[i].cores_on(n.core))
                .collect(),
        };
        let Some(hot) = on_node
            .iter()
            .zip(&cpu)
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(&i, _)| i)
        else {
            return Ok(());
        };
        // The host of the same server first (one PCIe hop away), then hosts by distance.
        let host = topo.servers[n.server].nodes[0];
        let target = if self.state.fits(hot, host) {
            Some(host)
        } else {
            let mut found = None;
            for level in topo.levels(node) {
                level.for_each(|m| {
                    if found.is_none()
                        && topo.nodes[m].kind == NodeKind::Host
                        && self.state.fits(hot, m)
                    {
                        found = Some(m);
                    }
                });
                if found.is_some() {
                    break;
                }
            }
            found
        };
        let Some(to) = target else {
            self.record(LogEntry::NotMigrated {
                node: n.id.clone(),
                reason: format!("no host has room for {}", self.state.wl.instances[hot].id),
            });
            return Ok(());
        };
        let (id, from_id, to_id) = (
            self.state.wl.instances[hot].id.clone(),
            n.id.clone(),
            topo.nodes[to].id.clone(),
        );
        let steps = [
            Step::PushBinary,
            Step::Remove,
            Step::Cleanup,
            Step::MigrateState,
            Step::Restart,
        ];
        for (k, step) in steps.iter().enumerate() {
            if let Err(message) = self.runtime.step(*step, &id, &from_id, &to_id).await {
                // After Remove the old node no longer runs it: restart it there before giving up.
                if k >= 1 {
                    let _ = self
                        .runtime
                        .step(Step::Restart, &id, &from_id, &from_id)
                        .await;
                }
                let err = ControlError::Migration {
                    instance: id.clone(),
                    step: step.name(),
                    message,
                };
                self.record(LogEntry::NotMigrated {
                    node: from_id.clone(),
                    reason: err.to_string(),
                });
                return Ok(());
            }
        }
        self.state.place(hot, to);
        self.detector.reset(node);
        self.detector.reset(to);
        let settle = self.detector.cfg.interval * (self.detector.cfg.warmup + 2);
        self.cooldown_until[node] = Instant::now() + settle;
        self.publish()?;
        self.runtime
            .connections_updated(&id, &from_id, &to_id)
            .await;
        self.record(LogEntry::Migrated {
            instance: id,
            from: from_id,
            to: to_id,
            at: self.started.elapsed(),
        });
        Ok(())
    }

    /// A dead host takes its whole server (fault domain) with it; a dead SmartNIC only itself.
    async fn fail_over(&mut self, node: usize) -> Result<()> {
        let topo = self.state.topo;
        let n = &topo.nodes[node];
        let at = self.started.elapsed();
        let dead: Vec<usize> = if n.kind == NodeKind::Host {
            self.ring.remove(n.server);
            topo.servers[n.server].nodes.clone()
        } else {
            vec![node]
        };
        let moved = fail_nodes(&mut self.state, &dead, &self.ring)?;
        for m in &moved {
            let id = self.state.wl.instances[m.instance].id.clone();
            let (from, to) = (&topo.nodes[m.from].id, &topo.nodes[m.to].id);
            if let Err(e) = self.runtime.step(Step::Restart, &id, from, to).await {
                tracing::warn!("restarting {id} on {to} after failover: {e}");
            }
        }
        self.publish()?;
        self.record(LogEntry::FailedOver {
            node: n.id.clone(),
            moved,
            at,
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoints::MemorySink;
    use crate::heartbeat::{NO_SAMPLE, SLOTS_PER_HEARTBEAT};
    use crate::placement::hcm;
    use crate::placement::tests::setup;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    fn hb(node: u32, queue_len: u16, bw: u8, base: u8, exec: [u16; 4]) -> Heartbeat {
        Heartbeat {
            node,
            queue_len,
            bw_util_pct: bw,
            slot_base: base,
            exec_us: exec,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn overload_needs_warmup_and_20_percent() {
        let mut d = Detector::new(DetectorConfig::default(), 4);
        let t = Instant::now();
        for _ in 0..5 {
            assert_eq!(
                d.observe(&hb(1, 0, 10, 0, [100, NO_SAMPLE, NO_SAMPLE, NO_SAMPLE]), t)
                    .unwrap(),
                None
            );
        }
        // 119 µs is within 20% of 100: no signal. 121 is not.
        assert_eq!(
            d.observe(&hb(1, 0, 10, 0, [119, NO_SAMPLE, NO_SAMPLE, NO_SAMPLE]), t)
                .unwrap(),
            None
        );
        let s = d
            .observe(&hb(1, 0, 10, 0, [130, NO_SAMPLE, NO_SAMPLE, NO_SAMPLE]), t)
            .unwrap();
        assert!(
            matches!(
                s,
                Some(Signal::Overload {
                    node: 1,
                    slot: 0,
                    exec_us: 130,
                    ..
                })
            ),
            "{s:?}"
        );
        // Faster than the EMA is never overload.
        assert_eq!(
            d.observe(&hb(1, 0, 10, 0, [10, NO_SAMPLE, NO_SAMPLE, NO_SAMPLE]), t)
                .unwrap(),
            None
        );
        assert!(d.observe(&hb(9, 0, 0, 0, [0; 4]), t).is_err());
        // Slots past the inline ones (a node rotating through 8 slots) are tracked the same way.
        for _ in 0..5 {
            d.observe(&hb(2, 0, 10, 4, [NO_SAMPLE, NO_SAMPLE, NO_SAMPLE, 50]), t)
                .unwrap();
        }
        let s = d
            .observe(&hb(2, 0, 10, 4, [NO_SAMPLE, NO_SAMPLE, NO_SAMPLE, 70]), t)
            .unwrap();
        assert!(
            matches!(
                s,
                Some(Signal::Overload {
                    node: 2,
                    slot: 7,
                    ..
                })
            ),
            "{s:?}"
        );
        d.reset(2);
        assert_eq!(
            d.observe(&hb(2, 0, 10, 4, [NO_SAMPLE, NO_SAMPLE, NO_SAMPLE, 700]), t)
                .unwrap(),
            None
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_confirmation_window_sees_through_bursts_but_not_noise() {
        // The live demo's setting: 8 heartbeats in a row above 1.2 x EMA.
        let cfg = DetectorConfig {
            overload_beats: 8,
            warmup: 5,
            ..DetectorConfig::default()
        };
        let mut d = Detector::new(cfg, 2);
        let t = Instant::now();
        let beat = |d: &mut Detector, e: u16| {
            d.observe(&hb(1, 0, 10, 0, [e, NO_SAMPLE, NO_SAMPLE, NO_SAMPLE]), t)
                .unwrap()
        };
        for _ in 0..10 {
            assert_eq!(beat(&mut d, 100), None);
        }
        // Noise: a few slow windows, then normal again. Not acted on.
        for e in [145, 150, 140, 100, 100, 145, 100] {
            assert_eq!(beat(&mut d, e), None);
        }
        assert!(
            (d.ema_us(1, 0).unwrap() - 100.0).abs() < 1e-9,
            "noise not learnt"
        );
        // A throttled SmartNIC: bursty, but every window well above the baseline. The baseline
        // does not learn it, so the window fills and the 8th heartbeat signals.
        let burst = [600, 4000, 350, 20000, 700, 2000, 400, 900];
        for (k, e) in burst.into_iter().enumerate() {
            let s = beat(&mut d, e);
            if k < 7 {
                assert_eq!(s, None, "heartbeat {k}");
            } else {
                assert!(
                    matches!(s, Some(Signal::Overload { exec_us: 900, .. })),
                    "{s:?}"
                );
                assert!((d.ema_us(1, 0).unwrap() - 100.0).abs() < 1e-9);
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn starvation_is_a_standing_queue_with_idle_links() {
        let mut d = Detector::new(DetectorConfig::default(), 2);
        let t = Instant::now();
        let none = [NO_SAMPLE; SLOTS_PER_HEARTBEAT];
        // Busy links explain the queue: no starvation.
        for _ in 0..10 {
            assert_eq!(d.observe(&hb(0, 100, 90, 0, none), t).unwrap(), None);
        }
        // A transient queue is not standing.
        assert_eq!(d.observe(&hb(0, 100, 10, 0, none), t).unwrap(), None);
        assert_eq!(d.observe(&hb(0, 0, 10, 0, none), t).unwrap(), None);
        assert_eq!(d.observe(&hb(0, 100, 10, 0, none), t).unwrap(), None);
        assert_eq!(d.observe(&hb(0, 100, 10, 0, none), t).unwrap(), None);
        assert!(matches!(
            d.observe(&hb(0, 100, 10, 0, none), t).unwrap(),
            Some(Signal::HostStarvation { node: 0, .. })
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn silence_means_dead_once() {
        let mut d = Detector::new(DetectorConfig::default(), 2);
        d.observe(&hb(0, 0, 0, 0, [NO_SAMPLE; 4]), Instant::now())
            .unwrap();
        tokio::time::advance(Duration::from_millis(149)).await;
        assert!(d.sweep(Instant::now()).is_empty());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(d.sweep(Instant::now()), vec![Signal::NodeDead { node: 0 }]);
        assert!(d.sweep(Instant::now()).is_empty());
    }

    /// Records every step; fails the named step once if asked.
    #[derive(Clone, Default)]
    struct FakeRuntime {
        steps: Arc<parking_lot_free::Log>,
        fail: Option<Step>,
    }

    mod parking_lot_free {
        /// A step log shared with the test (tokio's Mutex: std's is banned in this workspace).
        #[derive(Default)]
        pub struct Log(pub tokio::sync::Mutex<Vec<(super::Step, String, String, String)>>);
    }

    impl Runtime for FakeRuntime {
        fn step(
            &self,
            step: Step,
            instance: &str,
            from: &str,
            to: &str,
        ) -> impl Future<Output = std::result::Result<(), String>> + Send {
            let log = self.steps.clone();
            let fail = self.fail == Some(step);
            let entry = (step, instance.to_string(), from.to_string(), to.to_string());
            async move {
                // A migration step takes time on real nodes; the paused clock makes it free.
                tokio::time::sleep(Duration::from_millis(5)).await;
                log.0.lock().await.push(entry);
                if fail {
                    Err("node unreachable".into())
                } else {
                    Ok(())
                }
            }
        }
    }

    /// Agents: one task per node sending heartbeats every 50 ms; `slow` makes one node's slot-0
    /// execution time jump after `after` heartbeats, `silent` stops one node after `after`.
    fn spawn_agents(
        nodes: usize,
        tx: mpsc::Sender<Heartbeat>,
        slow: Option<usize>,
        silent: Option<usize>,
        after: usize,
        beats: Arc<AtomicUsize>,
    ) {
        for node in 0..nodes {
            let tx = tx.clone();
            let beats = beats.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_millis(50));
                for k in 0..60usize {
                    tick.tick().await;
                    if silent == Some(node) && k >= after {
                        return;
                    }
                    let exec = if slow == Some(node) && k >= after {
                        400
                    } else {
                        100
                    };
                    let msg = hb(node as u32, 0, 20, 0, [exec, 100, 100, 100]);
                    beats.fetch_add(1, Ordering::Relaxed);
                    if tx.send(msg).await.is_err() {
                        return;
                    }
                }
            });
        }
    }

    /// Kubernetes agents number their slots by instance id; the demo's by workload order.
    /// Both orders hold the same primaries.
    #[test]
    fn slots_by_instance_id_are_the_workload_slots_sorted_by_id() {
        let (topo, wl) = setup("preset:3xType1-SmartNIC", "preset:NFV-FIN");
        let mut st = State::new(&topo, &wl);
        hcm::run(&mut st).unwrap();
        for node in 0..topo.nodes.len() {
            let mut by_workload = slots(&st, node);
            let by_id = slots_in(&st, node, SlotOrder::InstanceId);
            let ids: Vec<&str> = by_id.iter().map(|&i| wl.instances[i].id.as_str()).collect();
            assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
            by_workload.sort_by(|&a, &b| wl.instances[a].id.cmp(&wl.instances[b].id));
            assert_eq!(by_workload, by_id);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn overloaded_smartnic_migrates_hottest_to_host() {
        let (topo, wl) = setup("preset:3xType1-SmartNIC", "preset:NFV-FIN");
        let mut st = State::new(&topo, &wl);
        hcm::run(&mut st).unwrap();
        let nic = topo.first_fit_order[0];
        let before = slots(&st, nic);
        assert!(!before.is_empty());
        let rt = FakeRuntime::default();
        let mut c = Controller::new(
            st,
            DetectorConfig::default(),
            rt.clone(),
            MemorySink::default(),
        )
        .unwrap();
        let (tx, rx) = mpsc::channel(1024);
        let beats = Arc::new(AtomicUsize::new(0));
        spawn_agents(topo.nodes.len(), tx, Some(nic), None, 10, beats);
        c.run(rx).await.unwrap();
        let migrated: Vec<_> = c
            .log
            .iter()
            .filter_map(|e| match e {
                LogEntry::Migrated {
                    instance,
                    from,
                    to,
                    at,
                } => Some((instance.clone(), from.clone(), to.clone(), *at)),
                _ => None,
            })
            .collect();
        assert!(!migrated.is_empty(), "{:?}", c.log);
        let (inst, from, to, at) = &migrated[0];
        assert_eq!(from, &topo.nodes[nic].id);
        assert_eq!(
            to,
            &topo.nodes[topo.nodes[nic].server * 2].id,
            "same server's host"
        );
        // Detected one heartbeat after the slowdown (warm-up done), migrated within 5 steps x 5 ms.
        assert!(*at <= Duration::from_millis(50 * 11 + 30), "{at:?}");
        // The paper's step order, all on this instance.
        let steps: Vec<Step> = rt
            .steps
            .0
            .lock()
            .await
            .iter()
            .filter(|s| &s.1 == inst)
            .map(|s| s.0)
            .collect();
        assert_eq!(
            &steps[..5],
            &[
                Step::PushBinary,
                Step::Remove,
                Step::Cleanup,
                Step::MigrateState,
                Step::Restart
            ]
        );
        // Endpoints moved: the last snapshot lists the instance on the host.
        let last = c.sink.published.last().unwrap();
        let svc = crate::endpoints::service_of(inst);
        assert!(last.services[svc]
            .iter()
            .any(|e| &e.instance == inst && &e.node == to));
        assert!(c.sink.published.len() >= 2);
        crate::placement::verify(&topo, &wl, &c.state.complete().unwrap()).unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn hottest_is_measured_when_every_slot_reports() {
        // One shard per stage, no backups: Flow mon., IPsec and NIDS share the first SmartNIC
        // (three slots, all reported in every heartbeat).
        let (topo, _) = setup("preset:3xType1-SmartNIC", "preset:NFV-FIN");
        let mut app = crate::model::load_app("preset:NFV-FIN").unwrap();
        app.replicas = 0;
        app.rps = 1000.0;
        for s in &mut app.stages {
            s.shards = 1;
        }
        let wl = crate::workload::Workload::from_apps(&[app]).unwrap();
        let mut st = State::new(&topo, &wl);
        hcm::run(&mut st).unwrap();
        let nic = topo.first_fit_order[0];
        let on_nic = slots(&st, nic);
        assert_eq!(on_nic.len(), 3);
        // The model alone would move IPsec (the costliest per request on a SmartNIC, slot 1).
        let core = topo.nodes[nic].core;
        let by_model = *on_nic
            .iter()
            .max_by(|&&a, &&b| {
                wl.instances[a]
                    .cores_on(core)
                    .total_cmp(&wl.instances[b].cores_on(core))
            })
            .unwrap();
        assert_eq!(wl.instances[by_model].microservice, "IPsec");
        let rt = FakeRuntime::default();
        let mut c =
            Controller::new(st, DetectorConfig::default(), rt, MemorySink::default()).unwrap();
        // NIDS (slot 2) slows down: it is the one that uses the CPU now.
        for k in 0..8 {
            let nids = if k < 6 { 100 } else { 300 };
            c.on_heartbeat(&hb(nic as u32, 0, 20, 0, [50, 60, nids, NO_SAMPLE]))
                .await;
            tokio::time::advance(Duration::from_millis(50)).await;
        }
        let moved: Vec<&String> = c
            .log
            .iter()
            .filter_map(|e| match e {
                LogEntry::Migrated { instance, .. } => Some(instance),
                _ => None,
            })
            .collect();
        assert_eq!(moved, vec![&wl.instances[on_nic[2]].id], "{:?}", c.log);
    }

    #[tokio::test(start_paused = true)]
    async fn failed_step_keeps_the_instance_where_it_was() {
        let (topo, wl) = setup("preset:3xType1-SmartNIC", "preset:NFV-FIN");
        let mut st = State::new(&topo, &wl);
        hcm::run(&mut st).unwrap();
        let nic = topo.first_fit_order[0];
        let before = st.assign.clone();
        let rt = FakeRuntime {
            fail: Some(Step::MigrateState),
            ..Default::default()
        };
        let mut c = Controller::new(
            st,
            DetectorConfig::default(),
            rt.clone(),
            MemorySink::default(),
        )
        .unwrap();
        c.migrate_hottest(nic).await.unwrap();
        assert_eq!(c.state.assign, before);
        assert!(
            matches!(c.log.last(), Some(LogEntry::NotMigrated { reason, .. }) if reason.contains("migrate working state"))
        );
        // The old node was told to restart it.
        let last = rt.steps.0.lock().await.last().cloned().unwrap();
        assert_eq!((last.0, last.2.clone()), (Step::Restart, last.3.clone()));
        assert_eq!(c.sink.published.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn silent_host_fails_over_its_whole_server() {
        let (topo, wl) = setup("preset:3xType1-SmartNIC", "preset:IOT-TS");
        let mut st = State::new(&topo, &wl);
        hcm::run(&mut st).unwrap();
        let rt = FakeRuntime::default();
        let mut c =
            Controller::new(st, DetectorConfig::default(), rt, MemorySink::default()).unwrap();
        let (tx, rx) = mpsc::channel(1024);
        let beats = Arc::new(AtomicUsize::new(0));
        // Node 0 is rack0-s0/host; its SmartNIC (node 1) also goes silent with it.
        spawn_agents(
            topo.nodes.len(),
            tx.clone(),
            None,
            Some(0),
            5,
            beats.clone(),
        );
        drop(tx);
        c.run(rx).await.unwrap();
        let fo: Vec<_> = c
            .log
            .iter()
            .filter(|e| matches!(e, LogEntry::FailedOver { .. }))
            .collect();
        assert_eq!(fo.len(), 1, "only the silent server fails: {:?}", c.log);
        assert!(
            !c.log.iter().any(|e| matches!(e, LogEntry::Error(_))),
            "{:?}",
            c.log
        );
        let LogEntry::FailedOver { node, at, moved } = fo[0] else {
            unreachable!()
        };
        assert_eq!(node, "rack0-s0/host");
        // Last beat at 200 ms; declared dead 150 ms later, at the next 50 ms sweep (detection time;
        // the restarts that follow take 5 ms each on the fake runtime).
        assert!(
            *at >= Duration::from_millis(350) && *at <= Duration::from_millis(400),
            "{at:?}"
        );
        assert!(!moved.is_empty());
        let assign = c
            .state
            .complete()
            .unwrap_or_else(|e| panic!("{e}: {:?}", c.log));
        crate::placement::verify(&topo, &wl, &assign).unwrap();
        assert!(assign.iter().all(|&n| topo.nodes[n].server != 0));
        assert!(!c.ring.contains(0));
    }
}
