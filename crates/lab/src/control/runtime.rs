//! The demo's node runtime: microservice instances are processes inside their node's network
//! namespace (and, on a SmartNIC node, inside its throttled CPU cgroup). It implements the
//! orchestrator's [`Runtime`], so a cold migration is done for real, step by step:
//!
//! 1. push binary: hard-link (or copy) the flatmesh binary into the destination node's directory;
//! 2. remove from the execution engine: the old process stops executing (`/_control/hold`);
//!    requests that arrive wait in its queue;
//! 3. clean up local resources: it checkpoints its working state to a file and frees it;
//! 4. migrate working state: the checkpoint is copied to the destination node's directory;
//! 5. restart on the new node: a new process starts there from the checkpoint; once it answers, the
//!    old one relays its queue and any late arrivals to it. After the new endpoints reach the node
//!    proxies ([`Runtime::connections_updated`]) the old process retires when idle.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::control::services::Kind;
use crate::{LabError, Result};
use flatmesh_control::orchestrator::{Runtime, Step};

/// How to start the demo's own processes: the flatmesh binary and the hidden subcommands.
#[derive(Debug, Clone)]
pub struct Launcher {
    pub program: PathBuf,
    /// e.g. `["control", "demo", "service"]`
    pub service_args: Vec<String>,
    /// e.g. `["control", "demo", "agent"]`
    pub agent_args: Vec<String>,
}

/// One compute node of the demo cluster.
#[derive(Debug, Clone)]
pub struct NodeEnv {
    pub id: String,
    pub index: usize,
    pub smartnic: bool,
    pub ns: String,
    pub ip: Ipv4Addr,
    /// Working directory: pushed binary, checkpoints, config, logs.
    pub dir: PathBuf,
    /// The throttled cgroup's `cgroup.procs` (SmartNIC nodes only).
    pub cgroup_procs: Option<PathBuf>,
    /// The node proxy's entrance.
    pub proxy: SocketAddr,
}

#[derive(Debug, Clone)]
pub struct InstanceSpec {
    pub id: String,
    pub kind: Kind,
    pub port: u16,
}

/// The instances an agent reports, in slot order (one file per node, rewritten on every change).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct AgentSlot {
    pub instance: String,
    pub addr: SocketAddr,
    /// The instance's statistics port.
    pub stats: SocketAddr,
}

/// An instance's statistics port: its service port + 1000.
pub fn stats_port(port: u16) -> u16 {
    port.saturating_add(1000)
}

/// A migration step as it happened, for the demo's log.
#[derive(Debug, Clone)]
pub struct StepEvent {
    pub at: Duration,
    pub instance: String,
    pub step: &'static str,
    pub from: String,
    pub to: String,
    pub detail: String,
}

#[derive(Debug, Clone, Copy)]
pub struct ServiceParams {
    /// burn() iterations per request, per kind.
    pub backend_iterations: u64,
    pub gateway_iterations: u64,
    pub rate: f64,
    pub burst: f64,
}

struct Running {
    node: String,
    child: Child,
    /// Removed from its node's execution engine (held) and so not reported by the agent.
    held: bool,
}

struct Inner {
    launcher: Launcher,
    nodes: BTreeMap<String, NodeEnv>,
    specs: Vec<InstanceSpec>,
    params: ServiceParams,
    running: Mutex<BTreeMap<String, Running>>,
    /// Processes that relay until idle, then exit by themselves; reaped at shutdown.
    retiring: Mutex<Vec<Child>>,
    /// Agents and node proxies, killed at shutdown.
    others: Mutex<Vec<Child>>,
    events: mpsc::UnboundedSender<StepEvent>,
    client: Client<HttpConnector, Full<Bytes>>,
    started: Instant,
}

#[derive(Clone)]
pub struct ProcessRuntime {
    inner: Arc<Inner>,
}

