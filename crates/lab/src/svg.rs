//! The lab's charts as SVG: lines over a numeric x axis (the QingNiao benchmark's sweeps, the
//! simulator's Table 6 and Fig. 10) and grouped bars (the simulator's Table 5). Hand-written: a
//! plotting crate (plotters) would pull a font and image stack into the build for a few paths
//! and rectangles.

use std::fmt::Write as _;

const W: f64 = 720.0;
const H: f64 = 400.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 170.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;
/// x labels closer than this (pixels) to the previous one are left out, so they never overlap.
const MIN_LABEL_GAP: f64 = 28.0;
const COLORS: [&str; 8] = [
    "#4e79a7", "#e15759", "#59a14f", "#f28e2b", "#b07aa1", "#76b7b2", "#edc948", "#9c755f",
];

/// One line of a [`line_chart`]: its legend name and its points `(x, y)`. A `None` y (a value
/// the run did not produce, e.g. the ILP gave up) breaks the line there.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, Option<f64>)>,
}

impl Series {
    /// A series with a value at every point.
    pub fn full(name: impl Into<String>, points: impl IntoIterator<Item = (f64, f64)>) -> Series {
        Series {
            name: name.into(),
            points: points.into_iter().map(|(x, y)| (x, Some(y))).collect(),
        }
    }
}

/// How the y axis maps values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scale {
    /// From 0 to a round number above the largest value, in five ticks.
    Linear,
    /// Whole decades around the values, a tick per decade; values ≤ 0 are left out.
    Log,
}

/// Lines over a shared numeric x axis.
pub fn line_chart(
    title: &str,
    xlabel: &str,
    ylabel: &str,
    series: &[Series],
    scale: Scale,
) -> String {
    let mut out = String::new();
    header(&mut out, title, ylabel);
    let shown =
        |y: &Option<f64>| y.filter(|y| y.is_finite() && (scale == Scale::Linear || *y > 0.0));
    let ys = || {
        series
            .iter()
            .flat_map(|s| s.points.iter().filter_map(|(_, y)| shown(y)))
    };
    let y = y_axis(
        &mut out,
        ys().fold(f64::INFINITY, f64::min),
        ys().fold(0.0, f64::max),
        scale,
    );
    let mut xs: Vec<f64> = series
        .iter()
        .flat_map(|s| s.points.iter().map(|(x, _)| *x))
        .filter(|x| x.is_finite())
        .collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    let (xmin, xmax) = match (xs.first(), xs.last()) {
        (Some(&a), Some(&b)) if b > a => (a, b),
        (Some(&a), _) => (a, a + 1.0),
        _ => (0.0, 1.0),
    };
    let x = |v: f64| LEFT + (W - LEFT - RIGHT) * (v - xmin) / (xmax - xmin);
    let mut last_label = f64::NEG_INFINITY;
    for &xv in &xs {
        if x(xv) - last_label < MIN_LABEL_GAP {
            continue;
        }
        last_label = x(xv);
        let _ = write!(
            out,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
            x(xv),
            H - BOTTOM + 18.0,
            fmt_num(xv, 1.0)
        );
    }
    let _ = write!(
        out,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        (LEFT + W - RIGHT) / 2.0,
        H - 15.0,
        esc(xlabel)
    );
    for (k, s) in series.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        let mut path = String::new();
        let mut pen_down = false;
        for (xv, v) in &s.points {
            match shown(v) {
                Some(v) if xv.is_finite() => {
                    let (px, py) = (x(*xv), y(v));
                    let _ = write!(path, "{}{px:.1},{py:.1} ", if pen_down { "L" } else { "M" });
                    let _ = write!(
                        out,
                        r#"<circle cx="{px:.1}" cy="{py:.1}" r="3" fill="{color}"><title>{v}</title></circle>"#
                    );
                    pen_down = true;
                }
                _ => pen_down = false,
            }
        }
        let _ = write!(
            out,
            r#"<path d="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
            path.trim_end()
        );
    }
    legend(&mut out, series.iter().map(|s| s.name.as_str()), Mark::Line);
    out.push_str("</svg>\n");
    out
}

