//! `flatmesh place`: place an application on a cluster with HCM, annealing or the ILP (E3 §3.3).

use anyhow::Context;
use flatmesh_control::model::{load_app, load_cluster};
use flatmesh_control::placement::{place, to_json, Algorithm};
use flatmesh_control::topology::Topology;
use flatmesh_control::workload::Workload;

#[derive(clap::Args)]
pub struct Args {
    /// Cluster: a YAML file or preset:NAME (e.g. preset:3xType1-SmartNIC).
    #[arg(long)]
    cluster: String,
    /// Application: a YAML file or preset:NAME (e.g. preset:IOT-TS). Repeat to place several apps.
    #[arg(long, required = true)]
    app: Vec<String>,
    /// hcm (E3's Algorithm 1), anneal (Service Fabric style) or ilp (microlp, small instances).
    #[arg(long, default_value = "hcm")]
    algo: String,
    /// Seed for annealing.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print the JSON output contract instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let algo: Algorithm = args.algo.parse()?;
    let topo = Topology::build(&load_cluster(&args.cluster)?)?;
    let apps = args
        .app
        .iter()
        .map(|a| load_app(a))
        .collect::<Result<Vec<_>, _>>()?;
    let wl = Workload::from_apps(&apps)?;
    let p = place(&topo, &wl, algo, args.seed)
        .with_context(|| format!("placing on {} with {}", topo.name, algo.name()))?;
    let out = to_json(&topo, &wl, &p);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    let mut table = comfy_table::Table::new();
    table.set_header(vec!["node", "kind", "cores used", "memory MB", "instances"]);
    for node in &out.nodes {
        let here: Vec<&_> = out
            .placements
            .iter()
            .filter(|pl| pl.node == node.id)
            .collect();
        // `+ 0.0` turns the -0.0 that an empty float sum yields into 0.0 for display.
        let cores: f64 = here.iter().map(|pl| pl.cores).sum::<f64>() + 0.0;
        let mem: u64 = here.iter().map(|pl| pl.memory_mb).sum();
        let mut names: Vec<String> = here.iter().map(|pl| pl.instance.to_string()).collect();
        if names.len() > 6 {
            let more = names.len() - 6;
            names.truncate(6);
            names.push(format!("... +{more}"));
        }
        table.add_row(vec![
            node.id.to_string(),
            format!("{:?}", node.kind).to_lowercase(),
            format!("{cores:.2}/{}", node.cores),
            format!("{mem}/{}", node.memory_mb),
            names.join(" "),
        ]);
    }
    println!("{table}");
    let m = out.metrics;
    println!(
        "{}: {} instances in {:.3} ms; avg hops {:.3}; {:.0} req/s at {:.1} W = {:.0} req/J; cost efficiency {:.3e} req/$ over 5 years",
        out.algorithm,
        out.placements.len(),
        out.seconds * 1e3,
        m.avg_hops,
        m.throughput_rps,
        m.power_watts,
        m.energy_rpj,
        m.cost_efficiency
    );
    Ok(())
}
