//! Attaching and detaching tier K: load the objects, pin programs and maps under the pin
//! directory, attach them to cgroups and sockhashes, and undo all of it.
//!
//! Lifecycle rules:
//! - Cgroup attachments are bpf_links owned by this process, not pinned: if the node dies,
//!   the kernel detaches capture at once, so workloads are never sent to a dead proxy port.
//! - Programs and maps are pinned under `pin_dir`, with the owner's pid in `fm_owner`;
//!   `flatmesh kernel status` reads them from another process.
//! - A dead owner's pins are stale; `attach` removes them (`cleanup_stale`) before loading.
//! - `attach` twice in one process with the same config returns the same tier (no second
//!   copy of any program); detach removes every pin and the directory.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};

use aya::maps::{Array, HashMap, MapData, PerCpuHashMap, SockHash};
use aya::programs::{
    CgroupAttachMode, CgroupSockAddr, CgroupSockopt, SkMsg, SkSkb, SockOps, SocketFilter,
};
use aya::{Ebpf, EbpfLoader};
use parking_lot::Mutex;

use crate::abi::{
    FmAddr, FmConnLimit, FmDirect, FmL7Conn, FmL7Hold, FmRoute, FmSettings, FmShortcut, FmSockKey,
    FmSource, FmTuple,
};
use crate::config::KernelConfig;
use crate::error::KernelError;

static CAPTURE_OBJ: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/capture.bpf.o"));
static REDIRECT_OBJ: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/redirect.bpf.o"));
static DISPATCH_OBJ: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/dispatch.bpf.o"));
static CONN_LIMIT_OBJ: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/conn_limit.bpf.o"));

const BPF_FS_MAGIC: i64 = 0xcafe4a11;

/// Tiers attached by this process, by pin directory, so a second `attach` finds the first.
static REGISTRY: Mutex<Vec<(PathBuf, Weak<Inner>)>> = Mutex::new(Vec::new());

/// Handle on an attached tier K. Clones share one attachment.
#[derive(Clone)]
pub struct KernelTier {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) cfg: KernelConfig,
    pub(crate) state: Mutex<Option<Loaded>>,
}

/// Typed handles on the maps the node writes, taken out of their objects.
pub(crate) struct Maps {
    pub services: Option<HashMap<MapData, FmAddr, FmAddr>>,
    pub bypass_pids: Option<HashMap<MapData, u32, u8>>,
    pub orig_by_cookie: Option<HashMap<MapData, u64, FmAddr>>,
    pub src_by_tuple: Option<HashMap<MapData, FmTuple, FmSource>>,
    pub redirect_ports: Option<HashMap<MapData, u16, u8>>,
    pub shortcuts: Option<HashMap<MapData, FmSockKey, FmShortcut>>,
    pub direct_bytes: Option<HashMap<MapData, FmSockKey, FmDirect>>,
    pub l7_socks: Option<SockHash<MapData, u64>>,
    pub l7_conns: Option<HashMap<MapData, u64, FmL7Conn>>,
    pub l7_hold: Option<HashMap<MapData, u64, FmL7Hold>>,
    pub routes: Option<Array<MapData, FmRoute>>,
    pub l7_ports: Option<HashMap<MapData, u16, u8>>,
    pub conn_limits: Option<HashMap<MapData, u16, FmConnLimit>>,
    pub conn_drops: Option<PerCpuHashMap<MapData, u16, u64>>,
}

pub(crate) struct Loaded {
    /// Dropping an `Ebpf` detaches its links and unloads unpinned programs.
    objects: Vec<Ebpf>,
    pub(crate) maps: Maps,
    pub(crate) program_ids: Vec<(String, u32)>,
    /// Which of `objects` holds the `fm_conn_limit` socket filter, when it is loaded.
    pub(crate) conn_limit_object: Option<usize>,
}

impl Loaded {
    /// The loaded `fm_conn_limit` socket filter.
    pub(crate) fn conn_limit_filter(&self) -> Result<&SocketFilter, KernelError> {
        const NAME: &str = "fm_conn_limit";
        let object = self
            .conn_limit_object
            .and_then(|i| self.objects.get(i))
            .ok_or(KernelError::MissingProgram {
                program: "fm_conn_limit (conn_limit is off in the config)",
            })?;
        object
            .program(NAME)
            .ok_or(KernelError::MissingProgram { program: NAME })?
            .try_into()
            .map_err(|e| KernelError::program(NAME, "be used as a socket filter", e))
    }
}