/// Grouped bars: one group per category, one bar per series (a missing or non-finite value
/// draws no bar).
pub fn bar_chart(
    title: &str,
    ylabel: &str,
    categories: &[String],
    series: &[(String, Vec<f64>)],
) -> String {
    let mut out = String::new();
    header(&mut out, title, ylabel);
    let max = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max);
    let y = y_axis(&mut out, 0.0, max, Scale::Linear);
    let group_w = (W - LEFT - RIGHT) / categories.len().max(1) as f64;
    let bar_w = group_w * 0.8 / series.len().max(1) as f64;
    for (c, category) in categories.iter().enumerate() {
        let x0 = LEFT + group_w * c as f64 + group_w * 0.1;
        for (s, (_, values)) in series.iter().enumerate() {
            let v = values
                .get(c)
                .copied()
                .filter(|v| v.is_finite())
                .unwrap_or(0.0);
            let top = y(v);
            let _ = write!(
                out,
                r#"<rect x="{:.1}" y="{top:.1}" width="{bar_w:.1}" height="{:.1}" fill="{}"><title>{v}</title></rect>"#,
                x0 + bar_w * s as f64,
                (H - BOTTOM - top).max(0.0),
                COLORS[s % COLORS.len()]
            );
        }
        let _ = write!(
            out,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
            x0 + group_w * 0.4,
            H - BOTTOM + 18.0,
            esc(category)
        );
    }
    legend(&mut out, series.iter().map(|(n, _)| n.as_str()), Mark::Box);
    out.push_str("</svg>\n");
    out
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The document, its white background, the title and the rotated y label.
fn header(out: &mut String, title: &str, ylabel: &str) {
    let _ = write!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/><text x="{}" y="22" text-anchor="middle" font-size="15">{}</text><text x="16" y="{}" transform="rotate(-90 16 {})" text-anchor="middle">{}</text>"#,
        (LEFT + W - RIGHT) / 2.0,
        esc(title),
        H / 2.0,
        H / 2.0,
        esc(ylabel)
    );
    let _ = write!(
        out,
        r#"<path d="M{LEFT},{TOP} V{} H{}" stroke="black" fill="none"/>"#,
        H - BOTTOM,
        W - RIGHT
    );
}

/// How a legend entry shows its series.
#[derive(Clone, Copy, PartialEq)]
enum Mark {
    Line,
    Box,
}

fn legend<'a>(out: &mut String, names: impl Iterator<Item = &'a str>, mark: Mark) {
    let x = W - RIGHT + 15.0;
    for (k, name) in names.enumerate() {
        let y = TOP + 10.0 + 18.0 * k as f64;
        let color = COLORS[k % COLORS.len()];
        let _ = match mark {
            Mark::Line => write!(
                out,
                r#"<path d="M{x},{:.1} h14" stroke="{color}" stroke-width="2"/>"#,
                y - 4.0
            ),
            Mark::Box => write!(
                out,
                r#"<rect x="{x}" y="{}" width="12" height="12" fill="{color}"/>"#,
                y - 10.0
            ),
        };
        let _ = write!(
            out,
            r#"<text x="{}" y="{y}">{}</text>"#,
            x + 18.0,
            esc(name)
        );
    }
}

/// Draws the y axis's ticks and grid lines; returns the mapping from value to pixel. `min` and
/// `max` are the smallest and largest values shown (`min` matters for a log axis only).
fn y_axis(out: &mut String, min: f64, max: f64, scale: Scale) -> impl Fn(f64) -> f64 {
    let plot_h = H - TOP - BOTTOM;
    let (lo, hi, ticks) = match scale {
        Scale::Log => {
            let hi = max.max(1e-12).log10().ceil();
            let lo = min
                .min(max)
                .max(1e-12)
                .log10()
                .floor()
                .min(hi - 1.0)
                .max(hi - 12.0);
            (lo, hi, (hi - lo) as u32)
        }
        Scale::Linear => (0.0, nice_ceil(max * 1.05), 5),
    };
    let step = (hi - lo) / f64::from(ticks);
    for k in 0..=ticks {
        let v = lo + step * f64::from(k);
        let py = H - BOTTOM - plot_h * f64::from(k) / f64::from(ticks);
        let label = match scale {
            // Whole decades: 0.001, 0.01, ..., 1, 10, 100.
            Scale::Log => format!("{:.*}", (-v).max(0.0) as usize, 10f64.powf(v)),
            Scale::Linear => fmt_num(v, step),
        };
        let _ = write!(
            out,
            r##"<line x1="{LEFT}" x2="{}" y1="{py}" y2="{py}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{label}</text>"##,
            W - RIGHT,
            LEFT - 5.0,
            py + 4.0
        );
    }
    move |v: f64| {
        let t = match scale {
            Scale::Log => (v.max(1e-300).log10() - lo) / (hi - lo),
            Scale::Linear => v / hi,
        };
        H - BOTTOM - plot_h * t.clamp(0.0, 1.0)
    }
}

