//! Kernel TLS: whether the kernel could take over the record layer, and why it does not.
//!
//! With kernel TLS a socket gets the `tls` upper-layer protocol after the handshake
//! (`setsockopt(TCP_ULP, "tls")`), rustls hands it the session keys, and the kernel encrypts
//! what is written, so relayed bytes could still go socket to socket (tier K) while encrypted.
//! That is the seam: [`probe`] says whether the kernel has it. The kernels of our build and
//! test machines are built without `CONFIG_TLS` (the setsockopt fails with `ENOENT`), so the
//! key handover is not written: it could not be tested here. TLS runs in rustls in user space
//! (ring, with the CPU's AES instructions), and `/ready` says so. docs/security.md, "Mutual
//! TLS".

use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::OnceLock;

/// `IPPROTO_TCP` and `TCP_ULP` (linux/tcp.h).
const IPPROTO_TCP: i32 = 6;
const TCP_ULP: i32 = 31;

/// What the probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelTls {
    /// The kernel accepted the `tls` ULP on a connected TCP socket.
    Available,
    /// It did not; the reason, for `/ready` and the log.
    Unavailable(String),
}

impl std::fmt::Display for KernelTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KernelTls::Available => write!(
                f,
                "kernel TLS: the kernel has it (TCP_ULP \"tls\"), but flatmesh does not hand it keys yet; TLS runs in rustls in user space"
            ),
            KernelTls::Unavailable(why) => write!(
                f,
                "kernel TLS: not used: {why}; TLS runs in rustls in user space"
            ),
        }
    }
}

/// Probes once per process (a loopback connection and one setsockopt).
pub fn probe() -> &'static KernelTls {
    static FOUND: OnceLock<KernelTls> = OnceLock::new();
    FOUND.get_or_init(|| match try_ulp() {
        Ok(()) => KernelTls::Available,
        Err(e) if e.raw_os_error() == Some(2) => KernelTls::Unavailable(
            "the kernel has no TLS module (setsockopt TCP_ULP \"tls\": ENOENT; built without CONFIG_TLS, or `modprobe tls` not run)".into(),
        ),
        Err(e) => KernelTls::Unavailable(format!("setsockopt TCP_ULP \"tls\" failed: {e}")),
    })
}

/// Sets the `tls` ULP on a connected loopback socket (the kernel takes it only on an
/// established connection).
fn try_ulp() -> std::io::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let stream = TcpStream::connect(listener.local_addr()?)?;
    let _accepted = listener.accept()?;
    set_ulp(&stream, b"tls")
}

#[allow(unsafe_code)]
fn set_ulp(stream: &TcpStream, name: &[u8]) -> std::io::Result<()> {
    extern "C" {
        fn setsockopt(
            fd: std::os::raw::c_int,
            level: std::os::raw::c_int,
            option: std::os::raw::c_int,
            value: *const std::os::raw::c_void,
            length: u32,
        ) -> std::os::raw::c_int;
    }
    let length = u32::try_from(name.len()).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    // SAFETY: the descriptor is open for the call (borrowed from `stream`), and the value
    // pointer and length describe `name`, which outlives the call; the kernel only reads it.
    let result = unsafe {
        setsockopt(
            stream.as_raw_fd(),
            IPPROTO_TCP,
            TCP_ULP,
            name.as_ptr().cast(),
            length,
        )
    };
    if result == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whatever the kernel, the probe gives an answer and a reason, and the answer matches
    /// what the kernel says about its modules.
    #[test]
    fn the_probe_answers_and_matches_the_kernel() {
        let found = probe();
        let text = found.to_string();
        assert!(text.contains("rustls in user space"), "{text}");
        let loaded = std::fs::read_to_string("/proc/modules")
            .map(|m| m.lines().any(|l| l.starts_with("tls ")))
            .unwrap_or(false);
        if loaded {
            assert_eq!(found, &KernelTls::Available, "the tls module is loaded");
        }
        if let KernelTls::Unavailable(why) = found {
            assert!(!why.is_empty());
        }
    }
}
