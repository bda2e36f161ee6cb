//! Kernel receive-side dispatch (issue 5, mode b): the `sk_reuseport` program of
//! `bpf/qnp_rsd.bpf.c`, built by clang in build.rs and loaded with aya 0.14, and the lowering of
//! skip-and-check rules into its maps.
//!
//! The lowering is the Matcher's image itself ([`Image::compile`], §4.2.2): every CAM entry
//! becomes a key of the program's `qnp_cam` hash map and its paired RAM word the value. The
//! program then runs the same walk as [`Image::run`] on the first packet of each request, so the
//! kernel tier executes exactly the table image a NIC would hold, with the same 512-entry limit,
//! and its cost grows with the skip-and-checks a request takes rather than with the rule count.
//!
//! Each app's entries carry a version. Replacing an app's rules writes the new version, flips
//! `qnp_epoch[app]`, and only at the app's next replacement deletes the version before: a packet
//! reads the epoch once, so it walks the old or the new entries, never a mix, and other apps'
//! entries are never touched (§5.2.2).

use crate::image::{CamEntry, Image, RamEntry, CHECK_BYTES};
use crate::rules::RuleSet;
use crate::QnpError;
use aya::maps::{Array, HashMap as BpfHashMap, MapData, ReusePortSockArray};
use aya::programs::SkReuseport;
use aya::Ebpf;
use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd};

/// Worker sockets the program can select from.
pub const MAX_WORKERS: usize = 64;
/// Entries `qnp_cam` holds: two versions of every app's entries with room to spare.
pub const CAM_MAP_ENTRIES: usize = 4096;

/// One CAM key as the program reads it; the layout must match `struct cam_key` in the C file.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CamKey {
    pub app_id: u8,
    pub req_type: u8,
    pub field: u8,
    pub state: u8,
    pub string: [u8; CHECK_BYTES],
    pub version: u32,
}

// SAFETY: plain bytes and a u32, no padding (4 + 8 + 4 bytes), valid for any bit pattern.
unsafe impl aya::Pod for CamKey {}

impl CamKey {
    fn new(e: &CamEntry, version: u32) -> CamKey {
        CamKey {
            app_id: e.app_id,
            req_type: e.req_type,
            field: e.field,
            state: e.state,
            string: e.string,
            version,
        }
    }
}

/// The map contents a rule set lowers to: per app, its image entries in table order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelProgram {
    pub apps: BTreeMap<u8, Vec<(CamEntry, RamEntry)>>,
}

impl KernelProgram {
    /// Total CAM entries.
    pub fn entries(&self) -> usize {
        self.apps.values().map(Vec::len).sum()
    }
}

/// Lowers a rule set to the kernel program's maps through the Matcher's image; fails as
/// [`Image::compile`] does when the rules do not fit its 512 entries.
pub fn lower(set: &RuleSet) -> Result<KernelProgram, QnpError> {
    let img = Image::compile(set)?;
    let mut prog = KernelProgram::default();
    for (cam, ram) in img.cam.iter().zip(&img.ram) {
        prog.apps.entry(cam.app_id).or_default().push((*cam, *ram));
    }
    Ok(prog)
}

fn kerr(what: &str, e: impl std::fmt::Display) -> QnpError {
    QnpError::Kernel(format!("{what}: {e}"))
}

/// The loaded program and its maps.
pub struct KernelRsd {
    bpf: Ebpf,
    cam: BpfHashMap<MapData, CamKey, u32>,
    epoch: Array<MapData, u32>,
    workers: ReusePortSockArray<MapData>,
}

impl KernelRsd {
    /// Loads the program and installs `prog`.
    pub fn load(prog: &KernelProgram) -> Result<KernelRsd, QnpError> {
        let mut bpf = Ebpf::load(aya::include_bytes_aligned!(concat!(
            env!("OUT_DIR"),
            "/qnp_rsd.bpf.o"
        )))
        .map_err(|e| kerr("loading qnp_rsd.bpf.o", e))?;
        let p: &mut SkReuseport = bpf
            .program_mut("qnp_select")
            .ok_or_else(|| QnpError::Kernel("qnp_select is missing from the object".into()))?
            .try_into()
            .map_err(|e| kerr("qnp_select is not an sk_reuseport program", e))?;
        p.load()
            .map_err(|e| kerr("the verifier rejected qnp_select", e))?;
        let mut take = |name: &str| {
            bpf.take_map(name)
                .ok_or_else(|| QnpError::Kernel(format!("map {name} is missing from the object")))
        };
        let cam = BpfHashMap::try_from(take("qnp_cam")?).map_err(|e| kerr("qnp_cam", e))?;
        let epoch = Array::try_from(take("qnp_epoch")?).map_err(|e| kerr("qnp_epoch", e))?;
        let workers = ReusePortSockArray::try_from(take("qnp_workers")?)
            .map_err(|e| kerr("qnp_workers", e))?;
        let mut k = KernelRsd {
            bpf,
            cam,
            epoch,
            workers,
        };
        for (app, entries) in &prog.apps {
            k.install_app(*app, entries)?;
        }
        Ok(k)
    }

