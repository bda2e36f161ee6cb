//! What the demo's microservices compute (E3 Table 2): KVS, Count, EMA and the API gateway's rate
//! limiter. Each keeps its working state in memory; the state is what a cold migration moves.

use std::collections::BTreeMap;
use std::str::FromStr;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::{LabError, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Kvs,
    Count,
    Ema,
    Gateway,
}

impl Kind {
    pub const ALL: [Kind; 4] = [Kind::Kvs, Kind::Count, Kind::Ema, Kind::Gateway];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Kvs => "kvs",
            Kind::Count => "count",
            Kind::Ema => "ema",
            Kind::Gateway => "api",
        }
    }

    /// The Table 1/2 profile this kind implements (a key of presets/microservices.yaml).
    pub fn microservice(self) -> &'static str {
        match self {
            Kind::Kvs => "KVS",
            Kind::Count => "Count",
            Kind::Ema => "EMA",
            Kind::Gateway => "API gw",
        }
    }

    pub fn from_microservice(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.microservice() == name)
    }

    /// Requests for this kind start with `/NAME/`; the node proxies route on that prefix.
    pub fn path_prefix(self) -> String {
        format!("/{}/", self.name())
    }
}

impl FromStr for Kind {
    type Err = LabError;
    fn from_str(s: &str) -> Result<Kind> {
        Kind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| LabError::Invalid {
                what: "service kind",
                message: format!("`{s}` is not one of kvs, count, ema, api"),
            })
    }
}

/// A token bucket per client: `rate` tokens per second, at most `burst` saved up.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RateLimiter {
    pub rate: f64,
    pub burst: f64,
    /// client -> tokens left. The refill clock is not state: it restarts with the process.
    pub tokens: BTreeMap<String, f64>,
    #[serde(skip, default = "Instant::now")]
    last: Instant,
}

/// Clients tracked at most. Past this the table starts over (everyone gets a full bucket once):
/// a gateway must not grow without limit because clients invent ids.
const MAX_CLIENTS: usize = 10_000;

impl RateLimiter {
    pub fn new(rate: f64, burst: f64) -> Self {
        RateLimiter {
            rate,
            burst,
            tokens: BTreeMap::new(),
            last: Instant::now(),
        }
    }

    /// Takes one token for `client` at `now`; false = over its rate (answer 429).
    pub fn allow(&mut self, client: &str, now: Instant) -> bool {
        let refill = now.saturating_duration_since(self.last).as_secs_f64() * self.rate;
        self.last = now;
        if refill > 0.0 {
            for t in self.tokens.values_mut() {
                *t = (*t + refill).min(self.burst);
            }
        }
        if !self.tokens.contains_key(client) && self.tokens.len() >= MAX_CLIENTS {
            self.tokens.clear();
        }
        let t = self.tokens.entry(client.to_string()).or_insert(self.burst);
        if *t >= 1.0 {
            *t -= 1.0;
            true
        } else {
            false
        }
    }
}

/// A microservice's working state.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "data")]
pub enum Data {
    Kvs(BTreeMap<String, String>),
    Count(BTreeMap<String, u64>),
    Ema(BTreeMap<String, f64>),
    Gateway(RateLimiter),
}

/// EMA weight of a new value (the same 1/8 the orchestrator uses).
const EMA_ALPHA: f64 = 0.125;
/// Keys kept at most by the stateful services; more is refused with 507, never an OOM.
pub const MAX_KEYS: usize = 100_000;

impl Data {
    pub fn new(kind: Kind, rate: f64, burst: f64) -> Data {
        match kind {
            Kind::Kvs => Data::Kvs(BTreeMap::new()),
            Kind::Count => Data::Count(BTreeMap::new()),
            Kind::Ema => Data::Ema(BTreeMap::new()),
            Kind::Gateway => Data::Gateway(RateLimiter::new(rate, burst)),
        }
    }

    pub fn kind(&self) -> Kind {
        match self {
            Data::Kvs(_) => Kind::Kvs,
            Data::Count(_) => Kind::Count,
            Data::Ema(_) => Kind::Ema,
            Data::Gateway(_) => Kind::Gateway,
        }
    }

    pub fn keys(&self) -> usize {
        match self {
            Data::Kvs(m) => m.len(),
            Data::Count(m) => m.len(),
            Data::Ema(m) => m.len(),
            Data::Gateway(r) => r.tokens.len(),
        }
    }

