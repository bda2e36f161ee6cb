//! How PUs come to exist and how code gets onto one. The agent, the rules and the port table do
//! not care what a PU is; this trait is the seam. `Emulated` builds a PU as a network namespace
//! with its own cpuset, linked to the other PUs by veth pairs. A real DPU backend would implement
//! the same trait: `enter_thread`/`command` would run on the DPU's OS (the agent runs there
//! natively), and the links would be the host<->DPU interfaces (e.g. a BlueField's PCIe
//! representor or tmfifo netdev) with the same address plan.

use std::ffi::OsStr;
use std::os::unix::process::CommandExt as _;
use std::process::Command;

use crate::config::SplitConfig;
use crate::cpuset::{self, Cpuset};
use crate::error::{PuError, Result};
use crate::exec::run;
use crate::netns;
use crate::table::PortTable;
use crate::topology::{Topology, MARK_BASE, TABLE_BASE};

pub trait PuBackend: Send + Sync {
    fn topology(&self) -> &Topology;
    /// Creates every PU and the links between them, first removing leftovers of a previous run.
    fn up(&self) -> Result<()>;
    /// Removes every PU, link and rule of this split namespace. Safe to call twice.
    fn down(&self) -> Result<()>;
    fn exists(&self, pu: usize) -> bool;
    /// Moves the calling thread onto PU `pu`: its network stack and its CPUs.
    fn enter_thread(&self, pu: usize) -> Result<()>;
    /// A command that will run `program` on PU `pu`.
    fn command(&self, pu: usize, program: &OsStr) -> Result<Command>;
    /// Fails unless the calling thread is on PU `pu`. The agent checks it before it writes any
    /// rule, so a rule can never land anywhere else (the host namespace above all).
    fn check_on(&self, pu: usize) -> Result<()>;
}

/// The backend a config asks for. Only the emulated one exists on this machine; a DPU backend
/// is one more `impl PuBackend` chosen here.
pub fn for_config(config: &SplitConfig) -> std::sync::Arc<dyn PuBackend> {
    std::sync::Arc::new(Emulated::new(config))
}

/// PUs emulated by network namespaces, cpusets and veth pairs on one Linux host.
pub struct Emulated {
    topology: Topology,
    cpusets: Vec<Cpuset>,
    cpus_text: Vec<Option<String>>,
    ports: PortTable,
    /// The directory the PUs share for hetero-socket (`shm_proof::group_dir`).
    shm_group: std::path::PathBuf,
}

impl Emulated {
    pub fn new(config: &SplitConfig) -> Emulated {
        let topology = Topology::new(config);
        let cpusets = config
            .pus
            .iter()
            .enumerate()
            .map(|(i, pu)| Cpuset::new(&pu.name, &topology.cgroup(i), pu.cpus.as_deref()))
            .collect();
        Emulated {
            topology,
            cpusets,
            cpus_text: config.pus.iter().map(|p| p.cpus.clone()).collect(),
            ports: PortTable::new(config),
            shm_group: crate::shm_proof::group_dir(config),
        }
    }

    pub fn cpuset(&self, pu: usize) -> &Cpuset {
        &self.cpusets[pu]
    }

    fn sysctl(netns: &str, key: &str, value: &str) -> Result<()> {
        run(
            "ip",
            &[
                "netns",
                "exec",
                netns,
                "sysctl",
                "-qw",
                &format!("{key}={value}"),
            ],
        )
        .map(|_| ())
    }
}

pub fn require_root() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(PuError::NotRoot);
    }
    Ok(())
}

impl PuBackend for Emulated {
    fn topology(&self) -> &Topology {
        &self.topology
    }

