//! A minimal SVG line chart for the benchmark's plots. Hand-written: a plotting crate (plotters)
//! would pull in font and image dependencies for a few polylines.

use std::fmt::Write as _;

const W: f64 = 640.0;
const H: f64 = 400.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 150.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;
const COLORS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A chart of `series` (name, points) with a linear x axis and a y axis from 0.
pub fn line_chart(
    title: &str,
    xlabel: &str,
    ylabel: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> String {
    let pts = series.iter().flat_map(|(_, p)| p.iter());
    let (mut xmin, mut xmax, mut ymax) = (f64::MAX, f64::MIN, 0.0f64);
    for &(x, y) in pts {
        xmin = xmin.min(x);
        xmax = xmax.max(x);
        ymax = ymax.max(y);
    }
    if xmin > xmax {
        (xmin, xmax) = (0.0, 1.0);
    }
    if xmax == xmin {
        xmax = xmin + 1.0;
    }
    let ymax = nice_ceil(ymax * 1.05);
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let sx = |x: f64| LEFT + (x - xmin) / (xmax - xmin) * pw;
    let sy = |y: f64| TOP + ph - y / ymax * ph;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="14">{}</text>"#,
        LEFT + pw / 2.0,
        esc(title)
    );
    // Axes, with 5 ticks each.
    let _ = writeln!(
        s,
        r#"<path d="M{LEFT},{TOP} V{} H{}" stroke="black" fill="none"/>"#,
        TOP + ph,
        LEFT + pw
    );
    for i in 0..=5 {
        let f = f64::from(i) / 5.0;
        let (x, y) = (xmin + f * (xmax - xmin), f * ymax);
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text><path d="M{LEFT},{:.1} H{:.1}" stroke="#ddd"/>"##,
            sx(x),
            TOP + ph + 16.0,
            fmt_num(x),
            LEFT - 6.0,
            sy(y) + 4.0,
            fmt_num(y),
            sy(y),
            LEFT + pw
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
        LEFT + pw / 2.0,
        H - 12.0,
        esc(xlabel)
    );
    let _ = writeln!(
        s,
        r#"<text x="16" y="{:.1}" text-anchor="middle" transform="rotate(-90 16 {:.1})">{}</text>"#,
        TOP + ph / 2.0,
        TOP + ph / 2.0,
        esc(ylabel)
    );
    for (i, (name, points)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let path: Vec<String> = points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
            path.join(" ")
        );
        for &(x, y) in points {
            let _ = writeln!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"/>"#,
                sx(x),
                sy(y)
            );
        }
        let ly = TOP + 10.0 + 18.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<path d="M{:.1},{ly:.1} h20" stroke="{color}" stroke-width="2"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            LEFT + pw + 10.0,
            LEFT + pw + 34.0,
            ly + 4.0,
            esc(name)
        );
    }
    s.push_str("</svg>\n");
    s
}

/// The smallest of 1, 2, 2.5, 5 × 10^k at or above `v` (1 for nothing to show), so that the five
/// y ticks are round numbers.
fn nice_ceil(v: f64) -> f64 {
    if v <= 0.0 || !v.is_finite() {
        return 1.0;
    }
    let p = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .into_iter()
        .map(|m| m * p)
        .find(|c| *c >= v)
        .unwrap_or(10.0 * p)
}

fn fmt_num(v: f64) -> String {
    if v >= 10_000.0 {
        format!("{:.0}k", v / 1000.0)
    } else if v >= 100.0 || v == v.trunc() {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_hold_every_series_and_escape_text() {
        let svg = line_chart(
            "a <b>",
            "x",
            "y",
            &[
                ("one".into(), vec![(1.0, 10.0), (48.0, 5.0)]),
                ("two".into(), vec![(1.0, 3.0)]),
            ],
        );
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("a &lt;b&gt;"));
        assert_eq!(nice_ceil(37_000.0), 50_000.0);
        assert_eq!(nice_ceil(7.9), 10.0);
        assert_eq!(nice_ceil(0.0), 1.0);
        // No series at all still gives a valid document.
        assert!(line_chart("t", "x", "y", &[]).contains("</svg>"));
    }
}
