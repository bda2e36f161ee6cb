//! Upstream side of a worker: per-cluster balancers and connection pools.
//!
//! HTTP/1.1 clusters get a keep-alive pool; `protocol: http2` clusters get one multiplexed
//! HTTP/2 connection per endpoint. Either kind of connection is a [`transport::Transport`]:
//! a socket to the endpoint, or for a `tunnel: hbone` cluster a CONNECT stream through the
//! endpoint's node on the worker's tunnel connections. Pools belong to one worker
//! (shared-nothing) and survive config reloads when the cluster's connection settings did
//! not change.

pub mod dials;
pub mod transport;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use flatmesh_config::UpstreamProtocol;

use crate::h1::pool::H1Pool;
use crate::h2::client::H2Pool;
use crate::hbone::pool::TunnelPool;
use crate::lb::{Balancer, InFlight};
use crate::original_dst::{Dialled, Refused};
use crate::snapshot::{ClusterPlan, Snapshot};

/// What makes two pools interchangeable across a reload.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PoolKey {
    cluster: String,
    protocol: UpstreamProtocol,
    connect_timeout: Duration,
    /// HTTP/2 clusters: the client's per-stream send buffer, and the largest response head.
    send_buffer: u32,
    max_header_bytes: usize,
    /// A TLS cluster's snapshot generation: its pool is never carried over a reload (the
    /// files are read again at each one), so a new certificate, root or `server_ids` holds
    /// for every connection from the reload on.
    tls: Option<u64>,
    /// An `original_dst` cluster's `max_destinations`, which its HTTP/1 pool is built with.
    max_destinations: Option<usize>,
}

/// One cluster as seen by one worker.
pub struct Upstream {
    pub balancer: Balancer,
    pub pool: Pool,
}

/// Where one try goes: the endpoint's index in the cluster (0 for an `original_dst`
/// cluster, which has none), its address, and its in-flight count.
pub struct Picked {
    pub index: usize,
    pub endpoint: SocketAddr,
    pub in_flight: InFlight,
}

/// Why there is nowhere to send a try.
pub enum NoPick {
    /// The balancer has no endpoint.
    NoEndpoint,
    /// An `original_dst` cluster may not send to where the client was going.
    Refused(Refused),
}

impl Upstream {
    /// Picks where the `attempt`th try of a connection or request goes: an `original_dst`
    /// cluster's is the client's original destination (`dialled`) when its allow-list has
    /// it, any other cluster's is its balancer's pick for `hash`, avoiding `exclude`.
    pub fn pick(
        &self,
        plan: &ClusterPlan,
        dialled: Option<Dialled>,
        hash: u64,
        attempt: usize,
        exclude: &[usize],
    ) -> Result<Picked, NoPick> {
        if let Some(original) = &plan.original_dst {
            let endpoint = original.check(dialled).map_err(NoPick::Refused)?;
            return Ok(Picked {
                index: 0,
                endpoint,
                in_flight: InFlight::untracked(),
            });
        }
        let (index, in_flight) = self
            .balancer
            .pick_excluding(hash, attempt, exclude)
            .ok_or(NoPick::NoEndpoint)?;
        Ok(Picked {
            index,
            endpoint: plan.endpoints[index],
            in_flight,
        })
    }
}

/// The connections of one cluster, kept across reloads that leave its settings alone.
#[derive(Clone)]
pub enum Pool {
    /// Keep-alive HTTP/1.1 connections per endpoint (`crate::h1`), for every client.
    Http1(Arc<H1Pool>),
    /// One multiplexed HTTP/2 connection per endpoint (`crate::h2::client`).
    Http2(Arc<H2Pool>),
}

/// A worker's upstream state for one snapshot.
pub struct Upstreams {
    pub by_cluster: Vec<Upstream>,
    pub pools: HashMap<PoolKey, Pool>,
    /// Per cluster, `tunnel: hbone` ones only: this worker's tunnel connections, which the
    /// cluster's pool opens its connections through too. Never carried over a reload (the
    /// cluster's TLS is not, and with it the pool).
    pub tunnels: Vec<Option<Arc<TunnelPool>>>,
}

impl Upstreams {
    /// Build this worker's balancers and pools for `snapshot`, reusing the pools of `previous`
    /// whose settings are unchanged (so keep-alive connections survive a reload).
    pub fn build(
        snapshot: &Arc<Snapshot>,
        worker: usize,
        previous: Option<&Upstreams>,
    ) -> Upstreams {
        let tunnels: Vec<Option<Arc<TunnelPool>>> = snapshot
            .clusters
            .iter()
            .map(|plan| {
                let port = plan.tunnel_port?;
                Some(Arc::new(TunnelPool::new(port, &snapshot.config.limits)))
            })
            .collect();
        let mut pools = HashMap::new();
        let by_cluster = snapshot
            .clusters
            .iter()
            .zip(&tunnels)
            .map(|(plan, tunnel)| {
                let key = PoolKey {
                    cluster: plan.name.clone(),
                    protocol: plan.protocol,
                    connect_timeout: plan.connect_timeout,
                    send_buffer: snapshot.config.limits.http2_stream_window,
                    max_header_bytes: snapshot.config.limits.max_header_bytes,
                    tls: plan.tls.is_some().then_some(snapshot.generation),
                    max_destinations: plan.original_dst.as_ref().map(|o| o.max_destinations),
                };
                let pool = previous
                    .and_then(|p| p.pools.get(&key).cloned())
                    .unwrap_or_else(|| match plan.protocol {
                        UpstreamProtocol::Http1 => {
                            Pool::Http1(H1Pool::new(tunnel.clone(), key.max_destinations))
                        }
                        UpstreamProtocol::Http2 => Pool::Http2(Arc::new(H2Pool::new(
                            tunnel.clone(),
                            key.send_buffer,
                            key.max_header_bytes,
                        ))),
                    });
                pools.insert(key, pool.clone());
                Upstream {
                    balancer: Balancer::new(
                        plan.policy,
                        plan.endpoints.clone(),
                        &plan.table,
                        worker,
                    )
                    .with_out(plan.guard.out()),
                    pool,
                }
            })
            .collect();
        Upstreams {
            by_cluster,
            pools,
            tunnels,
        }
    }
}
