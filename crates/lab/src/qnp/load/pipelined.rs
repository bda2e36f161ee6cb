//! A lean closed-loop load generator for the benchmark: one thread, `sockets` UDP sockets, each
//! with `window` single-packet QNP requests outstanding, sent and received in batches
//! (`sendmmsg`/`recvmmsg`) and busy-polled.
//!
//! Why a second generator: on two cores the load generator gets one core and the system under
//! test the other. The QNP [`flatmesh_qnp::transport::Endpoint`] client costs about as much per request
//! as a worker, so it cannot load a worker's core, let alone show that one mode needs less of
//! it than another. Batching makes a request cost the generator a fraction of a system call, so
//! the server's core is the bottleneck, which is what the benchmark compares. It speaks the same
//! QNP on the wire (packets from [`segment`], responses matched by `req_acked_id`); it only
//! skips what single-packet requests do not need (reassembly), and a request unanswered
//! after [`TIMEOUT`] counts as a timeout and is replaced by a new one instead of retransmitted.

use super::{request, LoadReport, Workload, Zipf};
use crate::LabError;
use flatmesh_qnp::header::{QnpHeader, FLAG_ACK};
use flatmesh_qnp::transport::{segment, QnpConfig};
use rand::rngs::StdRng;
use rand::SeedableRng;
use std::collections::HashMap;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// How long a request may stay unanswered before it counts as a timeout.
pub const TIMEOUT: Duration = Duration::from_millis(200);
/// Packets per `sendmmsg`/`recvmmsg`.
const BATCH: usize = 32;
const BUF: usize = 2048;

struct Client {
    sock: UdpSocket,
    next_id: u32,
    /// req_id -> (sent at, the worker that must answer).
    outstanding: HashMap<u32, (Instant, Option<u8>)>,
}

