//! Kernel receive-side dispatch (issue 5, mode b): the `sk_reuseport` program of
//! `bpf/qnp_rsd.bpf.c`, built by clang in build.rs and loaded with aya 0.14, and the lowering of
//! skip-and-check rules into its maps.
//!
//! The program reads the QNP header and the first TLV field of every packet, so the lowering
//! accepts rules whose pattern fits in 16 bytes, at most 64 rules. A rule on another field than
//! the first TLV's sees an empty value, as a missing field does in user space; the generated code
//! puts a message's dispatch field first, so rules on it behave the same in both tiers.

use crate::rules::{PatByte, RuleSet};
use crate::QnpError;
use aya::maps::{Array, HashMap as BpfHashMap, MapData, ReusePortSockArray};
use aya::programs::SkReuseport;
use aya::Ebpf;
use std::os::fd::{AsFd, AsRawFd};

/// Rules the program holds (its array size).
pub const MAX_RULES: usize = 64;
/// Pattern bytes one rule can hold.
pub const MAX_PAT: usize = 16;
/// Worker sockets the program can select from.
pub const MAX_WORKERS: usize = 64;

/// One rule as the program reads it; the layout must match `struct qnp_rule` in the C file.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KernelRule {
    pub app_id: u8,
    pub req_type: u8,
    pub field: u8,
    pub len: u8,
    pub queue: u8,
    pub pad: [u8; 3],
    pub bytes: [u8; MAX_PAT],
    pub mask: [u8; MAX_PAT],
}

// SAFETY: plain bytes, no padding beyond the explicit `pad`, valid for any bit pattern.
unsafe impl aya::Pod for KernelRule {}

/// The map contents a rule set lowers to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelProgram {
    pub rules: Vec<KernelRule>,
    /// `(app_id << 8 | req_type, queue)`.
    pub defaults: Vec<(u32, u32)>,
}

/// Lowers a rule set to the kernel program's maps, or says which rule cannot run there.
pub fn lower(set: &RuleSet) -> Result<KernelProgram, QnpError> {
    if set.rules.len() > MAX_RULES {
        return Err(QnpError::TableFull(format!(
            "{} rules do not fit the kernel dispatcher's {MAX_RULES}: {} over; use the software dispatcher or fewer rules",
            set.rules.len(),
            set.rules.len() - MAX_RULES
        )));
    }
    let mut rules = Vec::with_capacity(set.rules.len());
    for r in &set.rules {
        if r.pattern.len() > MAX_PAT {
            return Err(QnpError::TableFull(format!(
                "the rule on line {} has a {}-byte pattern; the kernel dispatcher reads {MAX_PAT} bytes of the field; shorten it or use the software dispatcher",
                r.line,
                r.pattern.len()
            )));
        }
        let mut k = KernelRule {
            app_id: r.app_id,
            req_type: r.req_type,
            field: r.field,
            // Bounded by MAX_PAT just above.
            len: r.pattern.len() as u8,
            queue: r.queue,
            ..KernelRule::default()
        };
        for (i, p) in r.pattern.iter().enumerate() {
            if let PatByte::Byte(b) = p {
                k.bytes[i] = *b;
                k.mask[i] = 0xff;
            }
        }
        rules.push(k);
    }
    let defaults = set
        .defaults
        .iter()
        .map(|((a, t), (q, _))| (u32::from(*a) << 8 | u32::from(*t), u32::from(*q)))
        .collect();
    Ok(KernelProgram { rules, defaults })
}

fn kerr(what: &str, e: impl std::fmt::Display) -> QnpError {
    QnpError::Kernel(format!("{what}: {e}"))
}

/// The loaded program and its maps.
pub struct KernelRsd {
    // Keeps the program loaded.
    _bpf: Ebpf,
    rules: Array<MapData, KernelRule>,
    nrules: Array<MapData, u32>,
    defaults: BpfHashMap<MapData, u32, u32>,
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
        let rules = Array::try_from(take("qnp_rules")?).map_err(|e| kerr("qnp_rules", e))?;
        let nrules = Array::try_from(take("qnp_nrules")?).map_err(|e| kerr("qnp_nrules", e))?;
        let defaults =
            BpfHashMap::try_from(take("qnp_defaults")?).map_err(|e| kerr("qnp_defaults", e))?;
        let workers = ReusePortSockArray::try_from(take("qnp_workers")?)
            .map_err(|e| kerr("qnp_workers", e))?;
        let mut k = KernelRsd {
            _bpf: bpf,
            rules,
            nrules,
            defaults,
            workers,
        };
        k.install(prog)?;
        Ok(k)
    }

    /// Writes the rules. The count goes last and to zero first, so a packet sees a prefix of
    /// the old or the new rules, never a rule half-written.
    pub fn install(&mut self, prog: &KernelProgram) -> Result<(), QnpError> {
        self.nrules
            .set(0, 0, 0)
            .map_err(|e| kerr("clearing qnp_nrules", e))?;
        for (i, r) in prog.rules.iter().enumerate() {
            // lower() caps the rules at MAX_RULES.
            self.rules
                .set(i as u32, *r, 0)
                .map_err(|e| kerr("writing qnp_rules", e))?;
        }
        let old: Vec<u32> = self.defaults.keys().filter_map(Result::ok).collect();
        for k in old {
            let _ = self.defaults.remove(&k);
        }
        for (k, q) in &prog.defaults {
            self.defaults
                .insert(k, q, 0)
                .map_err(|e| kerr("writing qnp_defaults", e))?;
        }
        self.nrules
            .set(0, prog.rules.len() as u32, 0)
            .map_err(|e| kerr("writing qnp_nrules", e))
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
            ._bpf
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
    fn lowers_patterns_to_bytes_and_masks() {
        let set = RuleSet::parse("r", "rule 1 0 0 \"a.c\" -> 2\ndefault 1 0 -> 5").unwrap();
        let p = lower(&set).unwrap();
        assert_eq!(p.rules[0].len, 3);
        assert_eq!(p.rules[0].bytes[..3], [b'a', 0, b'c']);
        assert_eq!(p.rules[0].mask[..4], [0xff, 0, 0xff, 0]);
        assert_eq!(p.defaults, vec![(0x100, 5)]);
        assert_eq!(
            std::mem::size_of::<KernelRule>(),
            40,
            "struct qnp_rule is 40 bytes"
        );
    }

    #[test]
    fn refuses_what_the_kernel_cannot_hold() {
        let long = RuleSet::parse("r", "rule 1 0 0 \"0123456789abcdefg\" -> 2").unwrap();
        assert!(lower(&long)
            .unwrap_err()
            .to_string()
            .contains("line 1 has a 17-byte pattern"));
        let many: String = (0..65)
            .map(|i| format!("rule 1 0 0 \"{i}\" -> 1\n"))
            .collect();
        let e = lower(&RuleSet::parse("r", &many).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("1 over"), "{e}");
    }
}
