//! Minimal SVG charts for the simulator's figures. Hand-written because a plotting crate (plotters)
//! would pull a font stack into a build that must stay light; two chart kinds are all we need.

use std::fmt::Write;

const W: f64 = 720.0;
const H: f64 = 400.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 170.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;
const COLORS: &[&str] = &[
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#9c755f",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

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
}

fn legend(out: &mut String, names: &[String]) {
    for (k, name) in names.iter().enumerate() {
        let y = TOP + 10.0 + 18.0 * k as f64;
        let _ = write!(
            out,
            r#"<rect x="{}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{}">{}</text>"#,
            W - RIGHT + 15.0,
            y - 10.0,
            COLORS[k % COLORS.len()],
            W - RIGHT + 32.0,
            y,
            esc(name)
        );
    }
}

/// y axis; returns the mapping from value to pixel. Linear: 0 to 1.1 x max in 5 ticks. Log: whole
/// decades from below `min` to above `max` (at least one), a tick per decade.
fn y_axis(out: &mut String, min: f64, max: f64, log: bool) -> impl Fn(f64) -> f64 {
    let plot_h = H - TOP - BOTTOM;
    let (lo, hi, ticks) = if log {
        let hi = max.max(1e-12).log10().ceil();
        let lo = min.max(1e-12).log10().floor().min(hi - 1.0).max(hi - 12.0);
        (lo, hi, (hi - lo) as u32)
    } else {
        (0.0, if max > 0.0 { max * 1.1 } else { 1.0 }, 5)
    };
    for k in 0..=ticks {
        let v = lo + (hi - lo) * f64::from(k) / f64::from(ticks);
        let y = H - BOTTOM - plot_h * f64::from(k) / f64::from(ticks);
        let label = if log {
            // Whole decades: 0.001, 0.01, ..., 1, 10, 100.
            format!("{:.*}", (-v).max(0.0) as usize, 10f64.powf(v))
        } else {
            format!("{v:.3}")
        };
        let _ = write!(
            out,
            r##"<line x1="{LEFT}" x2="{}" y1="{y}" y2="{y}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{label}</text>"##,
            W - RIGHT,
            LEFT - 5.0,
            y + 4.0
        );
    }
    move |v: f64| {
        let t = if log {
            (v.max(1e-300).log10() - lo) / (hi - lo)
        } else {
            v / hi
        };
        H - BOTTOM - plot_h * t.clamp(0.0, 1.0)
    }
}

/// Grouped bars: one group per category, one bar per series.
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
    let y = y_axis(&mut out, 0.0, max, false);
    let plot_w = W - LEFT - RIGHT;
    let group_w = plot_w / categories.len().max(1) as f64;
    let bar_w = group_w * 0.8 / series.len().max(1) as f64;
    for (c, cat) in categories.iter().enumerate() {
        let x0 = LEFT + group_w * c as f64 + group_w * 0.1;
        for (s, (_, vals)) in series.iter().enumerate() {
            let v = vals.get(c).copied().unwrap_or(0.0);
            let v = if v.is_finite() { v } else { 0.0 };
            let top = y(v);
            let _ = write!(
                out,
                r#"<rect x="{:.1}" y="{top:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{v}</title></rect>"#,
                x0 + bar_w * s as f64,
                bar_w,
                (H - BOTTOM - top).max(0.0),
                COLORS[s % COLORS.len()]
            );
        }
        let _ = write!(
            out,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
            x0 + group_w * 0.4,
            H - BOTTOM + 18.0,
            esc(cat)
        );
    }
    legend(
        &mut out,
        &series.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>(),
    );
    out.push_str("</svg>\n");
    out
}

/// Lines over a shared x axis; `None` values break the line (e.g. the ILP gave up).
pub fn line_chart(
    title: &str,
    xlabel: &str,
    ylabel: &str,
    xs: &[f64],
    series: &[(String, Vec<Option<f64>>)],
    log_y: bool,
) -> String {
    let mut out = String::new();
    header(&mut out, title, ylabel);
    let values = || {
        series
            .iter()
            .flat_map(|(_, v)| v.iter().flatten().copied())
            .filter(|v| v.is_finite() && (!log_y || *v > 0.0))
    };
    let max = values().fold(0.0, f64::max);
    let min = values().fold(f64::INFINITY, f64::min);
    let y = y_axis(&mut out, min, max, log_y);
    let (xmin, xmax) = xs
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| {
            (a.min(x), b.max(x))
        });
    let span = if xmax > xmin { xmax - xmin } else { 1.0 };
    let x = |v: f64| LEFT + (W - LEFT - RIGHT) * (v - xmin) / span;
    for &xv in xs {
        let _ = write!(
            out,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{xv}</text>"#,
            x(xv),
            H - BOTTOM + 18.0
        );
    }
    let _ = write!(
        out,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        (LEFT + W - RIGHT) / 2.0,
        H - 15.0,
        esc(xlabel)
    );
    for (s, (_, vals)) in series.iter().enumerate() {
        let color = COLORS[s % COLORS.len()];
        let mut path = String::new();
        let mut pen_down = false;
        for (k, v) in vals.iter().enumerate() {
            match (v, xs.get(k)) {
                (Some(v), Some(&xv)) if v.is_finite() => {
                    let _ = write!(
                        path,
                        "{}{:.1},{:.1} ",
                        if pen_down { "L" } else { "M" },
                        x(xv),
                        y(*v)
                    );
                    let _ = write!(
                        out,
                        r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"><title>{v}</title></circle>"#,
                        x(xv),
                        y(*v)
                    );
                    pen_down = true;
                }
                _ => pen_down = false,
            }
        }
        let _ = write!(
            out,
            r#"<path d="{path}" fill="none" stroke="{color}" stroke-width="2"/>"#
        );
    }
    legend(
        &mut out,
        &series.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>(),
    );
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_are_well_formed() {
        let b = bar_chart(
            "t<1>",
            "y",
            &["a".into(), "b".into()],
            &[("s".into(), vec![1.0, f64::NAN])],
        );
        assert!(b.starts_with("<svg") && b.ends_with("</svg>\n"));
        assert!(b.contains("t&lt;1&gt;"));
        assert_eq!(b.matches("<rect x=").count(), 2 + 1);
        let l = line_chart(
            "t",
            "x",
            "y",
            &[1.0, 2.0, 3.0],
            &[("s".into(), vec![Some(1.0), None, Some(100.0)])],
            true,
        );
        assert_eq!(l.matches("<circle").count(), 2);
        let d = l.split("d=\"").nth(1).unwrap().split('"').next().unwrap();
        assert_eq!(d.matches('M').count(), 2, "line broken at the gap: {d}");
        // A log axis spans every value: the decades from 0.001 to 1000, nothing clamped to an edge.
        let l = line_chart(
            "t",
            "x",
            "y",
            &[1.0, 2.0],
            &[("s".into(), vec![Some(0.002), Some(263.0)])],
            true,
        );
        for label in [">0.001<", ">0.01<", ">1<", ">1000<"] {
            assert!(l.contains(label), "{label} missing: {l}");
        }
        let ys: Vec<f64> = l
            .split("cy=\"")
            .skip(1)
            .map(|s| s.split('"').next().unwrap().parse().unwrap())
            .collect();
        assert!(ys.iter().all(|&y| y > TOP && y < H - BOTTOM), "{ys:?}");
    }
}
