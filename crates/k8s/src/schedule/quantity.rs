//! Kubernetes resource quantities (`"4"`, `"3500m"`, `"64Gi"`, `"1e9"`) as numbers: enough of
//! `k8s.io/apimachinery/pkg/api/resource` to read a node's cpu and memory and a pod's requests.

/// The value of a quantity, or why it is not one. Whole numbers with a decimal (`k`, `M`, `G`,
/// `T`, `P`, `E`) or binary (`Ki` ... `Ei`) suffix, milli/micro/nano (`m`, `u`, `n`), or an
/// exponent (`1e3`, `5E-3`).
pub fn parse(text: &str) -> Result<f64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(split);
    let scale = match suffix {
        "" => 1.0,
        "n" => 1e-9,
        "u" => 1e-6,
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        "Ki" => 1024.0,
        "Mi" => 1024f64.powi(2),
        "Gi" => 1024f64.powi(3),
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "Ei" => 1024f64.powi(6),
        exponent if exponent.starts_with(['e', 'E']) => {
            let e: i32 = exponent[1..]
                .parse()
                .map_err(|_| format!("{text:?} is not a quantity: bad exponent {exponent:?}"))?;
            10f64.powi(e)
        }
        other => {
            return Err(format!(
                "{text:?} is not a quantity: unknown suffix {other:?} (use m, k, M, G, Ki, Mi, Gi, ...)"
            ))
        }
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a quantity: {number:?} is not a number"))?;
    let value = value * scale;
    if value.is_finite() && value >= 0.0 {
        Ok(value)
    } else {
        Err(format!("{text:?} is not a non-negative quantity"))
    }
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn reads_cpu_and_memory_forms() {
        assert_eq!(parse("4").unwrap(), 4.0);
        assert_eq!(parse("3500m").unwrap(), 3.5);
        assert_eq!(parse("0.5").unwrap(), 0.5);
        assert_eq!(parse("64Gi").unwrap(), 64.0 * 1024.0 * 1024.0 * 1024.0);
        assert_eq!(parse("65536Ki").unwrap(), 64.0 * 1024.0 * 1024.0);
        assert_eq!(parse("1G").unwrap(), 1e9);
        assert_eq!(parse("1e3").unwrap(), 1000.0);
        assert_eq!(parse("5E-3").unwrap(), 0.005);
    }

    #[test]
    fn rejects_what_is_not_a_quantity() {
        for bad in ["", "x", "4 cores", "1Qi", "-1", "1e", "1..2"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