/// Starts `program args` inside `ns`, first joining `cgroup_procs` if given. The shell writes its
/// own pid and then execs `ip netns exec`, which execs the program: the program starts inside the
/// cgroup (no window where it runs unthrottled) and its pid is the child's.
pub fn spawn_in(
    ns: &str,
    cgroup_procs: Option<&Path>,
    program: &Path,
    args: &[String],
    log: &Path,
) -> Result<Child> {
    let err = |e: std::io::Error| LabError::Demo {
        what: format!("starting {} in {ns}", program.display()),
        message: format!("{e}; the demo needs root and iproute2"),
    };
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(err)?;
    let out2 = out.try_clone().map_err(err)?;
    // The cgroup is joined before entering the namespace: `ip netns exec` remounts /sys for the
    // namespace, and the cgroup files are not visible inside it.
    Command::new("sh")
        .arg("-c")
        .arg(r#"if [ -n "$FLATMESH_CGROUP" ]; then echo $$ > "$FLATMESH_CGROUP" || exit 97; fi; exec "$@""#)
        .arg("sh")
        .args(["ip", "netns", "exec", ns])
        .arg(program)
        .args(args)
        .env(
            "FLATMESH_CGROUP",
            cgroup_procs.map(|p| p.as_os_str()).unwrap_or_default(),
        )
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(out2)
        .spawn()
        .map_err(err)
}

fn kill(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

impl ProcessRuntime {
    pub fn new(
        launcher: Launcher,
        nodes: Vec<NodeEnv>,
        specs: Vec<InstanceSpec>,
        params: ServiceParams,
        events: mpsc::UnboundedSender<StepEvent>,
    ) -> Self {
        ProcessRuntime {
            inner: Arc::new(Inner {
                launcher,
                nodes: nodes.into_iter().map(|n| (n.id.clone(), n)).collect(),
                specs,
                params,
                running: Mutex::new(BTreeMap::new()),
                retiring: Mutex::new(Vec::new()),
                others: Mutex::new(Vec::new()),
                events,
                client: Client::builder(TokioExecutor::new()).build_http(),
                started: Instant::now(),
            }),
        }
    }

    fn node(&self, id: &str) -> std::result::Result<&NodeEnv, String> {
        self.inner
            .nodes
            .get(id)
            .ok_or_else(|| format!("unknown node {id}"))
    }

    fn spec(&self, instance: &str) -> std::result::Result<&InstanceSpec, String> {
        self.inner
            .specs
            .iter()
            .find(|s| s.id == instance)
            .ok_or_else(|| format!("unknown instance {instance}"))
    }

    pub fn addr_on(&self, instance: &str, node: &str) -> std::result::Result<SocketAddr, String> {
        Ok(SocketAddr::new(
            self.node(node)?.ip.into(),
            self.spec(instance)?.port,
        ))
    }

    fn management_on(&self, instance: &str, node: &str) -> std::result::Result<SocketAddr, String> {
        let a = self.addr_on(instance, node)?;
        Ok(SocketAddr::new(a.ip(), stats_port(a.port())))
    }

    fn checkpoint_path(node: &NodeEnv, instance: &str) -> PathBuf {
        node.dir
            .join("state")
            .join(format!("{}.json", instance.replace('/', "_")))
    }

    fn pushed_binary(node: &NodeEnv) -> PathBuf {
        node.dir.join("bin").join("flatmesh")
    }

    /// Step 1, also used to prepare every node at start.
    pub fn push_binary(&self, node: &str) -> std::result::Result<String, String> {
        let n = self.node(node)?;
        let dest = Self::pushed_binary(n);
        if dest.exists() {
            return Ok(format!("{} already there", dest.display()));
        }
        let parent = dest.parent().ok_or("binary path has no parent")?;
        std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
        std::fs::create_dir_all(n.dir.join("state")).map_err(|e| e.to_string())?;
        let how = if std::fs::hard_link(&self.inner.launcher.program, &dest).is_ok() {
            "hard-linked"
        } else {
            std::fs::copy(&self.inner.launcher.program, &dest)
                .map_err(|e| format!("copying the binary to {}: {e}", dest.display()))?;
            "copied"
        };
        Ok(format!("{how} to {}", dest.display()))
    }

    /// Starts `instance` on `node`, from `state` if given, and waits until it answers.
    pub async fn start_instance(
        &self,
        instance: &str,
        node: &str,
        state: Option<&Path>,
    ) -> std::result::Result<(), String> {
        let n = self.node(node)?.clone();
        let spec = self.spec(instance)?.clone();
        let p = self.inner.params;
        let addr = SocketAddr::new(n.ip.into(), spec.port);
        let iterations = if spec.kind == Kind::Gateway {
            p.gateway_iterations
        } else {
            p.backend_iterations
        };
        let mut args = self.inner.launcher.service_args.clone();
        args.extend([
            "--kind".into(),
            spec.kind.name().into(),
            "--listen".into(),
            addr.to_string(),
            "--stats-listen".into(),
            SocketAddr::new(n.ip.into(), stats_port(spec.port)).to_string(),
            "--work-iterations".into(),
            iterations.to_string(),
            "--rate".into(),
            p.rate.to_string(),
            "--burst".into(),
            p.burst.to_string(),
            "--upstream".into(),
            n.proxy.to_string(),
        ]);
        if let Some(s) = state {
            args.extend(["--state".into(), s.display().to_string()]);
        }
        let log = n.dir.join(format!("{}.log", instance.replace('/', "_")));
        let child = spawn_in(
            &n.ns,
            n.cgroup_procs.as_deref(),
            &Self::pushed_binary(&n),
            &args,
            &log,
        )
        .map_err(|e| e.to_string())?;
        let mut running = Running {
            node: node.to_string(),
            child,
            held: false,
        };
        if let Err(e) = self.wait_ready(addr, &mut running.child, &log).await {
            kill(running.child);
            return Err(e);
        }
        if let Some(old) = self
            .inner
            .running
            .lock()
            .insert(instance.to_string(), running)
        {
            // A restart on the node it already ran on (failover of a relayer): the old one retires.
            self.inner.retiring.lock().push(old.child);
        }
        self.write_agent_lists();
        Ok(())
    }

    async fn wait_ready(
        &self,
        addr: SocketAddr,
        child: &mut Child,
        log: &Path,
    ) -> std::result::Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                let tail = std::fs::read_to_string(log).unwrap_or_default();
                let tail: Vec<&str> = tail.lines().rev().take(5).collect();
                return Err(format!(
                    "the process at {addr} exited ({status}): {}",
                    tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
                ));
            }
            if self.get(addr, "/_stats").await.is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("{addr} did not answer within 10 s"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn request(
        &self,
        method: http::Method,
        addr: SocketAddr,
        path: &str,
    ) -> std::result::Result<String, String> {
        let req = http::Request::builder()
            .method(method)
            .uri(format!("http://{addr}{path}"))
            .body(Full::new(Bytes::new()))
            .map_err(|e| e.to_string())?;
        let resp = tokio::time::timeout(Duration::from_secs(15), self.inner.client.request(req))
            .await
            .map_err(|_| format!("{addr}{path}: no answer in 15 s"))?
            .map_err(|e| format!("{addr}{path}: {e}"))?;
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        let body = String::from_utf8_lossy(&body).trim().to_string();
        if status.is_success() {
            Ok(body)
        } else {
            Err(format!("{addr}{path}: {status} {body}"))
        }
    }

    async fn get(&self, addr: SocketAddr, path: &str) -> std::result::Result<String, String> {
        self.request(http::Method::GET, addr, path).await
    }

    async fn post(&self, addr: SocketAddr, path: &str) -> std::result::Result<String, String> {
        self.request(http::Method::POST, addr, path).await
    }

    /// Rewrites every node's agent list: the instances it runs and executes, in slot order
    /// (workload order, as the orchestrator numbers slots).
    fn write_agent_lists(&self) {
        let running = self.inner.running.lock();
        for n in self.inner.nodes.values() {
            let slots: Vec<AgentSlot> = self
                .inner
                .specs
                .iter()
                .filter(|s| {
                    running
                        .get(&s.id)
                        .is_some_and(|r| r.node == n.id && !r.held)
                })
                .map(|s| AgentSlot {
                    instance: s.id.clone(),
                    addr: SocketAddr::new(n.ip.into(), s.port),
                    stats: SocketAddr::new(n.ip.into(), stats_port(s.port)),
                })
                .collect();
            let path = agent_list_path(n);
            let tmp = path.with_extension("tmp");
            if let Ok(text) = serde_json::to_vec(&slots) {
                if std::fs::write(&tmp, text).is_ok() {
                    let _ = std::fs::rename(&tmp, &path);
                }
            }
        }
    }

    /// Keeps a process (agent, node proxy) to kill at shutdown.
    pub fn adopt(&self, child: Child) {
        self.inner.others.lock().push(child);
    }

    /// Where each instance runs now.
    pub fn locations(&self) -> BTreeMap<String, String> {
        self.inner
            .running
            .lock()
            .iter()
            .map(|(i, r)| (i.clone(), r.node.clone()))
            .collect()
    }

    /// Kills every process the runtime started. Idempotent.
    pub fn shutdown(&self) {
        let running = std::mem::take(&mut *self.inner.running.lock());
        for (_, r) in running {
            kill(r.child);
        }
        for c in self.inner.retiring.lock().drain(..) {
            kill(c);
        }
        for c in self.inner.others.lock().drain(..) {
            kill(c);
        }
    }

    fn emit(&self, instance: &str, step: &'static str, from: &str, to: &str, detail: String) {
        let _ = self.inner.events.send(StepEvent {
            at: self.inner.started.elapsed(),
            instance: instance.to_string(),
            step,
            from: from.to_string(),
            to: to.to_string(),
            detail,
        });
    }

    async fn do_step(
        &self,
        step: Step,
        instance: &str,
        from: &str,
        to: &str,
    ) -> std::result::Result<String, String> {
        let from_node = self.node(from)?.clone();
        let to_node = self.node(to)?.clone();
        // Control requests go to the old instance's management port.
        let old = self.management_on(instance, from)?;
        match step {
            Step::PushBinary => self.push_binary(to),
            Step::Remove => {
                let r = self.post(old, "/_control/hold").await?;
                if let Some(run) = self.inner.running.lock().get_mut(instance) {
                    run.held = true;
                }
                self.write_agent_lists();
                Ok(r)
            }
            Step::Cleanup => {
                let file = Self::checkpoint_path(&from_node, instance);
                let r = self
                    .post(
                        old,
                        &format!("/_control/checkpoint?file={}", file.display()),
                    )
                    .await?;
                Ok(format!("checkpointed {r} to {}", file.display()))
            }
            Step::MigrateState => {
                let src = Self::checkpoint_path(&from_node, instance);
                let dst = Self::checkpoint_path(&to_node, instance);
                let bytes = std::fs::copy(&src, &dst)
                    .map_err(|e| format!("{} -> {}: {e}", src.display(), dst.display()))?;
                Ok(format!("{bytes} bytes to {}", dst.display()))
            }
            Step::Restart if from == to => {
                // Rolling back a failed migration: the old process resumes, from its checkpoint
                // if it had already released its state.
                let file = Self::checkpoint_path(&from_node, instance);
                let r = self
                    .post(old, &format!("/_control/resume?file={}", file.display()))
                    .await?;
                if let Some(run) = self.inner.running.lock().get_mut(instance) {
                    run.held = false;
                }
                self.write_agent_lists();
                Ok(r)
            }
            Step::Restart => {
                let file = Self::checkpoint_path(&to_node, instance);
                let state = file.exists().then_some(file.as_path());
                self.start_instance(instance, to, state).await?;
                let new = self.addr_on(instance, to)?;
                // The old process relays what it holds and what still arrives. If it is gone (a
                // failover), there is nothing to relay.
                let relay = self
                    .post(old, &format!("/_control/relay?to={new}"))
                    .await
                    .unwrap_or_else(|e| format!("old instance unreachable ({e})"));
                Ok(format!("serving at {new}; old: {relay}"))
            }
        }
    }
}

pub fn agent_list_path(node: &NodeEnv) -> PathBuf {
    node.dir.join("instances.json")
}

impl Runtime for ProcessRuntime {
    fn step(
        &self,
        step: Step,
        instance: &str,
        from: &str,
        to: &str,
    ) -> impl std::future::Future<Output = std::result::Result<(), String>> + Send {
        let this = self.clone();
        let (instance, from, to) = (instance.to_string(), from.to_string(), to.to_string());
        async move {
            let r = this.do_step(step, &instance, &from, &to).await;
            let detail = match &r {
                Ok(d) => d.clone(),
                Err(e) => format!("FAILED: {e}"),
            };
            this.emit(&instance, step.name(), &from, &to, detail);
            r.map(|_| ())
        }
    }

    fn connections_updated(
        &self,
        instance: &str,
        from: &str,
        to: &str,
    ) -> impl std::future::Future<Output = ()> + Send {
        let this = self.clone();
        let (instance, from, to) = (instance.to_string(), from.to_string(), to.to_string());
        async move {
            let detail = match this.management_on(&instance, &from) {
                Ok(old) => match this.post(old, "/_control/retire").await {
                    Ok(_) => format!("endpoints published; old process at {old} retires once idle"),
                    Err(e) => format!("endpoints published; old process: {e}"),
                },
                Err(e) => e,
            };
            this.emit(&instance, "update connections", &from, &to, detail);
        }
    }
}
