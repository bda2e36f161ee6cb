//! The global port table of a split network namespace (flatmesh-pu, HeteroPod §4.1.1), held
//! by the kernel and enforced at bind(): `bpf/pu_ports.bpf.c`.
//!
//! [`PuPorts::attach`] loads one copy of the program per split namespace, attaches its
//! cgroup/bind4 and cgroup/bind6 programs at the cgroup v2 root, and pins its maps and links in
//! the namespace's own bpffs directory, so the hook stays in force after the process that
//! attached it exits. [`PuPorts::open`] gives a PU agent the pinned table; [`PuPorts::detach`]
//! removes the pins, which detaches the programs.

use std::collections::BTreeMap;
use std::path::Path;

use aya::maps::{HashMap, MapData, MapError, PerCpuArray};
use aya::programs::links::FdLink;
use aya::programs::{CgroupAttachMode, CgroupSockAddr};

use crate::error::KernelError;
use crate::tier::{ensure_bpffs, load, open_cgroup, program, remove_pins, typed};

static PU_PORTS_OBJ: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/pu_ports.bpf.o"));

/// Most PUs of one split namespace (FM_PU_MAX in the program).
pub const PU_MAX: usize = 8;

const IPPROTO_TCP: u8 = 6;
/// BPF_NOEXIST: insert only if the key is absent.
const BPF_NOEXIST: u64 = 1;
const PORTS: &str = "fm_pu_ports";
const NETNS: &str = "fm_pu_netns";
const STATS: &str = "fm_pu_bind_stats";
const LINKS: [(&str, &str); 2] = [("fm_pu_bind4", "link_bind4"), ("fm_pu_bind6", "link_bind6")];

/// struct fm_pu_port.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct FmPuPort {
    port: u16,
    proto: u8,
    pad: u8,
}
// SAFETY: plain integers, no padding holes beyond the explicit `pad` byte.
unsafe impl aya::Pod for FmPuPort {}

/// struct fm_pu_owner.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct FmPuOwner {
    pu: u32,
    pad: u32,
}
// SAFETY: plain integers, no padding holes beyond the explicit `pad` field.
unsafe impl aya::Pod for FmPuOwner {}

fn tcp(port: u16) -> FmPuPort {
    FmPuPort {
        port,
        proto: IPPROTO_TCP,
        pad: 0,
    }
}

/// The errno of a failed map system call.
fn errno(e: &MapError) -> Option<i32> {
    match e {
        MapError::SyscallError(e) => e.io_error.raw_os_error(),
        _ => None,
    }
}

/// What a claim of a port by a PU found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// The port was free and is now the PU's, or was the PU's already.
    Mine,
    /// Another PU (its index) owns the port.
    Taken(u32),
}

/// Bind counters of the hook, summed over CPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BindStats {
    /// Binds that claimed a free port for their PU.
    pub claimed: u64,
    /// Binds refused with EADDRINUSE because another PU owned the port.
    pub refused: u64,
}

/// The pinned table of one split namespace.
pub struct PuPorts {
    ports: HashMap<MapData, FmPuPort, FmPuOwner>,
}

impl PuPorts {
    /// Loads the bind hook for one split namespace: pins its maps and links in `pin_dir` (a
    /// new directory on bpffs; anything there is removed first), registers the PUs (index i
    /// is the PU whose network namespace has cookie `netns_cookies[i]`) and attaches at
    /// `cgroup_root`, a cgroup v2 directory that holds every PU's processes (its root).
    pub fn attach(
        pin_dir: &Path,
        cgroup_root: &Path,
        netns_cookies: &[u64],
    ) -> Result<PuPorts, KernelError> {
        if netns_cookies.len() > PU_MAX {
            return Err(KernelError::io(
                format!("registering {} PUs", netns_cookies.len()),
                std::io::Error::other(format!("the bind hook holds at most {PU_MAX} PUs")),
            ));
        }
        ensure_bpffs(pin_dir)?;
        remove_pins(pin_dir)?;
        std::fs::create_dir_all(pin_dir)
            .map_err(|e| KernelError::io(format!("creating {}", pin_dir.display()), e))?;
        let attached = Self::load_and_attach(pin_dir, cgroup_root, netns_cookies);
        if attached.is_err() {
            // Leave nothing half attached behind.
            let _ = remove_pins(pin_dir);
        }
        attached
    }

