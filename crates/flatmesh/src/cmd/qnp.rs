//! `flatmesh qnp`: QingNiao tools. The work happens in `flatmesh_qnp`; this file only reads
//! arguments and files and prints.

use anyhow::Context as _;
use flatmesh_qnp::image::{parse_eval_inputs, Image};
use flatmesh_qnp::rules::RuleSet;
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Subcommand)]
enum Command {
    /// The QingNiao IDL.
    Idl {
        #[command(subcommand)]
        command: IdlCommand,
    },
    /// Skip-and-check dispatch rules and the Matcher's RAM/CAM image.
    Rules {
        #[command(subcommand)]
        command: RulesCommand,
    },
    /// Serve an example app in each dispatch mode under closed-loop load; print a table.
    Demo(DemoArgs),
    /// The dispatch benchmark: all modes side by side on the same cores; the key-value headline,
    /// throughput and latency against skip-and-checks and rules, and the decision cost (Table 1).
    Bench(BenchArgs),
}

#[derive(clap::Args)]
struct BenchArgs {
    /// Worker threads.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Dispatcher threads of the software modes.
    #[arg(long, default_value_t = 1)]
    dispatchers: usize,
    /// Client sockets of the load generator (each its own port, so SO_REUSEPORT spreads them).
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Requests each client keeps outstanding (closed loop). 0 uses the full QNP endpoint
    /// client with one request outstanding, which is too slow to load a server core.
    #[arg(long, default_value_t = 8)]
    window: usize,
    /// Seconds per run.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Runs of every point (modes interleaved); the report gives the median and min–max.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Modes, comma-separated: reuseport, kernel (needs root), software-queue, software-uds.
    #[arg(long, default_value = "reuseport,kernel,software-queue,software-uds")]
    modes: String,
    /// CPUs of the workers and dispatchers (DESIGN.md: the system under test on CPU 1).
    #[arg(long, default_value = "1")]
    server_cpus: String,
    /// CPUs of the load generator (DESIGN.md: CPU 0).
    #[arg(long, default_value = "0")]
    load_cpus: String,
    /// Skip-and-checks per rule to sweep (Figs. 15/18, Table 1); empty to skip.
    #[arg(long, default_value = "1,2,4,8,16,32,48")]
    checks: String,
    /// Rule counts to sweep (Figs. 16/19); empty to skip. 511 is the most that fit the image.
    #[arg(long, default_value = "1,32,128,256,511")]
    rules: String,
    /// Skip the key-value headline.
    #[arg(long)]
    no_headline: bool,
    /// Turn on the sysctl kernel.bpf_stats_enabled during the run (restored after) to measure
    /// the kernel program's run time per packet.
    #[arg(long)]
    bpf_stats: bool,
    /// Write the Markdown report here too.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write SVG plots into this directory.
    #[arg(long)]
    svg_dir: Option<PathBuf>,
}

#[derive(clap::Args)]
struct DemoArgs {
    /// `kv` (Zipf(0.9) GETs over 24 key ranges) or `pingpong` (128-byte echo).
    #[arg(long, default_value = "kv")]
    workload: String,
    /// Worker threads (one per core in a real deployment).
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Dispatcher threads of the software modes.
    #[arg(long, default_value_t = 1)]
    dispatchers: usize,
    /// Closed-loop clients.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Seconds per mode.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Modes to run, comma-separated: reuseport, kernel (needs root), software-queue, software-uds.
    #[arg(long, default_value = "reuseport,kernel,software-queue,software-uds")]
    modes: String,
}

#[derive(clap::Subcommand)]
enum IdlCommand {
    /// Generate Rust encode/decode code (writes DIR/<app>.rs).
    Compile {
        /// The IDL file.
        file: PathBuf,
        /// Directory for the generated module.
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(clap::Subcommand)]
enum RulesCommand {
    /// Compile a rule file into the Matcher's RAM/CAM image.
    Compile {
        /// The rule file.
        file: PathBuf,
        /// Where to write the image.
        #[arg(long)]
        image: PathBuf,
        /// Print both tables.
        #[arg(long)]
        explain: bool,
    },
    /// Run the reference Matcher over an image; prints one queue number or `drop` per input line.
    Eval {
        /// The image from `rules compile`.
        #[arg(long)]
        image: PathBuf,
        /// Lines of `app_id req_type hex-of-field-value`.
        #[arg(long)]
        inputs: PathBuf,
    },
}

fn read(path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path)
        .with_context(|| format!("reading {}; check the path", path.display()))
}

fn parse_modes(s: &str) -> anyhow::Result<Vec<flatmesh_qnp::dispatch::Mode>> {
    s.split(',')
        .map(|m| m.trim().parse().map_err(anyhow::Error::msg))
        .collect()
}

fn parse_list(what: &str, s: &str) -> anyhow::Result<Vec<usize>> {
    s.split(',')
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(|v| {
            v.parse()
                .with_context(|| format!("bad {what} `{v}`; give comma-separated numbers"))
        })
        .collect()
}

