//! `flatmesh simulate scale|energy`: E3's Table 6 (placement time at scale) and Table 5 / Fig. 10
//! (energy and cost efficiency by cluster), with SVG plots.

use anyhow::Context;
use flatmesh_control::model::{load_app, TABLE5_CLUSTERS};
use flatmesh_control::placement::Algorithm;
use flatmesh_control::simulate::{self, PAPER_TABLE5, PAPER_TABLE6, TABLE6_SERVERS};
use flatmesh_lab::svg::{self, Scale, Series};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(clap::Subcommand)]
enum What {
    /// Table 6: per-microservice deployment time of hcm, anneal and ilp at 100-1,000 servers.
    Scale {
        /// Server counts (Type2-SmartNIC servers, 40 per rack).
        #[arg(long, value_delimiter = ',', default_values_t = TABLE6_SERVERS.to_vec())]
        servers: Vec<u32>,
        /// Microservice instances to deploy.
        #[arg(long, default_value_t = 10_000)]
        microservices: usize,
        /// Algorithms to run.
        #[arg(long, value_delimiter = ',', default_values_t = ["hcm".to_string(), "anneal".to_string(), "ilp".to_string()])]
        algos: Vec<String>,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Write the plot here.
        #[arg(long, default_value = "table6.svg")]
        svg: String,
        #[arg(long)]
        json: bool,
    },
    /// Fig. 11: one orchestrator decision round over heartbeats from every SmartNIC.
    Orchestrator {
        /// Type2-SmartNIC servers (4 SmartNICs each).
        #[arg(long, value_delimiter = ',', default_values_t = vec![1000u32, 10_000, 50_000])]
        servers: Vec<u32>,
    },
    /// Table 5 and Fig. 10: energy and cost efficiency of NFV-FIN, RTA-SHM and IOT-TS per cluster.
    Energy {
        /// Directory for table5.svg and fig10-APP.svg.
        #[arg(long, default_value = ".")]
        svg_dir: String,
        #[arg(long)]
        json: bool,
    },
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.what {
        What::Scale {
            servers,
            microservices,
            algos,
            seed,
            svg,
            json,
        } => scale(&servers, microservices, &algos, seed, &svg, json),
        What::Energy { svg_dir, json } => energy(&svg_dir, json),
        What::Orchestrator { servers } => {
            for n in servers {
                let r = simulate::orchestrator_round(n, 6)
                    .with_context(|| format!("orchestrator round at {n} servers"))?;
                println!(
                    "{:>6} servers  {:>7} heartbeats (16 B)  decision round {:.3} ms  {} overload signals",
                    r.servers, r.heartbeats, r.round_ms, r.signals
                );
            }
            Ok(())
        }
    }
}

fn scale(
    servers: &[u32],
    microservices: usize,
    algos: &[String],
    seed: u64,
    svg_path: &str,
    json: bool,
) -> anyhow::Result<()> {
    let algos: Vec<Algorithm> = algos.iter().map(|a| a.parse()).collect::<Result<_, _>>()?;
    let mut rows = Vec::new();
    for &algo in &algos {
        for &n in servers {
            let row = simulate::scale(n, microservices, algo, seed)
                .with_context(|| format!("{} at {n} servers", algo.name()))?;
            if !json {
                let paper = PAPER_TABLE6
                    .iter()
                    .find(|(a, _)| *a == algo.name())
                    .and_then(|(_, v)| TABLE6_SERVERS.iter().position(|&s| s == n).map(|k| v[k]));
                println!(
                    "{:>6} {:>5} servers  {:>6} microservices  {:>10} ms/microservice ({:>8} with all others deployed)  avg hops {:>6}  paper {:>8}  {}",
                    row.algorithm,
                    row.servers,
                    row.microservices,
                    row.ms_per_microservice.map_or(">>1s".into(), |v| format!("{v:.4}")),
                    row.ms_per_microservice_last_app.map_or("-".into(), |v| format!("{v:.4}")),
                    row.avg_hops.map_or("-".into(), |v| format!("{v:.3}")),
                    match paper {
                        Some(Some(v)) => format!("{v} ms"),
                        Some(None) => ">>1s".into(),
                        None => "-".into(),
                    },
                    row.note
                );
            }
            rows.push(row);
        }
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    }
    let xs: Vec<f64> = servers.iter().map(|&s| f64::from(s)).collect();
    let mut series: Vec<(String, Vec<Option<f64>>)> = algos
        .iter()
        .map(|a| {
            let v = servers
                .iter()
                .map(|&s| {
                    rows.iter()
                        .find(|r| r.algorithm == a.name() && r.servers == s)
                        .and_then(|r| r.ms_per_microservice)
                })
                .collect();
            (a.name().to_string(), v)
        })
        .collect();
    // The paper's Table 6 next to ours, at the server counts it has.
    for a in &algos {
        let Some((_, paper)) = PAPER_TABLE6.iter().find(|(n, _)| *n == a.name()) else {
            continue;
        };
        let v: Vec<Option<f64>> = servers
            .iter()
            .map(|s| {
                TABLE6_SERVERS
                    .iter()
                    .position(|t| t == s)
                    .and_then(|k| paper[k])
            })
            .collect();
        if v.iter().any(Option::is_some) {
            series.push((format!("{} (paper)", a.name()), v));
        }
    }
    let chart = svg::line_chart(
        "Per-microservice deployment time (Table 6)",
        "servers",
        "ms (log)",
        &along(&xs, series),
        Scale::Log,
    );
    std::fs::write(svg_path, chart).with_context(|| format!("writing {svg_path}"))?;
    eprintln!("wrote {svg_path}");
    Ok(())
}

