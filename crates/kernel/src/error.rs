//! The one error type of the kernel tier. Every message says what is wrong and what to do.

use std::path::PathBuf;

/// Why tier K could not be attached or used.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("tier K needs root (CAP_BPF + CAP_NET_ADMIN + CAP_SYS_ADMIN); run the node as root or leave `kernel:` out of the config to use the user tiers only")]
    NotRoot,
    #[error("bpffs is not mounted at {path} and mounting it failed ({source}); run `mount -t bpf bpf /sys/fs/bpf`")]
    BpffsMissing {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cgroup {path} cannot be opened ({source}); point the config at a cgroup v2 directory (e.g. /sys/fs/cgroup/unified or /sys/fs/cgroup)")]
    Cgroup {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is held by a running flatmesh node (pid {pid}); stop it first, or give this node its own `pin_dir`")]
    AlreadyAttached { path: PathBuf, pid: u32 },
    #[error("tier K is already attached at {path} by this process with a different configuration; detach it first")]
    ConfigMismatch { path: PathBuf },
    #[error("loading the eBPF object {object} failed: {source}; check that the kernel has BTF and sockmap/cgroup BPF support (`flatmesh kernel status` shows what is loaded)")]
    Load {
        object: &'static str,
        #[source]
        source: Box<aya::EbpfError>,
    },
    #[error("eBPF program {program} failed to {action}: {source}; the kernel log (`dmesg`) and the verifier message above say why")]
    Program {
        program: &'static str,
        action: &'static str,
        #[source]
        source: Box<aya::programs::ProgramError>,
    },
    #[error("eBPF program {program} is missing from its object; rebuild flatmesh-kernel (the object and the loader are out of sync)")]
    MissingProgram { program: &'static str },
    #[error("eBPF map {map} is missing; rebuild flatmesh-kernel (the object and the loader are out of sync)")]
    MissingMap { map: &'static str },
    #[error("eBPF map {map}: {action} failed: {source}; if the map is full `flatmesh kernel status` shows it, and a socket being added may already have closed")]
    Map {
        map: &'static str,
        action: &'static str,
        #[source]
        source: Box<aya::maps::MapError>,
    },
    #[error("pinning {path} failed: {source}; check that {path} is on bpffs and writable by root")]
    Pin {
        path: PathBuf,
        #[source]
        source: Box<aya::pin::PinError>,
    },
    #[error("{what} failed: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("service {service} and proxy {proxy} differ in address family; give the proxy a listener of the same family (connect4 can only rewrite to IPv4)")]
    FamilyMismatch {
        service: std::net::SocketAddr,
        proxy: std::net::SocketAddr,
    },
    #[error("the tier-K route table holds {max} entries but {given} were given; install what the tier-K lowering gives (`RuleProgram::kernel().entries`), which ends an overlong table with a catch-all punt")]
    TooManyRoutes { given: usize, max: usize },
    #[error("the kernel config enables nothing (capture, redirect, l7_dispatch and conn_limit are all off); leave `kernel:` out of the config instead")]
    NothingEnabled,
    #[error("tier K has been detached; attach it again before using it")]
    Detached,
}

impl KernelError {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        KernelError::Io {
            what: what.into(),
            source,
        }
    }

    pub(crate) fn map(
        map: &'static str,
        action: &'static str,
        source: aya::maps::MapError,
    ) -> Self {
        KernelError::Map {
            map,
            action,
            source: Box::new(source),
        }
    }

    pub(crate) fn program(
        program: &'static str,
        action: &'static str,
        source: aya::programs::ProgramError,
    ) -> Self {
        KernelError::Program {
            program,
            action,
            source: Box::new(source),
        }
    }
}
