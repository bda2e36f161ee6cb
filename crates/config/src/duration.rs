//! Durations written as `250ms`, `2s`, `1m`, `1h` (serde helpers).

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serializer};

/// The longest duration any input may give (YAML, xDS, an Envoy bootstrap): 365 days. Longer
/// means "never" in practice, and an unbounded one overflows the clock arithmetic of timers.
pub const MAX: Duration = Duration::from_secs(365 * 24 * 3600);
/// [`MAX`] in words, for error messages.
pub const MAX_TEXT: &str = "365 days (8760h)";

/// Parse `250ms`, `2s`, `1.5s`, `1m`, `1h`. A bare number is rejected: units must be explicit.
/// The result is rounded to whole microseconds.
pub fn parse(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| {
            format!("duration `{text}` has no unit: write it like `250ms`, `2s` or `1m`")
        })?;
    let (number, unit) = text.split_at(split);
    let value: f64 = number.parse().map_err(|_| {
        format!("duration `{text}` does not start with a number: write it like `2s`")
    })?;
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
    if !seconds.is_finite() || seconds < 0.0 {
        return Err(format!("duration `{text}` is out of range"));
    }
    if seconds > MAX.as_secs_f64() {
        return Err(format!(
            "duration `{text}` is out of range: the longest is {MAX_TEXT}"
        ));
    }
    // Whole microseconds: finer than any timeout needs, and `format` writes it back exactly.
    Ok(Duration::from_micros((seconds * 1e6).round() as u64))
}

/// Format a duration the way `parse` reads it.
pub fn format(d: &Duration) -> String {
    let ms = d.as_millis();
    if d.subsec_nanos() == 0 && d.as_secs() > 0 {
        format!("{}s", d.as_secs())
    } else if d.as_nanos().is_multiple_of(1_000_000) {
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
        text.map(|t| parse(&t).map_err(serde::de::Error::custom))
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse("100us"), Ok(Duration::from_micros(100)));
        assert_eq!(parse("0.1ms"), Ok(Duration::from_micros(100)));
    }

    #[test]
    fn rejects_bad_text() {
        assert!(parse("5").is_err_and(|e| e.contains("no unit")));
        assert!(parse("5x").is_err_and(|e| e.contains("unknown unit `x`")));
        assert!(parse("s").is_err_and(|e| e.contains("does not start with a number")));
        assert!(parse("-1s").is_err());
        assert!(parse("1e400s").is_err());
        assert!(parse("99999999999h").is_err_and(|e| e.contains("out of range")));
        // Anything past 365 days is refused with the limit named; 365 days itself is fine.
        assert!(parse("8761h").is_err_and(|e| e.contains("longest is 365 days")));
        assert!(parse("9223372036854775807s").is_err_and(|e| e.contains("365 days")));
        assert_eq!(parse("8760h"), Ok(MAX));
    }

    #[test]
    fn format_round_trips() {
        for text in ["2s", "1500ms", "1us", "1000001us", "0ms", "3600s"] {
            let d = parse(text).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(format(&d), text);
            assert_eq!(parse(&format(&d)), Ok(d));
        }
        // Sub-second remainders are never dropped.
        let d = Duration::from_micros(1_000_001);
        assert_eq!(parse(&format(&d)), Ok(d));
    }
}