/// The smallest of 1, 2, 2.5, 5 × 10^k at or above `v` (1 for nothing to show), so that the five
/// linear y ticks are round numbers.
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

/// A tick label: as many decimals as ticks `step` apart need, thousands as `k` from 10,000.
fn fmt_num(v: f64, step: f64) -> String {
    let decimals = |step: f64| (-step.abs().max(1e-12).log10().floor()).max(0.0) as usize;
    if v.abs() >= 10_000.0 {
        format!("{:.*}k", decimals(step / 1000.0), v / 1000.0)
    } else {
        format!("{v:.*}", decimals(step))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn circles_y(svg: &str) -> Vec<f64> {
        svg.split("cy=\"")
            .skip(1)
            .map(|s| s.split('"').next().unwrap().parse().unwrap())
            .collect()
    }

    #[test]
    fn bar_charts_escape_text_and_draw_a_bar_per_value() {
        let b = bar_chart(
            "t<1>",
            "y",
            &["a".into(), "b".into()],
            &[("s".into(), vec![1.0, f64::NAN])],
        );
        assert!(b.starts_with("<svg") && b.ends_with("</svg>\n"));
        assert!(b.contains("t&lt;1&gt;"));
        // Two bars (the NaN one of height 0) and one legend box.
        assert_eq!(b.matches("<rect x=").count(), 2 + 1);
    }

    #[test]
    fn line_charts_hold_every_series_and_break_at_gaps() {
        let svg = line_chart(
            "a <b>",
            "x",
            "y",
            &[
                Series::full("one", [(1.0, 10.0), (48.0, 5.0)]),
                Series::full("two", [(1.0, 3.0)]),
            ],
            Scale::Linear,
        );
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert!(svg.contains("a &lt;b&gt;"));
        assert_eq!(
            svg.matches("stroke-width=\"2\"/>").count(),
            2 + 2,
            "lines and legend"
        );
        let l = line_chart(
            "t",
            "x",
            "y",
            &[Series {
                name: "s".into(),
                points: vec![(1.0, Some(1.0)), (2.0, None), (3.0, Some(100.0))],
            }],
            Scale::Log,
        );
        assert_eq!(l.matches("<circle").count(), 2);
        let d = l
            .split("<path d=\"")
            .nth(2)
            .unwrap()
            .split('"')
            .next()
            .unwrap();
        assert_eq!(d.matches('M').count(), 2, "line broken at the gap: {d}");
        // No series at all still gives a valid document.
        assert!(line_chart("t", "x", "y", &[], Scale::Linear).ends_with("</svg>\n"));
    }

    #[test]
    fn a_log_axis_spans_every_value_in_decades() {
        let l = line_chart(
            "t",
            "x",
            "y",
            &[Series::full("s", [(1.0, 0.002), (2.0, 263.0)])],
            Scale::Log,
        );
        for label in [">0.001<", ">0.01<", ">1<", ">1000<"] {
            assert!(l.contains(label), "{label} missing: {l}");
        }
        let ys = circles_y(&l);
        assert!(ys.iter().all(|&y| y > TOP && y < H - BOTTOM), "{ys:?}");
    }

    #[test]
    fn linear_ticks_are_round_and_x_labels_never_overlap() {
        assert_eq!(nice_ceil(37_000.0), 50_000.0);
        assert_eq!(nice_ceil(7.9), 10.0);
        assert_eq!(nice_ceil(0.0), 1.0);
        assert_eq!(fmt_num(20_000.0, 10_000.0), "20k");
        assert_eq!(fmt_num(0.5, 0.5), "0.5");
        assert_eq!(fmt_num(0.05, 0.05), "0.05");
        assert_eq!(fmt_num(400.0, 100.0), "400");
        let svg = line_chart(
            "t",
            "rules",
            "req/s",
            &[Series::full(
                "kernel",
                [1.0, 8.0, 32.0, 128.0, 256.0, 508.0].map(|x| (x, 37_000.0)),
            )],
            Scale::Linear,
        );
        assert!(svg.contains(">50k<"), "{svg}");
        // 1 and 8 are 7 pixels apart: 8 is left out, 32 is far enough from 1.
        assert!(svg.contains(">1<") && !svg.contains(">8<") && svg.contains(">32<"));
        assert!(svg.contains(">508<"));
    }
}