impl std::fmt::Debug for KernelTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelTier")
            .field("pin_dir", &self.inner.cfg.pin_dir)
            .finish()
    }
}

/// What `cleanup_stale` removed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CleanupReport {
    /// The dead owner's pid, when it was recorded.
    pub owner: Option<u32>,
    /// Pin names removed.
    pub removed: Vec<String>,
}

impl KernelTier {
    /// Loads, pins and attaches what `cfg` enables. Idempotent within a process; removes a
    /// crashed node's leftovers first; refuses to touch a live node's pins.
    pub fn attach(cfg: &KernelConfig) -> Result<KernelTier, KernelError> {
        require_root()?;
        let mut registry = REGISTRY.lock();
        registry.retain(|(_, w)| w.strong_count() > 0);
        if let Some(inner) = registry
            .iter()
            .find(|(p, _)| *p == cfg.pin_dir)
            .and_then(|(_, w)| w.upgrade())
        {
            if inner.state.lock().is_some() {
                if inner.cfg != *cfg {
                    return Err(KernelError::ConfigMismatch {
                        path: cfg.pin_dir.clone(),
                    });
                }
                return Ok(KernelTier { inner });
            }
        }
        ensure_bpffs(&cfg.pin_dir)?;
        let report = cleanup_stale(&cfg.pin_dir)?;
        if !report.removed.is_empty() {
            tracing::warn!(
                pin_dir = %cfg.pin_dir.display(),
                owner = ?report.owner,
                removed = report.removed.len(),
                "removed tier-K pins left by a node that is no longer running"
            );
        }
        std::fs::create_dir_all(&cfg.pin_dir)
            .map_err(|e| KernelError::io(format!("creating {}", cfg.pin_dir.display()), e))?;
        let loaded = match load_and_attach(cfg) {
            Ok(l) => l,
            Err(e) => {
                // Leave nothing half-attached behind.
                let _ = remove_pins(&cfg.pin_dir);
                return Err(e);
            }
        };
        let inner = Arc::new(Inner {
            cfg: cfg.clone(),
            state: Mutex::new(Some(loaded)),
        });
        registry.push((cfg.pin_dir.clone(), Arc::downgrade(&inner)));
        tracing::info!(pin_dir = %cfg.pin_dir.display(), capture = cfg.capture.is_some(),
            redirect = cfg.redirect, l7_dispatch = cfg.l7_dispatch,
            conn_limit = cfg.conn_limit, "tier K attached");
        Ok(KernelTier { inner })
    }

    /// The configuration this tier was attached with.
    pub fn config(&self) -> &KernelConfig {
        &self.inner.cfg
    }

    /// Detaches every program and removes every pin. Idempotent; other clones see `Detached`.
    pub fn detach(&self) -> Result<(), KernelError> {
        let loaded = self.inner.state.lock().take();
        let Some(loaded) = loaded else { return Ok(()) };
        drop(loaded);
        remove_pins(&self.inner.cfg.pin_dir)?;
        tracing::info!(pin_dir = %self.inner.cfg.pin_dir.display(), "tier K detached");
        Ok(())
    }

    /// Kernel ids of the loaded programs, by name (for tests and status).
    pub fn program_ids(&self) -> Result<Vec<(String, u32)>, KernelError> {
        self.with(|l| Ok(l.program_ids.clone()))
    }

    pub(crate) fn with<T>(
        &self,
        f: impl FnOnce(&mut Loaded) -> Result<T, KernelError>,
    ) -> Result<T, KernelError> {
        let mut state = self.inner.state.lock();
        match state.as_mut() {
            Some(l) => f(l),
            None => Err(KernelError::Detached),
        }
    }
}

fn require_root() -> Result<(), KernelError> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(KernelError::NotRoot);
    }
    Ok(())
}

