//! Durations written as `250ms`, `2s`, `1m`, `1h` (serde helpers).

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serializer};

/// Parse `250ms`, `2s`, `1.5s`, `1m`, `1h`. A bare number is rejected: units must be explicit.
pub fn parse(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| format!("duration `{text}` has no unit: write it like `250ms`, `2s` or `1m`"))?;
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("duration `{text}` does not start with a number: write it like `2s`"))?;
    let seconds = match unit {
        "us" | "µs" => value / 1e6,
        "ms" => value / 1e3,
        "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        other => {
            return Err(format!(
                "duration `{text}` has unknown unit `{other}`: use one of us, ms, s, m, h"
            ))
        }
    };
    if !seconds.is_finite() || seconds < 0.0 || seconds > 1e9 {
        return Err(format!("duration `{text}` is out of range"));
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// Format a duration the way `parse` reads it.
pub fn format(d: &Duration) -> String {
    let ms = d.as_millis();
    if d.subsec_millis() == 0 && d.as_secs() > 0 {
        format!("{}s", d.as_secs())
    } else if d.as_nanos() % 1_000_000 == 0 {
        format!("{ms}ms")
    } else {
        format!("{}us", d.as_micros())
    }
}

pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format(d))
}

pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    parse(&text).map_err(serde::de::Error::custom)
}

pub mod option {
    use super::*;

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => super::serialize(d, s),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let text = Option::<String>::deserialize(d)?;
        text.map(|t| parse(&t).map_err(serde::de::Error::custom)).transpose()
    }
}
