//! What the latency examples share: the timed 64-byte ping-pong loop, percentiles, and the
//! rounds argument.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Rounds run before timing starts.
const WARM_UP: usize = 1000;

/// `rounds` timed 64-byte round trips of `byte` on `stream` (after a warm-up), sorted.
pub fn timed_rounds(
    stream: &mut TcpStream,
    rounds: usize,
    byte: u8,
) -> std::io::Result<Vec<Duration>> {
    let msg = [byte; 64];
    let mut back = [0u8; 64];
    let mut rtts = Vec::with_capacity(rounds);
    for i in 0..rounds + WARM_UP {
        let t = Instant::now();
        stream.write_all(&msg)?;
        stream.read_exact(&mut back)?;
        if i >= WARM_UP {
            rtts.push(t.elapsed());
        }
    }
    rtts.sort();
    Ok(rtts)
}

/// The `p` quantile of sorted round-trip times, in microseconds.
pub fn pct(v: &[Duration], p: f64) -> f64 {
    let i = ((v.len() as f64 - 1.0) * p) as usize;
    v.get(i).map(|d| d.as_secs_f64() * 1e6).unwrap_or(f64::NAN)
}

/// The first command-line argument as a round count (default 20,000).
pub fn rounds_arg() -> Result<usize, std::num::ParseIntError> {
    std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()
        .map(|r| r.unwrap_or(20_000))
}