fn demo(args: DemoArgs) -> anyhow::Result<()> {
    let modes = parse_modes(&args.modes)?;
    let spec = flatmesh_qnp::load::RunSpec {
        generator: flatmesh_qnp::load::Generator::Endpoint,
        workers: args.workers,
        dispatchers: args.dispatchers,
        clients: args.clients,
        duration: std::time::Duration::from_secs_f64(args.seconds),
        pinning: Default::default(),
    };
    let results = flatmesh_qnp::load::compare_modes(&modes, &args.workload, &spec)?;
    let mut table = comfy_table::Table::new();
    table.set_header([
        "mode",
        "req/s",
        "p50 µs",
        "p99 µs",
        "timeouts",
        "per worker",
        "dispatcher drops",
    ]);
    for r in results {
        table.add_row([
            format!("{:?}", r.mode),
            format!("{:.0}", r.report.rps()),
            format!("{:.1}", r.report.p50_us),
            format!("{:.1}", r.report.p99_us),
            r.report.errors.to_string(),
            format!("{:?}", r.per_worker),
            r.dropped.to_string(),
        ]);
    }
    let store = if args.workload == "kv" {
        ", store: RocksDB (librocksdb 7.8, 24,000 pre-loaded keys)"
    } else {
        ""
    };
    println!(
        "workload {}{store}, {} workers, {} dispatcher(s), {} clients, {} s per mode",
        args.workload, args.workers, args.dispatchers, args.clients, args.seconds
    );
    println!("{table}");
    Ok(())
}

const BPF_STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";

fn bench(args: BenchArgs) -> anyhow::Result<()> {
    use flatmesh_qnp::{bench, cpu, load};
    let pinning = load::Pinning {
        server: cpu::parse_cpu_list(&args.server_cpus)?,
        load: cpu::parse_cpu_list(&args.load_cpus)?,
    };
    // Fail now, not in a server thread, if a CPU does not exist.
    std::thread::scope(|s| {
        s.spawn(|| cpu::pin_current_thread(&pinning.server))
            .join()
            .unwrap_or(Ok(()))
    })?;
    let cfg = bench::BenchConfig {
        modes: parse_modes(&args.modes)?,
        spec: load::RunSpec {
            generator: match args.window {
                0 => load::Generator::Endpoint,
                window => load::Generator::Pipelined { window },
            },
            workers: args.workers,
            dispatchers: args.dispatchers,
            clients: args.clients,
            duration: std::time::Duration::from_secs_f64(args.seconds),
            pinning,
        },
        repeats: args.repeats,
        checks: parse_list("skip-and-check count", &args.checks)?,
        rules: parse_list("rule count", &args.rules)?,
        headline: !args.no_headline,
    };
    let previous = if args.bpf_stats {
        let old = std::fs::read_to_string(BPF_STATS).unwrap_or_default();
        std::fs::write(BPF_STATS, "1")
            .with_context(|| format!("writing 1 to {BPF_STATS}; --bpf-stats needs root"))?;
        Some(old)
    } else {
        None
    };
    let result = bench::run(&cfg, &mut |line| eprintln!("{line}"));
    if let Some(old) = previous {
        let old = if old.trim().is_empty() {
            "0"
        } else {
            old.trim()
        };
        if let Err(e) = std::fs::write(BPF_STATS, old) {
            eprintln!("warning: could not restore {BPF_STATS} to {old}: {e}");
        }
    }
    let report = result?;
    let md = report.markdown(&cfg);
    print!("{md}");
    if let Some(out) = &args.out {
        std::fs::write(out, &md)
            .with_context(|| format!("writing {}; check permissions", out.display()))?;
    }
    if let Some(dir) = &args.svg_dir {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating {}; check permissions", dir.display()))?;
        for (name, svg) in report.svgs() {
            let path = dir.join(name);
            std::fs::write(&path, svg)
                .with_context(|| format!("writing {}; check permissions", path.display()))?;
            eprintln!("wrote {}", path.display());
        }
    }
    Ok(())
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        Command::Demo(args) => demo(args)?,
        Command::Bench(args) => bench(args)?,
        Command::Idl {
            command: IdlCommand::Compile { file, out },
        } => {
            let (name, code) =
                flatmesh_qnp::idl::compile(&file.display().to_string(), &read(&file)?)?;
            std::fs::create_dir_all(&out)
                .with_context(|| format!("creating {}; check permissions", out.display()))?;
            let dest = out.join(name);
            std::fs::write(&dest, code)
                .with_context(|| format!("writing {}; check permissions", dest.display()))?;
            println!("wrote {}", dest.display());
        }
        Command::Rules {
            command:
                RulesCommand::Compile {
                    file,
                    image,
                    explain,
                },
        } => {
            let set = RuleSet::parse(&file.display().to_string(), &read(&file)?)?;
            let img = Image::compile(&set)?;
            std::fs::write(&image, img.to_bytes())
                .with_context(|| format!("writing {}; check permissions", image.display()))?;
            if explain {
                print!("{}", img.explain());
            }
            println!(
                "wrote {}: {} rules, {} RAM and {} CAM entries of {}",
                image.display(),
                set.rules.len(),
                img.ram.len(),
                img.cam.len(),
                flatmesh_qnp::image::TABLE_ENTRIES
            );
        }
        Command::Rules {
            command: RulesCommand::Eval { image, inputs },
        } => {
            let bytes = std::fs::read(&image)
                .with_context(|| format!("reading {}; check the path", image.display()))?;
            let img = Image::from_bytes(&bytes)?;
            let inputs = parse_eval_inputs(&inputs.display().to_string(), &read(&inputs)?)?;
            let mut out = String::new();
            for i in inputs {
                let (d, _) = img.run(i.app_id, i.req_type, |_| Some(&i.value[..]));
                out.push_str(&d.to_string());
                out.push('\n');
            }
            print!("{out}");
        }
    }
    Ok(())
}
