//! `flatmesh check --config FILE [--explain] [--nic-image OUT]`: validate a config, print its
//! rule program, write tier N's image. `flatmesh check --explain --admin ADDR`: the program a
//! running node runs, with the tiers it actually has.

use std::path::PathBuf;

use anyhow::Context as _;
use flatmesh_config::AdminAddress;
use flatmesh_rules::image::TABLE_ENTRIES;

#[derive(clap::Args)]
pub struct Args {
    /// The YAML config to validate.
    #[arg(long, short, required_unless_present = "admin")]
    config: Option<PathBuf>,
    /// Print the compiled rule program: every table, every rule, what each tier's lowering
    /// does with it and the tier it runs in.
    #[arg(long)]
    explain: bool,
    /// Write tier N's QingNiao Matcher image of the http listeners (`QNPIMG01`; evaluate it
    /// with `flatmesh qnp rules eval --image OUT --inputs FILE`).
    #[arg(long, value_name = "OUT")]
    nic_image: Option<PathBuf>,
    /// Ask the node whose admin endpoint is at ADDR (IP:PORT or unix:/path) for the program
    /// it runs and where each rule actually runs on it (its `/rules`), and print that.
    #[arg(long, value_name = "ADDR")]
    admin: Option<AdminAddress>,
    /// The admin token (`admin.token` / `admin.token_file` of the node), read from FILE.
    #[arg(long, value_name = "FILE", requires = "admin")]
    admin_token_file: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if let Some(path) = &args.config {
        let config = flatmesh_config::load(path).map_err(|e| anyhow::anyhow!("{e}"))?;
        let program = flatmesh_rules::compile(&config)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        // Certificates, keys and roots are read as the node reads them at start.
        flatmesh_proxy::check_tls_files(&config)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        // So are the qnp listeners' rules, compiled into their Matcher images.
        let qnp = qnp_images(&config).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        if args.explain && args.admin.is_none() {
            print!("{}", program.explain());
            print!("{qnp}");
            print!("{}", explain_workloads(&config));
        }
        if let Some(out) = &args.nic_image {
            write_image(&program, out)?;
        }
        println!("{}: ok", path.display());
    }
    if let Some(admin) = &args.admin {
        let token = match &args.admin_token_file {
            Some(path) => Some(
                flatmesh_config::admin::read_token_file(path).map_err(|e| anyhow::anyhow!(e))?,
            ),
            None => None,
        };
        print!("{}", node_rules(admin, token.as_deref())?);
    }
    Ok(())
}

/// Reads and checks every qnp listener's rules as the node does; returns the image of each,
/// as `flatmesh qnp rules compile --explain` prints it.
fn qnp_images(config: &flatmesh_config::Config) -> Result<String, flatmesh_qnp::QnpError> {
    let mut out = String::new();
    for l in &config.listeners {
        let Some(q) = &l.qnp else {
            continue;
        };
        let compiled = flatmesh_qnp::listener::compile(&l.name, q)?;
        out += &format!(
            "\nqnp listener `{}`: {} rules over {} workers ({}); the Matcher image its dispatcher walks:\n",
            l.name,
            compiled.rules.rules.len(),
            q.workers.len(),
            q.workers
                .iter()
                .enumerate()
                .map(|(i, w)| format!("queue {i} = {w}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        out += &compiled.image.explain();
        out.push('\n');
    }
    Ok(out)
}

/// The workloads the node speaks for: how it recognises each and what it presents for it.
fn explain_workloads(config: &flatmesh_config::Config) -> String {
    if config.workloads.is_empty() {
        return "workloads: none declared (a tunnelled connection presents its cluster's certificate)\n"
            .to_owned();
    }
    let mut out = format!("workloads ({}):\n", config.workloads.len());
    for w in &config.workloads {
        let m = &w.matches;
        let how = match (&m.cgroup, m.uid, m.port) {
            (Some(cgroup), _, _) => format!("client in cgroup {}", cgroup.display()),
            (_, Some(uid), _) => format!("client of uid {uid}"),
            (_, _, Some(port)) => format!("listens on port {port}"),
            _ => "no match".to_owned(),
        };
        let presents = match &w.cert {
            Some(cert) if w.is_client() => format!("presents {}", cert.display()),
            _ => "destination of HBONE streams".to_owned(),
        };
        out += &format!("  {}: {} ({how}; {presents})\n", w.name, w.identity);
    }
    out
}

/// Writes the NIC image and says, per http listener, how much of it the image decides.
fn write_image(program: &flatmesh_rules::RuleProgram, out: &PathBuf) -> anyhow::Result<()> {
    let nic = program.nic();
    std::fs::write(out, nic.image.to_bytes()).with_context(|| {
        format!(
            "writing {}; check the directory and permissions",
            out.display()
        )
    })?;
    println!(
        "wrote {}: {} of {TABLE_ENTRIES} entries",
        out.display(),
        nic.image.cam.len()
    );
    for (l, table) in nic.listeners.iter().zip(program.listeners()) {
        let Some(app) = l.app_id else {
            continue;
        };
        let decided = l.routes.iter().filter(|r| r.verdict.decides()).count();
        println!(
            "  listener `{}`: app {app} type {}, entries {}..{}, {decided} of {} routes decided (queue = route + 1, 0 = the host){}",
            table.name,
            flatmesh_rules::lower::nic::REQ_TYPE,
            l.entries.start,
            l.entries.end,
            l.routes.len(),
            if decided < l.routes.len() {
                "; --explain says why the others stay on the host"
            } else {
                ""
            }
        );
    }
    Ok(())
}

/// GET `/rules?format=text` from a node's admin endpoint.
fn node_rules(admin: &AdminAddress, token: Option<&str>) -> anyhow::Result<String> {
    let answer = super::admin_client::request(admin, "GET", "/rules?format=text", token)?;
    match answer.status {
        200 => Ok(answer.body),
        _ => anyhow::bail!(answer.refusal(admin, token, "/rules")),
    }
}