    /// Executes one request of a stateful service: (status, body). The gateway is not handled here
    /// (it calls other services; see `serve`).
    pub fn execute(&mut self, method: &http::Method, key: &str, body: &str) -> (u16, String) {
        use http::Method;
        if key.is_empty() || key.len() > 256 {
            return (400, "the key must be 1 to 256 bytes\n".into());
        }
        let full = |n: usize, has: bool| n >= MAX_KEYS && !has;
        match (self, method) {
            (Data::Kvs(m), &Method::GET) => match m.get(key) {
                Some(v) => (200, v.clone()),
                None => (404, format!("no key {key}\n")),
            },
            (Data::Kvs(m), &Method::PUT) => {
                if full(m.len(), m.contains_key(key)) {
                    return (507, "store full\n".into());
                }
                m.insert(key.to_string(), body.to_string());
                (200, "ok".into())
            }
            (Data::Count(m), &Method::GET) => (200, m.get(key).copied().unwrap_or(0).to_string()),
            (Data::Count(m), &Method::POST) => {
                if full(m.len(), m.contains_key(key)) {
                    return (507, "counter table full\n".into());
                }
                let c = m.entry(key.to_string()).or_insert(0);
                *c += 1;
                (200, c.to_string())
            }
            (Data::Ema(m), &Method::GET) => match m.get(key) {
                Some(v) => (200, format!("{v}")),
                None => (404, format!("no key {key}\n")),
            },
            (Data::Ema(m), &Method::POST) => {
                let Ok(x) = body.trim().parse::<f64>() else {
                    return (400, "the body must be a number\n".into());
                };
                if !x.is_finite() {
                    return (400, "the body must be a finite number\n".into());
                }
                if full(m.len(), m.contains_key(key)) {
                    return (507, "EMA table full\n".into());
                }
                let e = m.entry(key.to_string()).or_insert(x);
                *e += EMA_ALPHA * (x - *e);
                (200, format!("{e}"))
            }
            (Data::Gateway(_), _) => (500, "the gateway does not execute locally\n".into()),
            _ => (405, "method not allowed\n".into()),
        }
    }
}

/// A fixed amount of real CPU work: the per-request cost of Table 1, scaled so that a few hundred
/// requests per second load an emulated SmartNIC core. A fixed iteration count (not a duration),
/// so a throttled core takes longer to do the same work, which is what the orchestrator watches.
pub fn burn(seed: u64, iterations: u64) -> u64 {
    let mut x = seed | 1;
    for _ in 0..iterations {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
    }
    std::hint::black_box(x)
}

/// Iterations of [`burn`] per microsecond on this (unthrottled) core.
/// The fastest of several short runs: on a busy machine a single run measures the other load too,
/// and would make every request lighter than intended.
pub fn burn_rate() -> u64 {
    let n = 300_000;
    let best = (0..7)
        .map(|_| {
            let t = Instant::now();
            burn(7, n);
            t.elapsed().as_micros().max(1) as u64
        })
        .min()
        .unwrap_or(1);
    (n / best).max(1)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use http::Method;
    use std::time::Duration;

    #[test]
    fn services_compute() {
        let mut kvs = Data::new(Kind::Kvs, 0.0, 0.0);
        assert_eq!(kvs.execute(&Method::GET, "a", "").0, 404);
        assert_eq!(kvs.execute(&Method::PUT, "a", "x").0, 200);
        assert_eq!(kvs.execute(&Method::GET, "a", ""), (200, "x".into()));
        assert_eq!(kvs.execute(&Method::POST, "a", "").0, 405);
        assert_eq!(kvs.execute(&Method::GET, "", "").0, 400);
        let mut c = Data::new(Kind::Count, 0.0, 0.0);
        c.execute(&Method::POST, "k", "");
        assert_eq!(c.execute(&Method::POST, "k", ""), (200, "2".into()));
        let mut e = Data::new(Kind::Ema, 0.0, 0.0);
        assert_eq!(e.execute(&Method::POST, "k", "8"), (200, "8".into()));
        assert_eq!(e.execute(&Method::POST, "k", "16"), (200, "9".into()));
        assert_eq!(e.execute(&Method::POST, "k", "NaN").0, 400);
        assert_eq!(e.execute(&Method::POST, "k", "x").0, 400);
        // State survives a checkpoint round trip (what migration does).
        let json = serde_json::to_string(&e).unwrap();
        let back: Data = serde_json::from_str(&json).unwrap();
        assert_eq!(back.kind(), Kind::Ema);
        assert_eq!(back.keys(), 1);
    }

    #[test]
    fn rate_limiter_refills() {
        let t = Instant::now();
        let mut r = RateLimiter::new(10.0, 2.0);
        assert!(r.allow("a", t));
        assert!(r.allow("a", t));
        assert!(!r.allow("a", t), "burst spent");
        assert!(r.allow("b", t), "per client");
        assert!(r.allow("a", t + Duration::from_millis(100)), "refilled 1");
        assert!(!r.allow("a", t + Duration::from_millis(100)));
    }

    #[test]
    fn kinds_parse() {
        for k in Kind::ALL {
            assert_eq!(k.name().parse::<Kind>().unwrap(), k);
            assert_eq!(Kind::from_microservice(k.microservice()), Some(k));
        }
        assert!("sql"
            .parse::<Kind>()
            .unwrap_err()
            .to_string()
            .contains("kvs"));
    }
}
