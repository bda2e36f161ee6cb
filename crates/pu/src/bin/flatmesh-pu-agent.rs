//! The PU agent as a small standalone daemon (what would be installed on a DPU's OS), the same
//! code as `flatmesh pu agent`: `flatmesh-pu-agent --pu NAME --config FILE`.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mut pu, mut config) = (None, None);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--pu" => pu = it.next().cloned(),
            "--config" | "-c" => config = it.next().cloned(),
            "--help" | "-h" => {
                println!("usage: flatmesh-pu-agent --pu NAME --config FILE\n\nRuns the agent of one PU of a split network namespace (docs/pu.md); the same as `flatmesh pu agent`.");
                return ExitCode::SUCCESS;
            }
            _ => {
                eprintln!("error: unexpected argument `{a}`\nusage: flatmesh-pu-agent --pu NAME --config FILE");
                return ExitCode::FAILURE;
            }
        }
    }
    let (Some(pu), Some(config)) = (pu, config) else {
        eprintln!("usage: flatmesh-pu-agent --pu NAME --config FILE");
        return ExitCode::FAILURE;
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    let result = flatmesh_pu::SplitConfig::load(std::path::Path::new(&config)).and_then(|c| {
        let backend = flatmesh_pu::backend::for_config(&c);
        flatmesh_pu::Agent::run(
            &c,
            &pu,
            backend.as_ref(),
            flatmesh_pu::agent::stop_on_signals(),
        )
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
