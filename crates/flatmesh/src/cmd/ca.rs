//! `flatmesh ca`: the mesh's certificate authority on disk (crates/identity).

use anyhow::{Context, Result};
use clap::{Args as ClapArgs, Subcommand};
use flatmesh_identity::{ca, crl, Authority, SpiffeId};
use std::path::PathBuf;

#[derive(ClapArgs)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create a root for a trust domain: DIR/ca.pem (trust bundle) and DIR/ca.key (mode 0600).
    Init {
        /// The trust domain, e.g. `cluster.local` (lower-case letters, digits, `.`, `-`, `_`).
        #[arg(long)]
        trust_domain: String,
        /// Where to write the CA (created if missing; an existing CA is never overwritten).
        #[arg(long)]
        dir: PathBuf,
    },
    /// Issue an X.509 SVID: PREFIX.pem (leaf then chain) and PREFIX.key (mode 0600).
    Issue {
        /// The CA directory written by `ca init`.
        #[arg(long)]
        dir: PathBuf,
        /// The SPIFFE ID, e.g. spiffe://cluster.local/ns/shop/sa/cart.
        #[arg(long)]
        id: String,
        /// Output prefix: writes PREFIX.pem and PREFIX.key.
        #[arg(long)]
        out: PathBuf,
        /// Lifetime, like `24h`, `90m` (1 minute to 1 year).
        #[arg(long, default_value = "24h")]
        ttl: String,
    },
    /// Make a new root the signer and keep the old one trusted (overlap); run `retire` once
    /// every certificate of the old root has been reissued.
    Rotate {
        #[arg(long)]
        dir: PathBuf,
    },
    /// Drop the roots kept from before a rotation.
    Retire {
        #[arg(long)]
        dir: PathBuf,
    },
    /// Make a bootstrap token for a node: prints the token (give it to the node, as the file of
    /// `flatmesh node --bootstrap-token`) and the entry for `flatmesh control --node-tokens`
    /// (which keeps only its SHA-256).
    ///
    /// With --revoke --tokens FILE: cut the node off instead. Its entry in the node tokens file
    /// gets `revoked: true`; the running control center re-reads the file within a second,
    /// refuses the token (UNAUTHENTICATED, "token revoked") and ends the node's xDS streams.
    Token {
        /// The node's id, as the cluster (or the placement) names it.
        #[arg(long)]
        node: String,
        /// Revoke the node's token in --tokens FILE instead of making one.
        #[arg(long, requires = "tokens")]
        revoke: bool,
        /// The control center's node tokens file (`flatmesh control --node-tokens`).
        #[arg(long, value_name = "FILE", requires = "revoke")]
        tokens: Option<PathBuf>,
    },
    /// Revoke certificates: list them in DIR/crl.pem, a CRL signed by the signing root (at most
    /// 10 000 entries; listing one twice changes nothing). With neither --serial nor --cert it
    /// only re-signs the list (its next update is 7 days ahead: re-sign before then). Nodes
    /// check it where a listener's or cluster's `tls.crl` names it (docs/security.md, "Revocation").
    Revoke {
        /// The CA directory written by `ca init`.
        #[arg(long)]
        dir: PathBuf,
        /// The certificate's serial number in hex (`openssl x509 -serial` prints it); repeatable.
        #[arg(long, value_name = "HEX")]
        serial: Vec<String>,
        /// A certificate file (PEM; its first certificate is revoked); repeatable.
        #[arg(long, value_name = "FILE")]
        cert: Vec<PathBuf>,
    },
}

pub fn run(args: Args) -> Result<()> {
    match args.command {
        Command::Init { trust_domain, dir } => {
            let authority = Authority::init(&trust_domain, &dir)?;
            println!(
                "created the root of trust domain `{}`: {} (trust bundle), {} (private key, 0600)",
                authority.trust_domain(),
                dir.join(ca::CERT_FILE).display(),
                dir.join(ca::KEY_FILE).display()
            );
        }
        Command::Issue { dir, id, out, ttl } => {
            let ttl = flatmesh_config::duration::parse(&ttl)
                .map_err(anyhow::Error::msg)
                .context("--ttl")?;
            let id = SpiffeId::parse(&id)?;
            let authority = Authority::load(&dir)?;
            let issued = authority.issue(&id, ttl)?;
            issued.write(&out)?;
            let hours = issued
                .not_after
                .duration_since(std::time::SystemTime::now())
                .unwrap_or_default()
                .as_secs_f64()
                / 3600.0;
            println!(
                "issued {id}: {0}.pem (leaf then chain), {0}.key (0600), valid for {hours:.1} h",
                out.display()
            );
        }
        Command::Rotate { dir } => {
            let mut authority = Authority::load(&dir)?;
            authority.rotate(Some(&dir))?;
            println!(
                "new signing root for `{}`; {} now holds {} roots (the old ones stay trusted until `flatmesh ca retire`)",
                authority.trust_domain(),
                dir.join(ca::CERT_FILE).display(),
                authority.bundle().len()
            );
        }
        Command::Token {
            node,
            revoke: true,
            tokens: Some(tokens),
        } => {
            if flatmesh_control::serve::ca::revoke_token(&tokens, &node)? {
                println!(
                    "revoked the token of `{node}` in {}: a running control center refuses it within a second and ends its streams",
                    tokens.display()
                );
            } else {
                println!("the token of `{node}` was revoked already; nothing changed");
            }
        }
        Command::Revoke { dir, serial, cert } => {
            let authority = Authority::load(&dir)?;
            let mut serials = serial
                .iter()
                .map(|s| crl::parse_serial(s))
                .collect::<Result<Vec<_>, _>>()?;
            for path in &cert {
                let leaf = ca::load_certificates(path)?.swap_remove(0);
                let (by_signer, serial) = authority.issued_by_signer(&leaf)?;
                anyhow::ensure!(
                    by_signer,
                    "{}: not issued by the signing root of {} (a root kept from before a rotation, or another CA): only a root's own key can sign its CRL; revoke it before rotating, or retire the old root (`flatmesh ca retire`)",
                    path.display(),
                    dir.display()
                );
                serials.push(serial);
            }
            let done = authority.revoke(&dir, &serials)?;
            for serial in &serials {
                println!("serial {}", crl::serial_hex(serial));
            }
            println!(
                "{}: {} newly revoked, {} listed; next update in {} days (re-sign with `flatmesh ca revoke --dir {}` before then); nodes apply it at their next reload",
                done.path.display(),
                done.added,
                done.listed,
                crl::CRL_LIFETIME.as_secs() / 86400,
                dir.display()
            );
        }
        Command::Token { node, .. } => {
            let token = flatmesh_control::serve::ca::new_token()?;
            let digest = flatmesh_control::serve::ca::token_digest_hex(&token);
            println!("# the node's token (flatmesh node --bootstrap-token FILE; keep it secret):");
            println!("{token}");
            println!("# its entry in the control center's node tokens file (mode 0600):");
            println!("{node:?}: {{ token_sha256: {digest}, identities: [] }}");
        }
        Command::Retire { dir } => {
            let mut authority = Authority::load(&dir)?;
            authority.retire_old_roots(Some(&dir))?;
            println!(
                "{} now holds only the signing root",
                dir.join(ca::CERT_FILE).display()
            );
        }
    }
    Ok(())
}