/// Runs the generator on the calling thread for `duration`.
pub fn run(
    target: SocketAddr,
    sockets: usize,
    window: usize,
    duration: Duration,
    workload: &Workload,
) -> Result<LoadReport, LabError> {
    let cfg = QnpConfig::default();
    let zipf = match workload {
        Workload::KvGet { keys, s } => Some(Zipf::new(super::keys_per_range(*keys), *s)),
        _ => None,
    };
    let mut rng = StdRng::seed_from_u64(7);
    let bind = SocketAddr::new(target.ip(), 0);
    let mut clients = Vec::new();
    for _ in 0..sockets.max(1) {
        let sock = UdpSocket::bind(bind)
            .map_err(|e| LabError::io(format!("binding a load client on {bind}"), e))?;
        sock.set_nonblocking(true)
            .map_err(|e| LabError::io("configuring a load client socket", e))?;
        clients.push(Client {
            sock,
            next_id: 1,
            outstanding: HashMap::new(),
        });
    }
    let dest = socket2::SockAddr::from(target);
    let mut rx = vec![0u8; BATCH * BUF];
    let mut tx: Vec<bytes::Bytes> = Vec::with_capacity(BATCH);
    let (mut lat, mut errors, mut wrong) = (Vec::with_capacity(1 << 20), 0u64, 0u64);
    let start = Instant::now();
    let deadline = start + duration;
    let mut last_sweep = start;
    // Fill every window.
    for c in &mut clients {
        tx.clear();
        for _ in 0..window.max(1) {
            tx.push(next_packet(c, workload, zipf.as_ref(), &mut rng, &cfg)?);
        }
        send_batch(&c.sock, &dest, &tx)?;
    }
    let mut now = Instant::now();
    let mut idle = Duration::ZERO;
    while now < deadline {
        let round = now;
        let mut received = false;
        for c in &mut clients {
            let lens = recv_batch(&c.sock, &mut rx)?;
            received |= !lens.is_empty();
            now = Instant::now();
            tx.clear();
            for (i, len) in lens.iter().enumerate() {
                let pkt = &rx[i * BUF..i * BUF + len];
                let Ok((hdr, payload)) = QnpHeader::parse(pkt) else {
                    continue;
                };
                if hdr.pkt_flag & FLAG_ACK == 0 {
                    continue;
                }
                // A late answer to a request already counted as a timeout is ignored.
                let Some((sent, expect)) = c.outstanding.remove(&hdr.req_acked_id) else {
                    continue;
                };
                lat.push((now - sent).as_nanos() as u64);
                if expect.is_some_and(|q| payload_first_value_byte(payload) != Some(q)) {
                    wrong += 1;
                }
                tx.push(next_packet(c, workload, zipf.as_ref(), &mut rng, &cfg)?);
            }
            if !tx.is_empty() {
                send_batch(&c.sock, &dest, &tx)?;
            }
        }
        if !received {
            idle += now - round;
        }
        if now - last_sweep > TIMEOUT / 4 {
            last_sweep = now;
            for c in &mut clients {
                let before = c.outstanding.len();
                c.outstanding.retain(|_, (sent, _)| now - *sent < TIMEOUT);
                let lost = before - c.outstanding.len();
                errors += lost as u64;
                tx.clear();
                for _ in 0..lost {
                    tx.push(next_packet(c, workload, zipf.as_ref(), &mut rng, &cfg)?);
                }
                send_batch(&c.sock, &dest, &tx)?;
            }
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    Ok(LoadReport {
        idle_fraction: Some(idle.as_secs_f64() / seconds.max(1e-9)),
        ..super::report(lat, errors, wrong, seconds)
    })
}

/// The worker index the benchmark's service answers with: the first byte of the response
/// payload, which is raw (not TLV) for [`crate::qnp::bench::worker_echo`].
fn payload_first_value_byte(payload: &[u8]) -> Option<u8> {
    payload.first().copied()
}

fn next_packet(
    c: &mut Client,
    workload: &Workload,
    zipf: Option<&Zipf>,
    rng: &mut StdRng,
    cfg: &QnpConfig,
) -> Result<bytes::Bytes, LabError> {
    let (req, expect) = request(workload, zipf, rng)?;
    let id = c.next_id;
    c.next_id = c.next_id.wrapping_add(1);
    let mut pkts = segment(&req, id, None, cfg)?;
    if pkts.len() != 1 {
        return Err(LabError::InvalidPlan(format!(
            "the pipelined load generator sends single-packet requests, this one takes {}; use the Endpoint generator (load::run)",
            pkts.len()
        )));
    }
    c.outstanding.insert(id, (Instant::now(), expect));
    Ok(pkts.remove(0))
}

/// Sends `pkts` to `dest` with as few `sendmmsg` calls as the kernel allows. A full socket
/// buffer drops the rest: those requests time out and are replaced, as lost packets would be.
fn send_batch(
    sock: &UdpSocket,
    dest: &socket2::SockAddr,
    pkts: &[bytes::Bytes],
) -> Result<(), LabError> {
    for chunk in pkts.chunks(BATCH) {
        let mut iovs: Vec<libc::iovec> = chunk
            .iter()
            .map(|p| libc::iovec {
                iov_base: p.as_ptr() as *mut libc::c_void,
                iov_len: p.len(),
            })
            .collect();
        let mut msgs: Vec<libc::mmsghdr> = iovs
            .iter_mut()
            .map(|iov| {
                // SAFETY: msghdr is plain data; all-zero is a valid empty header.
                let mut h: libc::msghdr = unsafe { std::mem::zeroed() };
                h.msg_name = dest.as_ptr() as *mut libc::c_void;
                h.msg_namelen = dest.len();
                h.msg_iov = iov;
                h.msg_iovlen = 1;
                libc::mmsghdr {
                    msg_hdr: h,
                    msg_len: 0,
                }
            })
            .collect();
        let mut sent = 0;
        while sent < msgs.len() {
            // SAFETY: `msgs[sent..]` are valid mmsghdrs whose name and iovec point into `dest`
            // and `chunk`, which outlive the call.
            let n = unsafe {
                libc::sendmmsg(
                    sock.as_raw_fd(),
                    msgs[sent..].as_mut_ptr(),
                    (msgs.len() - sent) as libc::c_uint,
                    0,
                )
            };
            if n <= 0 {
                let e = std::io::Error::last_os_error();
                match e.kind() {
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted => break,
                    _ if e.raw_os_error() == Some(libc::ECONNREFUSED) => break,
                    _ => return Err(LabError::io("sending load (sendmmsg)", e)),
                }
            }
            sent += n.max(0) as usize;
        }
    }
    Ok(())
}

/// Receives up to [`BATCH`] datagrams into `buf` (slots of [`BUF`] bytes) without blocking;
/// returns their lengths.
fn recv_batch(sock: &UdpSocket, buf: &mut [u8]) -> Result<Vec<usize>, LabError> {
    let mut iovs: Vec<libc::iovec> = buf
        .chunks_mut(BUF)
        .take(BATCH)
        .map(|b| libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: b.len(),
        })
        .collect();
    let mut msgs: Vec<libc::mmsghdr> = iovs
        .iter_mut()
        .map(|iov| {
            // SAFETY: msghdr is plain data; all-zero is a valid empty header.
            let mut h: libc::msghdr = unsafe { std::mem::zeroed() };
            h.msg_iov = iov;
            h.msg_iovlen = 1;
            libc::mmsghdr {
                msg_hdr: h,
                msg_len: 0,
            }
        })
        .collect();
    // SAFETY: `msgs` are valid mmsghdrs whose iovecs point into `buf`, which outlives the call.
    let n = unsafe {
        libc::recvmmsg(
            sock.as_raw_fd(),
            msgs.as_mut_ptr(),
            msgs.len() as libc::c_uint,
            libc::MSG_DONTWAIT,
            std::ptr::null_mut(),
        )
    };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        return match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted => Ok(Vec::new()),
            _ if e.raw_os_error() == Some(libc::ECONNREFUSED) => Ok(Vec::new()),
            _ => Err(LabError::io("receiving responses (recvmmsg)", e)),
        };
    }
    Ok(msgs[..n as usize]
        .iter()
        .map(|m| m.msg_len as usize)
        .collect())
}