/// Makes sure the pin directory's parent is on bpffs, mounting /sys/fs/bpf if needed.
pub(crate) fn ensure_bpffs(pin_dir: &Path) -> Result<(), KernelError> {
    let parent = pin_dir.parent().unwrap_or(Path::new("/sys/fs/bpf"));
    if is_bpffs(parent) {
        return Ok(());
    }
    let target = Path::new("/sys/fs/bpf");
    if parent != target {
        return Err(KernelError::BpffsMissing {
            path: parent.to_path_buf(),
            source: std::io::Error::other("not a bpffs directory"),
        });
    }
    std::fs::create_dir_all(target).map_err(|e| KernelError::BpffsMissing {
        path: target.into(),
        source: e,
    })?;
    // SAFETY: static NUL-terminated strings; mount(2) copies them.
    let rc = unsafe {
        libc::mount(
            c"bpf".as_ptr(),
            c"/sys/fs/bpf".as_ptr(),
            c"bpf".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(KernelError::BpffsMissing {
            path: target.into(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

fn is_bpffs(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: statfs writes into the zeroed struct; the path is NUL-terminated.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    rc == 0 && st.f_type as i64 == BPF_FS_MAGIC
}

fn pid_alive(pid: u32) -> bool {
    if pid == 0 {
        return false;
    }
    // SAFETY: signal 0 only checks that the process exists.
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Pid recorded in a pin directory's `fm_owner` map, if any.
pub(crate) fn pinned_owner(pin_dir: &Path) -> Option<u32> {
    let data = MapData::from_pin(pin_dir.join("fm_owner")).ok()?;
    let owner: Array<MapData, u64> = Array::try_from(aya::maps::Map::Array(data)).ok()?;
    owner.get(&0, 0).ok().map(|v| v as u32)
}

/// Removes a crashed node's pins. Refuses if the recorded owner is still running (and is
/// not this process). Nothing to do if the directory does not exist.
pub fn cleanup_stale(pin_dir: &Path) -> Result<CleanupReport, KernelError> {
    if !pin_dir.exists() {
        return Ok(CleanupReport::default());
    }
    let owner = pinned_owner(pin_dir);
    if let Some(pid) = owner {
        if pid != std::process::id() && pid_alive(pid) {
            return Err(KernelError::AlreadyAttached {
                path: pin_dir.to_path_buf(),
                pid,
            });
        }
        if pid == std::process::id() {
            let registry = REGISTRY.lock();
            let live = registry.iter().any(|(p, w)| {
                p == pin_dir && w.upgrade().is_some_and(|i| i.state.lock().is_some())
            });
            if live {
                return Err(KernelError::AlreadyAttached {
                    path: pin_dir.to_path_buf(),
                    pid,
                });
            }
        }
    }
    let removed = remove_pins(pin_dir)?;
    Ok(CleanupReport { owner, removed })
}

pub(crate) fn remove_pins(pin_dir: &Path) -> Result<Vec<String>, KernelError> {
    let mut removed = Vec::new();
    let entries = match std::fs::read_dir(pin_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(removed),
        Err(e) => return Err(KernelError::io(format!("listing {}", pin_dir.display()), e)),
    };
    for entry in entries {
        let entry =
            entry.map_err(|e| KernelError::io(format!("listing {}", pin_dir.display()), e))?;
        let path = entry.path();
        std::fs::remove_file(&path)
            .map_err(|e| KernelError::io(format!("removing pin {}", path.display()), e))?;
        removed.push(entry.file_name().to_string_lossy().into_owned());
    }
    std::fs::remove_dir(pin_dir)
        .map_err(|e| KernelError::io(format!("removing {}", pin_dir.display()), e))?;
    removed.sort();
    Ok(removed)
}

pub(crate) fn open_cgroup(path: &Path) -> Result<File, KernelError> {
    File::open(path).map_err(|e| KernelError::Cgroup {
        path: path.to_path_buf(),
        source: e,
    })
}

pub(crate) fn load(
    object: &'static str,
    bytes: &[u8],
    pin_dir: &Path,
) -> Result<Ebpf, KernelError> {
    EbpfLoader::new()
        .default_map_pin_directory(pin_dir)
        .load(bytes)
        .map_err(|e| KernelError::Load {
            object,
            source: Box::new(e),
        })
}

pub(crate) fn program<'a, T>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut T, KernelError>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program, Error = aya::programs::ProgramError>,
{
    let p = ebpf
        .program_mut(name)
        .ok_or(KernelError::MissingProgram { program: name })?;
    p.try_into()
        .map_err(|e| KernelError::program(name, "be used as its section type", e))
}

fn take_map(ebpf: &mut Ebpf, name: &'static str) -> Result<aya::maps::Map, KernelError> {
    ebpf.take_map(name)
        .ok_or(KernelError::MissingMap { map: name })
}

pub(crate) fn typed<M: TryFrom<aya::maps::Map, Error = aya::maps::MapError>>(
    ebpf: &mut Ebpf,
    name: &'static str,
) -> Result<M, KernelError> {
    M::try_from(take_map(ebpf, name)?).map_err(|e| KernelError::map(name, "open", e))
}

/// Loads a program, pins it as `prog_<name>` and records its id.
macro_rules! load_pin {
    ($ebpf:expr, $ty:ty, $name:expr, $pin_dir:expr, $ids:expr) => {{
        let p: &mut $ty = program($ebpf, $name)?;
        p.load()
            .map_err(|e| KernelError::program($name, "load (verifier)", e))?;
        p.pin($pin_dir.join(concat!("prog_", $name)))
            .map_err(|e| KernelError::Pin {
                path: $pin_dir.join(concat!("prog_", $name)),
                source: Box::new(e),
            })?;
        let id = p
            .info()
            .map_err(|e| KernelError::program($name, "report its id", e))?
            .id();
        $ids.push(($name.to_string(), id));
        p
    }};
}

fn load_and_attach(cfg: &KernelConfig) -> Result<Loaded, KernelError> {
    let dir = &cfg.pin_dir;
    let root = open_cgroup(&cfg.cgroup_root)?;
    let mut objects = Vec::new();
    let mut ids = Vec::new();
    let mut services = None;
    let mut bypass_pids = None;
    let mut orig_by_cookie = None;
    let mut src_by_tuple = None;
    let mut redirect_ports = None;
    let mut shortcuts = None;
    let mut direct_bytes = None;
    let mut l7_socks = None;
    let mut l7_conns = None;
    let mut l7_hold = None;
    let mut routes = None;
    let mut l7_ports = None;
    let mut conn_limits = None;
    let mut conn_drops = None;
    let mut conn_limit_object = None;

    if let Some(capture) = &cfg.capture {
        let workloads = open_cgroup(&capture.cgroup)?;
        let mut obj = load("capture", CAPTURE_OBJ, dir)?;
        for name in ["fm_connect4", "fm_connect6"] {
            // `name` must be 'static for the macro's concat!, so spell both out.
            let p: &mut CgroupSockAddr = if name == "fm_connect4" {
                load_pin!(&mut obj, CgroupSockAddr, "fm_connect4", dir, ids)
            } else {
                load_pin!(&mut obj, CgroupSockAddr, "fm_connect6", dir, ids)
            };
            p.attach(&workloads, CgroupAttachMode::Single)
                .map_err(|e| {
                    KernelError::program("fm_connect4/6", "attach to the capture cgroup", e)
                })?;
        }
        let p = load_pin!(&mut obj, SockOps, "fm_sockops_capture", dir, ids);
        p.attach(&root, CgroupAttachMode::Single).map_err(|e| {
            KernelError::program("fm_sockops_capture", "attach to the root cgroup", e)
        })?;
        let p = load_pin!(&mut obj, CgroupSockopt, "fm_getsockopt", dir, ids);
        p.attach(&root, CgroupAttachMode::Single)
            .map_err(|e| KernelError::program("fm_getsockopt", "attach to the root cgroup", e))?;
        services = Some(typed(&mut obj, "fm_services")?);
        bypass_pids = Some(typed(&mut obj, "fm_bypass_pids")?);
        orig_by_cookie = Some(typed(&mut obj, "fm_orig_by_cookie")?);
        src_by_tuple = Some(typed(&mut obj, "fm_src_by_tuple")?);
        objects.push(obj);
    }

    if cfg.redirect {
        let mut obj = load("redirect", REDIRECT_OBJ, dir)?;
        let socks: SockHash<MapData, [u8; 48]> = typed(&mut obj, "fm_redirect_socks")?;
        let p = load_pin!(&mut obj, SkMsg, "fm_sk_msg", dir, ids);
        p.attach(socks.fd())
            .map_err(|e| KernelError::program("fm_sk_msg", "attach to fm_redirect_socks", e))?;
        let p = load_pin!(&mut obj, SockOps, "fm_sockops_redirect", dir, ids);
        p.attach(&root, CgroupAttachMode::Single).map_err(|e| {
            KernelError::program("fm_sockops_redirect", "attach to the root cgroup", e)
        })?;
        redirect_ports = Some(typed(&mut obj, "fm_redirect_ports")?);
        shortcuts = Some(typed(&mut obj, "fm_shortcuts")?);
        direct_bytes = Some(typed(&mut obj, "fm_direct_bytes")?);
        // The sockhash stays alive through its pin and the sk_msg attachment; the handle
        // itself is not needed after attaching.
        drop(socks);
        objects.push(obj);
    }

    if cfg.l7_dispatch {
        let mut obj = load("dispatch", DISPATCH_OBJ, dir)?;
        let socks: SockHash<MapData, u64> = typed(&mut obj, "fm_l7_socks")?;
        let p = load_pin!(&mut obj, SkSkb, "fm_parser", dir, ids);
        // Verdict-only by default: the kernel hands the verdict each skb straight from the
        // receive path. With the strparser attached, sustained ping-pong over spliced pairs
        // stalls or resets on this kernel (6.18; see docs/kernel.md), so it is opt-in.
        if cfg.l7_stream_parser {
            p.attach(socks.fd())
                .map_err(|e| KernelError::program("fm_parser", "attach to fm_l7_socks", e))?;
        }
        let p = load_pin!(&mut obj, SkSkb, "fm_verdict", dir, ids);
        p.attach(socks.fd())
            .map_err(|e| KernelError::program("fm_verdict", "attach to fm_l7_socks", e))?;
        let p = load_pin!(&mut obj, SockOps, "fm_sockops_l7", dir, ids);
        p.attach(&root, CgroupAttachMode::Single)
            .map_err(|e| KernelError::program("fm_sockops_l7", "attach to the root cgroup", e))?;
        l7_ports = Some(typed(&mut obj, "fm_l7_ports")?);
        l7_socks = Some(socks);
        l7_conns = Some(typed(&mut obj, "fm_l7_conns")?);
        l7_hold = Some(typed(&mut obj, "fm_l7_hold")?);
        routes = Some(typed(&mut obj, "fm_routes")?);
        let mut huffman: Array<MapData, [u32; crate::huffman::TABLE_LEN]> =
            typed(&mut obj, "fm_huffman")?;
        let table: [u32; crate::huffman::TABLE_LEN] =
            crate::huffman::table()
                .try_into()
                .map_err(|_| KernelError::MissingMap {
                    map: "fm_huffman (table size differs from the program's)",
                })?;
        huffman
            .set(0, table, 0)
            .map_err(|e| KernelError::map("fm_huffman", "load the HPACK Huffman table", e))?;
        objects.push(obj);
    }

    if cfg.conn_limit {
        let mut obj = load("conn_limit", CONN_LIMIT_OBJ, dir)?;
        // Attached to listening sockets one by one (`KernelTier::limit_connections`).
        load_pin!(&mut obj, SocketFilter, "fm_conn_limit", dir, ids);
        conn_limits = Some(typed(&mut obj, "fm_conn_limits")?);
        conn_drops = Some(typed(&mut obj, "fm_conn_drops")?);
        conn_limit_object = Some(objects.len());
        objects.push(obj);
    }

    let Some(first) = objects.first_mut() else {
        return Err(KernelError::NothingEnabled);
    };
    let mut owner: Array<MapData, u64> = typed(first, "fm_owner")?;
    owner
        .set(0, u64::from(std::process::id()), 0)
        .map_err(|e| KernelError::map("fm_owner", "record the owner pid", e))?;
    let netns = if cfg.own_netns_only {
        let probe = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None)
            .map_err(|e| {
                KernelError::io(
                    "opening a socket to read this network namespace's cookie",
                    e,
                )
            })?;
        crate::redirect::netns_cookie(&probe)?
    } else {
        0
    };
    let mut settings: Array<MapData, FmSettings> = typed(first, "fm_settings")?;
    settings
        .set(0, FmSettings { netns }, 0)
        .map_err(|e| KernelError::map("fm_settings", "record the node's network namespace", e))?;
    Ok(Loaded {
        objects,
        maps: Maps {
            services,
            bypass_pids,
            orig_by_cookie,
            src_by_tuple,
            redirect_ports,
            shortcuts,
            direct_bytes,
            l7_socks,
            l7_conns,
            l7_hold,
            routes,
            l7_ports,
            conn_limits,
            conn_drops,
        },
        program_ids: ids,
        conn_limit_object,
    })
}

impl Drop for Loaded {
    fn drop(&mut self) {
        // Objects first: that closes the links (detaching cgroup programs) before the pins go.
        self.objects.clear();
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The last handle went away without detach(): clean up as detach would, so a node
        // that exits normally never leaves pins behind.
        if let Some(loaded) = self.state.get_mut().take() {
            drop(loaded);
            if let Err(e) = remove_pins(&self.cfg.pin_dir) {
                tracing::warn!(error = %e, "tier K: removing pins on drop failed");
            }
        }
    }
}
