//! `flatmesh check --config FILE [--explain] [--nic-image OUT]`: validate a config, print its
//! rule program, write tier N's image. `flatmesh check --explain --admin ADDR`: the program a
//! running node runs, with the tiers it actually has.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
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
    /// Ask the node whose admin endpoint is at ADDR for the program it runs and where each
    /// rule actually runs on it (its `/rules`), and print that.
    #[arg(long, value_name = "ADDR")]
    admin: Option<SocketAddr>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if let Some(path) = &args.config {
        let config = flatmesh_config::load(path).map_err(|e| anyhow::anyhow!("{e}"))?;
        let program = flatmesh_rules::compile(&config)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        if args.explain && args.admin.is_none() {
            print!("{}", program.explain());
        }
        if let Some(out) = &args.nic_image {
            write_image(&program, out)?;
        }
        println!("{}: ok", path.display());
    }
    if let Some(admin) = args.admin {
        print!("{}", node_rules(admin)?);
    }
    Ok(())
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

/// GET `/rules?format=text` from a node's admin endpoint. A plain HTTP/1.0 exchange with a
/// std socket: the CLI needs one response and no async runtime or client crate for it.
fn node_rules(admin: SocketAddr) -> anyhow::Result<String> {
    let timeout = Duration::from_secs(5);
    let what =
        || format!("asking the node at {admin} for /rules; is it running with `admin: {admin}`?");
    let mut conn = TcpStream::connect_timeout(&admin, timeout).with_context(what)?;
    conn.set_read_timeout(Some(timeout)).with_context(what)?;
    conn.set_write_timeout(Some(timeout)).with_context(what)?;
    write!(
        conn,
        "GET /rules?format=text HTTP/1.0\r\nHost: {admin}\r\n\r\n"
    )
    .with_context(what)?;
    let mut response = Vec::new();
    conn.read_to_end(&mut response).with_context(what)?;
    let response = String::from_utf8_lossy(&response);
    let (head, body) = response.split_once("\r\n\r\n").with_context(|| {
        format!("{admin} sent no HTTP response; is that the node's admin address?")
    })?;
    let status = head.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) != Some("200") {
        anyhow::bail!("{admin} answered `{status}` to /rules; is that the node's admin address?");
    }
    Ok(body.to_string())
}