    fn load_and_attach(
        pin_dir: &Path,
        cgroup_root: &Path,
        netns_cookies: &[u64],
    ) -> Result<PuPorts, KernelError> {
        let mut obj = load("pu_ports", PU_PORTS_OBJ, pin_dir)?;
        // The PUs first, so the hook knows them from its first bind.
        let mut netns: HashMap<MapData, u64, u32> = typed(&mut obj, NETNS)?;
        for (pu, cookie) in netns_cookies.iter().enumerate() {
            netns
                .insert(cookie, pu as u32, 0)
                .map_err(|e| KernelError::map(NETNS, "insert", e))?;
        }
        let cgroup = open_cgroup(cgroup_root)?;
        for (name, pin) in LINKS {
            let p: &mut CgroupSockAddr = program(&mut obj, name)?;
            p.load()
                .map_err(|e| KernelError::program(name, "load (verifier)", e))?;
            let id = p
                // A link attach (aya uses bpf_link_create here) takes no flags: links always
                // coexist with other programs (multi-attach); BPF_F_ALLOW_MULTI gives EINVAL.
                .attach(&cgroup, CgroupAttachMode::Single)
                .map_err(|e| KernelError::program(name, "attach to the cgroup v2 root", e))?;
            let link = p
                .take_link(id)
                .map_err(|e| KernelError::program(name, "take its link", e))?;
            let link = FdLink::try_from(link).map_err(|e| {
                KernelError::io(
                    format!("pinning the link of {name}"),
                    std::io::Error::other(e.to_string()),
                )
            })?;
            // The pinned link keeps the program attached after this process exits.
            link.pin(pin_dir.join(pin)).map_err(|e| KernelError::Pin {
                path: pin_dir.join(pin),
                source: Box::new(e),
            })?;
        }
        Ok(PuPorts {
            ports: typed(&mut obj, PORTS)?,
        })
    }

    /// Whether a split namespace's hook is pinned at `pin_dir`.
    pub fn attached(pin_dir: &Path) -> bool {
        LINKS.iter().all(|(_, pin)| pin_dir.join(pin).exists())
    }

    /// Opens the pinned table of a split namespace.
    pub fn open(pin_dir: &Path) -> Result<PuPorts, KernelError> {
        let path = pin_dir.join(PORTS);
        let data = MapData::from_pin(&path).map_err(|e| KernelError::map(PORTS, "open", e))?;
        let ports = HashMap::try_from(aya::maps::Map::HashMap(data))
            .map_err(|e| KernelError::map(PORTS, "open", e))?;
        Ok(PuPorts { ports })
    }

    /// Removes the pins at `pin_dir`: the programs detach and the table goes once no process
    /// holds it open. Nothing to do if there is none.
    pub fn detach(pin_dir: &Path) -> Result<(), KernelError> {
        remove_pins(pin_dir).map(|_| ())
    }

    /// The PU that owns TCP `port`, if any.
    pub fn owner(&self, port: u16) -> Result<Option<u32>, KernelError> {
        match self.ports.get(&tcp(port), 0) {
            Ok(o) => Ok(Some(o.pu)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(KernelError::map(PORTS, "lookup", e)),
        }
    }

    /// Claims TCP `port` for PU `pu` unless another PU owns it, exactly as the hook does at
    /// bind(): for ports the agent sees listening that no bind claimed (port 0 binds).
    pub fn claim(&mut self, port: u16, pu: u32) -> Result<Claim, KernelError> {
        let owner = FmPuOwner { pu, pad: 0 };
        for _ in 0..2 {
            match self.ports.insert(tcp(port), owner, BPF_NOEXIST) {
                Ok(()) => return Ok(Claim::Mine),
                Err(e) if errno(&e) == Some(libc::EEXIST) => {}
                Err(e) => return Err(KernelError::map(PORTS, "insert", e)),
            }
            match self.owner(port)? {
                Some(o) if o == pu => return Ok(Claim::Mine),
                Some(o) => return Ok(Claim::Taken(o)),
                // Released in between: try again.
                None => {}
            }
        }
        match self.owner(port)? {
            Some(o) if o != pu => Ok(Claim::Taken(o)),
            _ => Ok(Claim::Mine),
        }
    }

    /// Releases TCP `port` if PU `pu` owns it. Only the owner's agent releases a port and the
    /// hook only inserts into free slots, so the owner cannot change between the check and the
    /// delete.
    pub fn release(&mut self, port: u16, pu: u32) -> Result<bool, KernelError> {
        if self.owner(port)? != Some(pu) {
            return Ok(false);
        }
        match self.ports.remove(&tcp(port)) {
            Ok(()) => Ok(true),
            Err(e) if errno(&e) == Some(libc::ENOENT) => Ok(false),
            Err(e) => Err(KernelError::map(PORTS, "remove", e)),
        }
    }

    /// Every owned TCP port with its owner PU.
    pub fn ports(&self) -> Result<BTreeMap<u16, u32>, KernelError> {
        let mut out = BTreeMap::new();
        for entry in self.ports.iter() {
            let (k, v) = entry.map_err(|e| KernelError::map(PORTS, "iterate", e))?;
            if k.proto == IPPROTO_TCP {
                out.insert(k.port, v.pu);
            }
        }
        Ok(out)
    }

    /// The hook's bind counters at `pin_dir`.
    pub fn stats(pin_dir: &Path) -> Result<BindStats, KernelError> {
        let path = pin_dir.join(STATS);
        let data = MapData::from_pin(&path).map_err(|e| KernelError::map(STATS, "open", e))?;
        let stats: PerCpuArray<MapData, u64> =
            PerCpuArray::try_from(aya::maps::Map::PerCpuArray(data))
                .map_err(|e| KernelError::map(STATS, "open", e))?;
        let sum = |slot: u32| -> Result<u64, KernelError> {
            Ok(stats
                .get(&slot, 0)
                .map_err(|e| KernelError::map(STATS, "lookup", e))?
                .iter()
                .sum())
        };
        Ok(BindStats {
            claimed: sum(0)?,
            refused: sum(1)?,
        })
    }
}
