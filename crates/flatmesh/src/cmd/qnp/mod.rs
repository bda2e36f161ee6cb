//! `flatmesh qnp`: QingNiao tools. The work happens in `flatmesh_qnp` (IDL, rules, images) and
//! in the lab (`flatmesh_lab::qnp`: the demo and the benchmark); this file only reads arguments
//! and files and prints.

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
    /// Rules during the skip-and-check sweep (the paper's 32).
    #[arg(long, default_value_t = flatmesh_lab::qnp::bench::FIXED_RULES)]
    fixed_rules: usize,
    /// Rule counts to sweep (Figs. 16/19); empty to skip. With 4 skip-and-checks per rule, 508
    /// rules fill the 512-entry image.
    #[arg(long, default_value = "1,8,32,128,256,508")]
    rules: String,
    /// Skip-and-checks per rule during the rule sweep (the paper's 4).
    #[arg(long, default_value_t = flatmesh_lab::qnp::bench::FIXED_CHECKS)]
    fixed_checks: usize,
    /// Skip the key-value headline (it runs only in a build with `--features kv`).
    #[arg(long)]
    no_headline: bool,
    /// Keys pre-loaded into the headline's RocksDB store (the paper: 3140000).
    #[arg(long, default_value_t = flatmesh_lab::qnp::load::DEMO_KEYS)]
    keys: usize,
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
    /// Workloads, comma-separated: `kv` (RocksDB GETs, Zipf(0.9) within 24 key ranges that
    /// the rules split over the workers; needs a build with `--features kv`) and `pingpong`
    /// (128 bytes on the wire, echoed). The default is both when `kv` is built in.
    #[arg(long, default_value = flatmesh_lab::qnp::DEFAULT_WORKLOADS)]
    workload: String,
    /// Keys pre-loaded into the RocksDB store of `kv`.
    #[arg(long, default_value_t = flatmesh_lab::qnp::load::DEMO_KEYS)]
    keys: usize,
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
    /// CPUs of the workers and dispatchers, the same for every mode (empty: unpinned).
    #[arg(long, default_value = "")]
    server_cpus: String,
    /// CPUs of the load generator (empty: unpinned).
    #[arg(long, default_value = "")]
    load_cpus: String,
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
    /// Run the bit-exact Matcher model over an image; prints one queue number or `drop` per
    /// input line.
    Eval {
        /// The image from `rules compile`, or from `flatmesh check --nic-image` (http
        /// listener i is app i+1, type 0; queue = route + 1, 0 = the host).
        #[arg(long)]
        image: PathBuf,
        /// Lines of `app_id req_type value`, the value in hex (`757365723a`) or in double
        /// quotes (`1 0 "GET /api/x?y=1 HTTP/1.1"`).
        #[arg(long)]
        inputs: PathBuf,
        /// Also show the image's entries per app, and after each decision the lookups it took
        /// and the entries it hit.
        #[arg(long)]
        explain: bool,
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

fn seconds(s: f64) -> anyhow::Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(s)
        .ok()
        .filter(|d| !d.is_zero())
        .with_context(|| format!("--seconds {s} is not a positive number of seconds"))
}

fn pinning(server: &str, load: &str) -> anyhow::Result<flatmesh_lab::qnp::load::Pinning> {
    use flatmesh_qnp::cpu;
    let pinning = flatmesh_lab::qnp::load::Pinning {
        server: cpu::parse_cpu_list(server)?,
        load: cpu::parse_cpu_list(load)?,
    };
    // Fail now, not in a server thread, if a CPU does not exist.
    std::thread::scope(|s| {
        s.spawn(|| {
            cpu::pin_current_thread(&pinning.server)?;
            cpu::pin_current_thread(&pinning.load)
        })
        .join()
        .unwrap_or(Ok(()))
    })?;
    Ok(pinning)
}