    fn up(&self) -> Result<()> {
        require_root()?;
        self.down()?;
        let t = &self.topology;
        for pu in 0..t.pus.len() {
            let ns = t.netns(pu);
            run("ip", &["netns", "add", &ns])?;
            run("ip", &["-n", &ns, "link", "set", "lo", "up"])?;
            // A fresh namespace may inherit the host's rp_filter; the split paths are asymmetric
            // by design (a reply to 127.0.0.1 leaves through a veth), so turn it off.
            Self::sysctl(&ns, "net.ipv4.conf.all.rp_filter", "0")?;
            Self::sysctl(&ns, "net.ipv4.conf.default.rp_filter", "0")?;
            if Some(pu) == t.uplink {
                Self::sysctl(&ns, "net.ipv4.ip_forward", "1")?;
            }
            self.cpusets[pu].create(self.cpus_text[pu].as_deref())?;
        }
        // The port table and its bind hook, which knows each PU by its namespace's cookie. All
        // PUs share this kernel, so one hook sees the binds of all of them.
        let cookies = (0..t.pus.len())
            .map(|pu| {
                run_on(self, pu, netns::cookie)?.map_err(|e| {
                    PuError::io(format!("cannot read the cookie of {}", t.netns(pu)), e)
                })
            })
            .collect::<Result<Vec<u64>>>()?;
        self.ports.create(&cookies)?;
        crate::shm_proof::create_group_dir(&self.shm_group)?;
        for a in 0..t.pus.len() {
            for link in t.links(a).into_iter().filter(|l| l.peer > a) {
                let back = t.link_to(link.peer, a).ok_or_else(|| PuError::Command {
                    command: "link plan".into(),
                    message: "asymmetric link plan".into(),
                })?;
                let (ns_a, ns_b) = (t.netns(a), t.netns(link.peer));
                // Created directly inside the two PUs: no interface ever exists in the host
                // namespace, so none can leak there.
                run(
                    "ip",
                    &[
                        "link",
                        "add",
                        &link.ifname,
                        "netns",
                        &ns_a,
                        "type",
                        "veth",
                        "peer",
                        "name",
                        &back.ifname,
                        "netns",
                        &ns_b,
                    ],
                )?;
            }
        }
        for pu in 0..t.pus.len() {
            let ns = t.netns(pu);
            for link in t.links(pu) {
                let addr = format!("{}/30", link.local_addr);
                run(
                    "ip",
                    &["-n", &ns, "addr", "add", &addr, "dev", &link.ifname],
                )?;
                run("ip", &["-n", &ns, "link", "set", &link.ifname, "up"])?;
                // 127.0.0.0/8 may cross this link in both directions (the reverse mapping keeps
                // loopback addresses on the app's side of the NAT).
                Self::sysctl(
                    &ns,
                    &format!("net.ipv4.conf.{}.route_localnet", link.ifname),
                    "1",
                )?;
                Self::sysctl(
                    &ns,
                    &format!("net.ipv4.conf.{}.rp_filter", link.ifname),
                    "0",
                )?;
                // §4.1.2 rule (1): packets marked for PU n go to PU n unchanged.
                let mark = format!("{:#x}", MARK_BASE + link.peer as u32);
                let table = (TABLE_BASE + link.peer as u32).to_string();
                let via = link.peer_addr.to_string();
                run(
                    "ip",
                    &[
                        "-n", &ns, "rule", "add", "fwmark", &mark, "lookup", &table, "priority",
                        "1000",
                    ],
                )?;
                run(
                    "ip",
                    &[
                        "-n",
                        &ns,
                        "route",
                        "add",
                        "default",
                        "via",
                        &via,
                        "dev",
                        &link.ifname,
                        "table",
                        &table,
                    ],
                )?;
                if t.uplink == Some(link.peer) {
                    run(
                        "ip",
                        &[
                            "-n",
                            &ns,
                            "route",
                            "add",
                            "default",
                            "via",
                            &via,
                            "dev",
                            &link.ifname,
                        ],
                    )?;
                }
            }
        }
        Ok(())
    }

