//! A `tcp` listener's connection to a `tunnel: hbone` cluster: one HTTP/2 CONNECT stream to
//! `ENDPOINT_IP:tunnel_port`, `:authority` the endpoint's `IP:PORT`, on one of the worker's
//! pooled tunnel connections ([`super::pool`]), relayed until both sides are done. The tunnel
//! presents the identity of the workload that made the connection (`crate::workload`), or
//! the cluster's own when it came from no declared workload.

use crate::context::{ConnContext, WorkerView};
use crate::lb::hash_client;
use crate::relay::{copy_until_idle, reset_on_close, ByteCount, Relay, RelayEnd};
use crate::tap::Tapped;
use crate::tls::Stream;

/// Relays a tcp listener's connection through a tunnel to an endpoint of cluster `cid`,
/// trying up to 3 endpoints as the plain relay does, presenting `who`'s identity. The
/// listener counts the bytes.
pub async fn relay(
    ctx: &ConnContext,
    view: &WorkerView,
    listener: usize,
    cid: flatmesh_rules::ClusterId,
    downstream: Stream,
    who: super::pool::Presenting,
) {
    let snap = &view.snapshot;
    let plan = &snap.listeners[listener];
    let cluster = &snap.clusters[cid];
    let Some(Some(tunnel)) = view.upstreams.tunnels.get(cid) else {
        return;
    };
    let balancer = &view.upstreams.by_cluster[cid].balancer;
    let key = hash_client(ctx.peer.ip());
    let mut opened = None;
    for attempt in 0..cluster.endpoints.len().clamp(1, 3) {
        let Some((index, in_flight)) = balancer.pick(key, attempt) else {
            break;
        };
        let endpoint = cluster.endpoints[index];
        match tunnel.open(ctx.worker, cluster, endpoint, who).await {
            Ok((stream, slot)) => {
                opened = Some((stream, slot, in_flight));
                break;
            }
            Err(reason) => {
                cluster.stats.tunnel.refused(reason);
                tracing::warn!(listener = %plan.name, cluster = %cluster.name, %endpoint, reason,
                    workload = snap.workloads.name(who), "HBONE stream to the endpoint was not opened");
                if reason == "no_identity" {
                    // No endpoint would fare better: the connection has nothing to present.
                    break;
                }
            }
        }
    }
    let Some((stream, _slot, _in_flight)) = opened else {
        reset_on_close(downstream.tcp());
        return;
    };
    cluster.stats.tunnel.opened.add_shared(ctx.worker, 1);
    let relay = Relay::of(
        &snap
            .config
            .limits
            .for_listener(&snap.config.listeners[listener]),
    );
    let Some(_buffers) = ctx
        .budget
        .memory
        .try_take(2 * relay.buffer, snap.config.limits.memory_budget_bytes)
    else {
        tracing::debug!(listener = %plan.name, "memory budget spent; closing the relay");
        reset_on_close(downstream.tcp());
        return;
    };
    let _ = downstream.tcp().set_nodelay(true);
    let mut client = Tapped {
        inner: downstream,
        tap: ByteCount::default(),
    };
    let mut up = Tapped {
        inner: stream,
        tap: ByteCount::default(),
    };
    if let RelayEnd::Failed(err) = copy_until_idle(&mut client, &mut up, relay).await {
        tracing::debug!(listener = %plan.name, error = %err, "tunnelled relay ended with an error; resetting both sides");
        reset_on_close(client.inner.tcp());
        up.inner.reset();
    }
    plan.stats.bytes_in.add_shared(ctx.worker, client.tap.0);
    plan.stats.bytes_out.add_shared(ctx.worker, up.tap.0);
}