fn demo(args: DemoArgs) -> anyhow::Result<()> {
    use flatmesh_lab::qnp::load::{compare_modes, demo_table, DemoApp, Generator, RunSpec};
    let modes = parse_modes(&args.modes)?;
    let apps: Vec<(String, DemoApp)> = args
        .workload
        .split(',')
        .map(str::trim)
        .filter(|w| !w.is_empty())
        .map(|w| {
            let app = match w.parse()? {
                DemoApp::Kv { .. } => DemoApp::Kv { keys: args.keys },
                other => other,
            };
            Ok((w.to_string(), app))
        })
        .collect::<anyhow::Result<_>>()?;
    anyhow::ensure!(
        !apps.is_empty(),
        "--workload is empty; use kv, pingpong or both"
    );
    let spec = RunSpec {
        generator: Generator::Endpoint,
        workers: args.workers,
        dispatchers: args.dispatchers,
        clients: args.clients,
        duration: seconds(args.seconds)?,
        pinning: pinning(&args.server_cpus, &args.load_cpus)?,
    };
    for (name, app) in apps {
        let what = match app {
            DemoApp::Kv { keys } => format!(
                "kv: GETs of {keys} pre-loaded 62-byte keys on RocksDB (librocksdb 7.8), Zipf(0.9) within 24 key ranges; rules send range r to worker r mod {}",
                args.workers
            ),
            DemoApp::PingPong => format!(
                "pingpong: 128-byte requests echoed; rules send {} lanes round-robin to the workers",
                flatmesh_lab::qnp::load::DEMO_LANES
            ),
        };
        eprintln!(
            "running {name} in {} mode(s), {} s each ...",
            modes.len(),
            args.seconds
        );
        let results = compare_modes(&modes, app, &spec)?;
        println!(
            "{what}\n{} workers, {} dispatcher(s) in the software modes, {} closed-loop clients, {} s per mode",
            args.workers, args.dispatchers, args.clients, args.seconds
        );
        println!("{}", demo_table(&results));
    }
    Ok(())
}

const BPF_STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";

fn bench(args: BenchArgs) -> anyhow::Result<()> {
    use flatmesh_lab::qnp::{bench, load};
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
            duration: seconds(args.seconds)?,
            pinning: pinning(&args.server_cpus, &args.load_cpus)?,
        },
        repeats: args.repeats,
        checks: parse_list("skip-and-check count", &args.checks)?,
        rules: parse_list("rule count", &args.rules)?,
        fixed_rules: args.fixed_rules,
        fixed_checks: args.fixed_checks,
        headline: !args.no_headline && flatmesh_lab::qnp::KV_BUILT,
        keys: args.keys,
    };
    if !args.no_headline && !flatmesh_lab::qnp::KV_BUILT {
        eprintln!("note: no key-value headline: it runs on RocksDB, which this build leaves out (build with `cargo build --release -p flatmesh --features kv`)");
    }
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
            command:
                RulesCommand::Eval {
                    image,
                    inputs,
                    explain,
                },
        } => {
            let bytes = std::fs::read(&image)
                .with_context(|| format!("reading {}; check the path", image.display()))?;
            let img = Image::from_bytes(&bytes)?;
            let inputs = parse_eval_inputs(&inputs.display().to_string(), &read(&inputs)?)?;
            let mut out = String::new();
            if explain {
                for ((app, ty), n, first, last) in img.apps() {
                    out.push_str(&format!(
                        "# app {app} type {ty}: {n} entries ({first}..={last}) of {}\n",
                        flatmesh_qnp::image::TABLE_ENTRIES
                    ));
                }
            }
            for i in inputs {
                let mut hits = Vec::new();
                let (d, lookups) = img.run_traced(
                    i.app_id,
                    i.req_type,
                    |_| Some(&i.value[..]),
                    |e| hits.push(e.to_string()),
                );
                out.push_str(&d.to_string());
                if explain {
                    out.push_str(&format!(
                        "  # {lookups} lookups, entries hit: {}",
                        if hits.is_empty() {
                            "none".to_string()
                        } else {
                            hits.join(" ")
                        }
                    ));
                }
                out.push('\n');
            }
            print!("{out}");
        }
    }
    Ok(())
}