    fn down(&self) -> Result<()> {
        let t = &self.topology;
        let mut first_error = None;
        if let Err(e) = self.ports.remove() {
            first_error.get_or_insert(e);
        }
        for pu in 0..t.pus.len() {
            if let Err(e) = remove_netns(&t.netns(pu)) {
                first_error.get_or_insert(e);
            }
            if let Err(e) = self.cpusets[pu].destroy() {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    fn exists(&self, pu: usize) -> bool {
        netns::exists(&self.topology.netns(pu))
    }

    fn enter_thread(&self, pu: usize) -> Result<()> {
        let ns = self.netns_of(pu)?;
        netns::enter(&ns)?;
        self.cpusets[pu].enter_thread()
    }

    fn check_on(&self, pu: usize) -> Result<()> {
        let ns = self.netns_of(pu)?;
        let not_on = || PuError::NotOnPu {
            pu: self.topology.pus[pu].clone(),
            netns: ns.clone(),
        };
        let want = netns::id_of(&netns::path(&ns)).map_err(|_| not_on())?;
        match netns::current_id() {
            Ok(id) if id == want => Ok(()),
            _ => Err(not_on()),
        }
    }

    fn command(&self, pu: usize, program: &OsStr) -> Result<Command> {
        let ns = self.netns_of(pu)?;
        let ns_file = netns::open(&ns)?;
        let mut procs = self.cpusets[pu].procs_file()?;
        let cpus = self.cpusets[pu].cpus.clone();
        let mut command = Command::new(program);
        // With the hetero-socket library preloaded, connections to the other PUs use shared
        // memory too (docs/shm.md "Between PUs"); without it, the variable is never read.
        if std::env::var_os("FLATMESH_SHM_GROUP").is_none() {
            command.env("FLATMESH_SHM_GROUP", &self.shm_group);
        }
        // SAFETY: the closure runs between fork and exec and makes only async-signal-safe calls
        // (setns, write, sched_setaffinity) on descriptors opened before the fork.
        unsafe {
            command.pre_exec(move || {
                netns::set(&ns_file)?;
                match procs.as_mut() {
                    Some(file) => cpuset::join_self(file)?,
                    None => {
                        if let Some(cpus) = &cpus {
                            cpuset::set_affinity(cpus)?;
                        }
                    }
                }
                Ok(())
            });
        }
        Ok(command)
    }
}

impl Emulated {
    fn netns_of(&self, pu: usize) -> Result<String> {
        let ns = self.topology.netns(pu);
        if !netns::exists(&ns) {
            return Err(PuError::NoSuchPu {
                pu: self.topology.pus[pu].clone(),
                netns: ns,
            });
        }
        Ok(ns)
    }
}

/// Stops the processes left in a network namespace (they were started in the PU) and deletes it;
/// its veths and nftables tables go with it.
pub fn remove_netns(ns: &str) -> Result<()> {
    if !netns::exists(ns) {
        return Ok(());
    }
    let own = std::process::id().to_string();
    if let Ok(pids) = run("ip", &["netns", "pids", ns]) {
        for pid in pids.split_whitespace().filter(|p| *p != own) {
            if let Ok(pid) = pid.parse::<i32>() {
                // SAFETY: kill with a pid the kernel listed in this namespace.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
    run("ip", &["netns", "del", ns]).map(|_| ())
}

/// Runs `f` on a new thread that has entered PU `pu` (network namespace and CPUs), and returns
/// its result. Threads `f` spawns stay in the PU.
pub fn run_on<T: Send>(
    backend: &dyn PuBackend,
    pu: usize,
    f: impl FnOnce() -> T + Send,
) -> Result<T> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                backend.enter_thread(pu)?;
                Ok(f())
            })
            .join()
            .unwrap_or_else(|_| {
                Err(PuError::io(
                    "a thread on the PU panicked",
                    std::io::Error::other("panic"),
                ))
            })
    })
}