fn energy(svg_dir: &str, json: bool) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    for (app, paper) in PAPER_TABLE5 {
        let spec = load_app(&format!("preset:{app}"))?;
        for (k, cluster) in TABLE5_CLUSTERS.iter().enumerate() {
            let row = simulate::energy(&spec, &format!("preset:{cluster}"))?;
            if !json {
                println!(
                    "{:<8} {:<18} peak {:>10.0} req/s  {:>7.1} W  {:>7.3} KRPJ (paper {:>4} KRPJ)  5-year cost efficiency {:.3e} req/$",
                    app, cluster, row.peak_rps, row.power_watts, row.krpj, paper[k],
                    row.cost_efficiency.last().map_or(0.0, |c| c.1)
                );
            }
            rows.push(row);
        }
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    }
    let apps: Vec<String> = PAPER_TABLE5.iter().map(|(a, _)| a.to_string()).collect();
    let series: Vec<(String, Vec<f64>)> = TABLE5_CLUSTERS
        .iter()
        .map(|c| {
            (
                c.to_string(),
                apps.iter()
                    .map(|a| {
                        rows.iter()
                            .find(|r| &r.app == a && r.cluster == *c)
                            .map_or(0.0, |r| r.krpj)
                    })
                    .collect(),
            )
        })
        .collect();
    let dir = std::path::Path::new(svg_dir);
    std::fs::create_dir_all(dir).with_context(|| format!("creating {svg_dir}"))?;
    let path = dir.join("table5.svg");
    std::fs::write(
        &path,
        svg::bar_chart(
            "Energy efficiency by cluster (Table 5, simulated)",
            "KRPJ",
            &apps,
            &series,
        ),
    )
    .with_context(|| format!("writing {}", path.display()))?;
    // The paper's Table 5 in the same layout, to compare the shape.
    let paper: Vec<(String, Vec<f64>)> = TABLE5_CLUSTERS
        .iter()
        .enumerate()
        .map(|(k, c)| {
            (
                c.to_string(),
                PAPER_TABLE5.iter().map(|(_, v)| v[k]).collect(),
            )
        })
        .collect();
    let path = dir.join("table5-paper.svg");
    std::fs::write(
        &path,
        svg::bar_chart(
            "Energy efficiency by cluster (Table 5, E3 paper)",
            "KRPJ",
            &apps,
            &paper,
        ),
    )
    .with_context(|| format!("writing {}", path.display()))?;
    for app in &apps {
        let series: Vec<Series> = TABLE5_CLUSTERS
            .iter()
            .filter_map(|c| rows.iter().find(|r| &r.app == app && r.cluster == *c))
            .map(|r| Series::full(r.cluster.clone(), r.cost_efficiency.iter().copied()))
            .collect();
        let path = dir.join(format!("fig10-{app}.svg"));
        std::fs::write(
            &path,
            svg::line_chart(
                &format!("Cost efficiency, {app} (Fig. 10)"),
                "years of ownership",
                "requests per $",
                &series,
                Scale::Linear,
            ),
        )
        .with_context(|| format!("writing {}", path.display()))?;
    }
    eprintln!("wrote table5.svg, table5-paper.svg and fig10-*.svg to {svg_dir}");
    Ok(())
}

/// Named values, one per x of `xs` (`None`: no value there), as chart series.
fn along(xs: &[f64], series: Vec<(String, Vec<Option<f64>>)>) -> Vec<Series> {
    series
        .into_iter()
        .map(|(name, values)| Series {
            name,
            points: xs.iter().copied().zip(values).collect(),
        })
        .collect()
}
