//! One socket of a qnp listener, served on a node worker: each packet is decided (by the kernel
//! already, or here by the listener's matcher), counted and relayed to its worker.

use std::sync::Arc;

use arc_swap::ArcSwap;
use flatmesh_qnp::dispatch::{Stash, STASH_DEPTH};
use flatmesh_qnp::header::QnpHeader;
use flatmesh_qnp::rules::Decision;
use flatmesh_qnp::transport::{receive_error_is_per_packet, RECEIVE_ERROR_PAUSE};

use super::session::{RelayError, Sessions};
use super::{QnpPlan, QnpSocket};
use crate::context::WorkerView;
use crate::metrics::QnpDrop;
use crate::snapshot::Snapshot;

/// The listener's identity across reloads (`crate::worker::ListenerKey`).
type ListenerKey = (std::net::SocketAddr, flatmesh_config::ListenerProtocol);

/// Serves `socket` until the task is aborted (the listener goes, or the node drains).
/// Malformed packets and packets no rule takes are counted and dropped; nothing here waits on
/// a worker.
pub async fn serve(
    key: ListenerKey,
    socket: QnpSocket,
    worker: usize,
    view: Arc<ArcSwap<WorkerView>>,
) {
    let kernel = socket.queue;
    // Answers leave from the listening socket, sent without tokio (see `session`); the
    // descriptor is non-blocking, so a full buffer drops an answer rather than wait.
    let answers = match socket.socket.try_clone() {
        Ok(s) => Arc::new(s),
        Err(e) => {
            tracing::error!(worker, address = %key.0, error = %e, "qnp: cannot use the listening socket");
            return;
        }
    };
    let listener = match tokio::net::UdpSocket::from_std(socket.socket) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(worker, address = %key.0, error = %e, "qnp: cannot use the listening socket");
            return;
        }
    };
    let mut stash = Stash::new(STASH_DEPTH);
    let mut sessions = Sessions::default();
    let mut buf = vec![0u8; 65_536];
    let mut current: Option<(Arc<Snapshot>, Arc<QnpPlan>)> = None;
    loop {
        let (n, client) = match listener.recv_from(&mut buf).await {
            Ok(got) => got,
            // An ICMP error for an earlier answer: per packet, not the socket's end.
            Err(e) if receive_error_is_per_packet(&e) => continue,
            Err(e) => {
                tracing::warn!(worker, address = %key.0, error = %e, "qnp: receive failed; retrying shortly");
                tokio::time::sleep(RECEIVE_ERROR_PAUSE).await;
                continue;
            }
        };
        let pkt = &buf[..n];
        let Some(plan) = plan_in_force(&view, key, &mut current) else {
            // A reload removed the listener; the worker stops this task next.
            continue;
        };
        let Some(counts) = plan.counts() else {
            continue;
        };
        let Ok((header, _)) = QnpHeader::parse(pkt) else {
            counts.dropped(worker, QnpDrop::Malformed);
            continue;
        };
        let queue = match kernel {
            Some(q) => q,
            None => match plan.rsd.decide(pkt, client, &mut stash) {
                Decision::Queue(q) => q,
                Decision::Drop => {
                    counts.dropped(worker, QnpDrop::NoRule);
                    continue;
                }
            },
        };
        let Some(target) = plan.workers.get(usize::from(queue)) else {
            counts.dropped(worker, QnpDrop::NoWorker);
            continue;
        };
        match sessions.relay(
            &answers,
            client,
            *target,
            pkt,
            plan.idle_timeout,
            plan.max_sessions,
        ) {
            Ok(opened) => {
                if opened {
                    counts.sessions.add(worker, 1);
                }
                if header.pkt_seq_num_in_req == 0 {
                    counts.request(worker, queue, kernel.is_some());
                }
            }
            Err(RelayError::Full) => counts.dropped(worker, QnpDrop::SessionsFull),
            Err(RelayError::Send) => counts.dropped(worker, QnpDrop::SendFailed),
        }
    }
}

/// The listener's plan in the snapshot in force, looked up again only when a reload swapped it.
fn plan_in_force(
    view: &ArcSwap<WorkerView>,
    key: ListenerKey,
    current: &mut Option<(Arc<Snapshot>, Arc<QnpPlan>)>,
) -> Option<Arc<QnpPlan>> {
    let v = view.load();
    if !current
        .as_ref()
        .is_some_and(|(s, _)| Arc::ptr_eq(s, &v.snapshot))
    {
        *current = v
            .snapshot
            .listener_at(key.0, key.1)
            .and_then(|lid| v.snapshot.listeners[lid].qnp.clone())
            .map(|plan| (v.snapshot.clone(), plan));
    }
    current.as_ref().map(|(_, plan)| plan.clone())
}