    /// Replaces the entries of one app (an empty list removes its rules: its requests are
    /// dropped). Other apps' entries are not touched.
    pub fn install_app(
        &mut self,
        app_id: u8,
        entries: &[(CamEntry, RamEntry)],
    ) -> Result<(), QnpError> {
        let app = u32::from(app_id);
        let live = self
            .epoch
            .get(&app, 0)
            .map_err(|e| kerr("reading qnp_epoch", e))?;
        let next = live ^ 1;
        // The version before `live`: no packet reads it since the last flip.
        let stale: Vec<CamKey> = self
            .cam
            .keys()
            .filter_map(Result::ok)
            .filter(|k| k.app_id == app_id && k.version == next)
            .collect();
        for k in stale {
            self.cam
                .remove(&k)
                .map_err(|e| kerr("removing a stale qnp_cam entry", e))?;
        }
        // Backwards, so that the first of two equal keys wins, as in a CAM.
        for (cam, ram) in entries.iter().rev() {
            self.cam
                .insert(CamKey::new(cam, next), ram.to_word(), 0)
                .map_err(|e| {
                    kerr(
                        &format!(
                            "writing qnp_cam (it holds {CAM_MAP_ENTRIES} entries, two versions per app)"
                        ),
                        e,
                    )
                })?;
        }
        self.epoch
            .set(app, next, 0)
            .map_err(|e| kerr("flipping qnp_epoch", e))
    }

    /// The program's total run time and run count, which the kernel keeps while the sysctl
    /// `kernel.bpf_stats_enabled` is 1 (read from the program fd's fdinfo); `None` if unreadable.
    pub fn run_stats(&mut self) -> Option<(u64, u64)> {
        let p: &mut SkReuseport = self.bpf.program_mut("qnp_select")?.try_into().ok()?;
        let fd = p.fd().ok()?.as_fd().as_raw_fd();
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        Some((field("run_time_ns:")?, field("run_cnt:")?))
    }

    /// Makes `socket` the target of queue `index`.
    pub fn set_worker(&mut self, index: u32, socket: &impl AsRawFd) -> Result<(), QnpError> {
        self.workers
            .set(index, socket, 0)
            .map_err(|e| kerr(&format!("adding worker {index} to qnp_workers"), e))
    }

    /// Attaches the program to the SO_REUSEPORT group of `socket`.
    pub fn attach(&mut self, socket: impl AsFd) -> Result<(), QnpError> {
        let p: &mut SkReuseport = self
            .bpf
            .program_mut("qnp_select")
            .ok_or_else(|| QnpError::Kernel("qnp_select is missing".into()))?
            .try_into()
            .map_err(|e| kerr("qnp_select", e))?;
        p.attach(socket)
            .map_err(|e| kerr("attaching qnp_select to the reuseport group", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lowers_the_image_per_app() {
        let set = RuleSet::parse(
            "r",
            "rule 1 0 0 \"a.c\" -> 2\ndefault 1 0 -> 5\nrule 2 0 0 \"x\" -> 1",
        )
        .unwrap();
        let img = Image::compile(&set).unwrap();
        let p = lower(&set).unwrap();
        assert_eq!(p.entries(), img.cam.len());
        assert_eq!(p.apps.keys().copied().collect::<Vec<_>>(), vec![1, 2]);
        assert!(p.apps[&1].iter().all(|(c, _)| c.app_id == 1));
        assert_eq!(
            std::mem::size_of::<CamKey>(),
            16,
            "struct cam_key is 16 bytes"
        );
    }

    #[test]
    fn refuses_what_the_tables_cannot_hold() {
        // 600 rules over 60 request types, two skip-and-checks each: 60 start entries and
        // 4 per rule, far more than 512.
        let many: String = (0..600)
            .map(|i| format!("rule 1 {} 0 \"{i:03}.x\" -> 1\n", i % 60))
            .collect();
        let e = lower(&RuleSet::parse("r", &many).unwrap()).unwrap_err();
        assert!(matches!(e, QnpError::TableFull(_)), "{e}");
        assert!(e.to_string().contains("entries over"), "{e}");
    }
}
