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

fn demo(args: DemoArgs) -> anyhow::Result<()> {
    use flatmesh_qnp::dispatch::Mode;
    let modes: Vec<Mode> = args
        .modes
        .split(',')
        .map(|m| m.trim().parse::<Mode>().map_err(anyhow::Error::msg))
        .collect::<anyhow::Result<_>>()?;
    let results = flatmesh_qnp::load::compare_modes(
        &modes,
        &args.workload,
        args.workers,
        args.dispatchers,
        args.clients,
        std::time::Duration::from_secs_f64(args.seconds),
    )?;
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
    println!(
        "workload {}, {} workers, {} dispatcher(s), {} clients, {} s per mode",
        args.workload, args.workers, args.dispatchers, args.clients, args.seconds
    );
    println!("{table}");
    Ok(())
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        Command::Demo(args) => demo(args)?,
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
