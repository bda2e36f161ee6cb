//! Fault injection and mirroring, as rule actions of an http route: what `fault:` and
//! `mirror:` compile to. The user tier runs them (`crates/proxy/src/l7/fault.rs` and
//! `mirror.rs`); no lower tier can, so a route with either is placed there
//! ([`Reason::Fault`](crate::Reason::Fault), [`Reason::Mirror`](crate::Reason::Mirror)).

use std::time::Duration;

use flatmesh_config::{Fault, Mirror};
use http::StatusCode;

use crate::{ClusterId, RulesError};

/// A share of requests, drawn per request: `hit` with a uniform random `u32`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Share {
    /// As configured, 0 to 100 (for `--explain`).
    pub percent: f64,
    /// Draws below this hit: `percent` of 2^32 (2^32 itself for 100 %, which every draw is below).
    below: u64,
}

impl Share {
    /// `percent` is validated to 0..=100 by the config; anything outside is clamped.
    pub fn of_percent(percent: f64) -> Share {
        let fraction = if percent.is_nan() {
            0.0
        } else {
            percent.clamp(0.0, 100.0) / 100.0
        };
        Share {
            percent,
            below: (fraction * (1u64 << 32) as f64).round() as u64,
        }
    }

    /// Whether a request whose draw is `draw` is in the share.
    #[inline]
    pub fn hit(self, draw: u32) -> bool {
        u64::from(draw) < self.below
    }
}

/// How an abort answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbortStatus {
    /// An HTTP status; a gRPC client gets the gRPC status it maps to (as Envoy maps it).
    Http(StatusCode),
    /// A gRPC status code, for gRPC clients (others get HTTP 200 with it in `grpc-status`).
    Grpc(u16),
}

/// `fault:` compiled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultAction {
    pub abort: Option<(AbortStatus, Share)>,
    pub delay: Option<(Duration, Share)>,
}

/// `mirror:` compiled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MirrorAction {
    pub cluster: ClusterId,
    pub share: Share,
}

impl FaultAction {
    pub(crate) fn compile(f: &Fault, route: &str) -> Result<FaultAction, RulesError> {
        let abort = match &f.abort {
            None => None,
            Some(a) => {
                let status = match (a.status, a.grpc_status) {
                    (Some(s), None) => {
                        AbortStatus::Http(StatusCode::from_u16(s).map_err(|_| {
                            RulesError::BadStatus {
                                route: route.to_string(),
                                status: s,
                            }
                        })?)
                    }
                    (None, Some(code)) => AbortStatus::Grpc(code),
                    // Validation refuses both and neither; a config built in code gets 503.
                    _ => AbortStatus::Http(StatusCode::SERVICE_UNAVAILABLE),
                };
                Some((status, Share::of_percent(a.percent)))
            }
        };
        Ok(FaultAction {
            abort,
            delay: f
                .delay
                .as_ref()
                .map(|d| (d.duration, Share::of_percent(d.percent))),
        })
    }

    /// `abort 503 (10%), delay 2s (50%)`, for `--explain`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some((status, share)) = &self.abort {
            let status = match status {
                AbortStatus::Http(s) => s.as_u16().to_string(),
                AbortStatus::Grpc(code) => format!("grpc-status {code}"),
            };
            parts.push(format!("abort {status} ({}%)", share.percent));
        }
        if let Some((duration, share)) = &self.delay {
            parts.push(format!(
                "delay {} ({}%)",
                flatmesh_config::duration::format(duration),
                share.percent
            ));
        }
        parts.join(", ")
    }
}

impl MirrorAction {
    pub(crate) fn compile(m: &Mirror, cluster: ClusterId) -> MirrorAction {
        MirrorAction {
            cluster,
            share: Share::of_percent(m.percent),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_hit_their_fraction_of_draws() {
        assert!(!Share::of_percent(0.0).hit(0));
        assert!(Share::of_percent(100.0).hit(u32::MAX));
        let half = Share::of_percent(50.0);
        assert!(half.hit((1 << 31) - 1));
        assert!(!half.hit(1 << 31));
        // A tenth of a percent of the draw space, to the draw.
        let small = Share::of_percent(0.1);
        let hits = (0..1000u32)
            .filter(|k| small.hit(k * (u32::MAX / 1000)))
            .count();
        assert_eq!(hits, 1);
        assert!(!Share::of_percent(f64::NAN).hit(0));
    }
}
