//! `flatmesh check --config FILE [--explain] [--nic-image OUT]`: validate a config, print its
//! rule program, write tier N's image. `flatmesh check --explain --admin ADDR`: the program a
//! running node runs, with the tiers it actually has.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

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
        if args.explain && args.admin.is_none() {
            print!("{}", program.explain());
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
fn node_rules(admin: &AdminAddress, token: Option<&str>) -> anyhow::Result<String> {
    let timeout = Duration::from_secs(5);
    let what =
        || format!("asking the node at {admin} for /rules; is it running with `admin: {admin}`?");
    let (mut conn, host): (Box<dyn ReadWrite>, String) = match admin {
        AdminAddress::Tcp(addr) => {
            let conn = TcpStream::connect_timeout(addr, timeout).with_context(what)?;
            conn.set_read_timeout(Some(timeout)).with_context(what)?;
            conn.set_write_timeout(Some(timeout)).with_context(what)?;
            (Box::new(conn), addr.to_string())
        }
        AdminAddress::Unix(path) => {
            let conn = UnixStream::connect(path).with_context(what)?;
            conn.set_read_timeout(Some(timeout)).with_context(what)?;
            conn.set_write_timeout(Some(timeout)).with_context(what)?;
            (Box::new(conn), "localhost".to_string())
        }
    };
    let authorization = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(
        conn,
        "GET /rules?format=text HTTP/1.0\r\nHost: {host}\r\n{authorization}\r\n"
    )
    .with_context(what)?;
    let mut response = Vec::new();
    conn.read_to_end(&mut response).with_context(what)?;
    let response = String::from_utf8_lossy(&response);
    let (head, body) = response.split_once("\r\n\r\n").with_context(|| {
        format!("{admin} sent no HTTP response; is that the node's admin address?")
    })?;
    let status = head.lines().next().unwrap_or_default();
    match status.split_whitespace().nth(1) {
        Some("200") => Ok(body.to_string()),
        Some("401") if token.is_none() => anyhow::bail!(
            "{admin} needs the admin token; pass --admin-token-file FILE (the node's admin.token_file)"
        ),
        Some("401") => anyhow::bail!(
            "{admin} refused the admin token; check that --admin-token-file holds the node's current token"
        ),
        _ => anyhow::bail!(
            "{admin} answered `{status}` to /rules; is that the node's admin address?"
        ),
    }
}

/// A connected byte stream, TCP or Unix.
trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}
