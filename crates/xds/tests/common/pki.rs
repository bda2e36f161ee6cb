//! Certificates from flatmesh's CA for the Envoy interop tests, and flatmesh control serving
//! a config to an Envoy that follows it over ADS.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use flatmesh_config as model;
use flatmesh_identity::{Authority, SpiffeId};
use flatmesh_xds::server::Store;

use super::{envoy, XdsServer};

/// The CA's bundle (`ca.pem`) and one `NAME.pem`/`NAME.key` pair per identity, in `dir`.
pub struct Pki {
    pub ca: Authority,
    pub dir: PathBuf,
}

impl Pki {
    pub fn new(test: &str) -> Pki {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("pki-{test}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let ca = Authority::generate("td").unwrap();
        std::fs::write(dir.join("ca.pem"), ca.bundle_pem()).unwrap();
        Pki { ca, dir }
    }

    pub fn ca_file(&self) -> String {
        self.dir.join("ca.pem").display().to_string()
    }

    /// Issues `id` as `NAME.pem` and `NAME.key`; returns the path prefix.
    pub fn issue(&self, name: &str, id: &str) -> String {
        let prefix = self.dir.join(name);
        self.ca
            .issue(&SpiffeId::parse(id).unwrap(), Duration::from_secs(3600))
            .unwrap()
            .write(&prefix)
            .unwrap();
        prefix.display().to_string()
    }
}

/// flatmesh control serving `config` to an Envoy that follows it over ADS.
pub struct Control {
    pub store: Store,
    _server: XdsServer,
    _envoy: envoy::Envoy,
}

impl Control {
    pub fn start(config: &model::Config, envoy_admin: SocketAddr, dir: &Path) -> Control {
        let store = Store::new();
        store.publish_config(config);
        let server = XdsServer::start(&store, "127.0.0.1:0".parse().unwrap());
        let envoy = envoy::follow(server.addr, false, envoy_admin, dir);
        Control {
            store,
            _server: server,
            _envoy: envoy,
        }
    }

    pub fn assert_no_nacks(&self) {
        assert!(
            self.store.nacks().is_empty(),
            "Envoy refused the resources: {:?}",
            self.store.nacks()
        );
    }
}
