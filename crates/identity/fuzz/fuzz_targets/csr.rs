//! The CA's CSR handler on any bytes (PEM or DER): it refuses with an error, or signs a
//! certificate for exactly one SPIFFE ID of its own trust domain; it never panics.
#![no_main]

use flatmesh_identity::{svid::CertificateInfo, Authority};
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use std::time::Duration;

fn authority() -> &'static Authority {
    static CA: OnceLock<Authority> = OnceLock::new();
    CA.get_or_init(|| Authority::generate("fuzz.example").expect("a root"))
}

fuzz_target!(|data: &[u8]| {
    let ca = authority();
    if let Ok(issued) = ca.sign_csr(data, Duration::from_secs(3600), |_| Ok(())) {
        assert_eq!(issued.id.trust_domain(), "fuzz.example");
        let chain = flatmesh_identity::ca::certificates_from_pem(issued.chain_pem.as_bytes())
            .expect("the CA writes valid PEM");
        let leaf = CertificateInfo::parse(&chain[0]).expect("the CA writes valid X.509");
        assert_eq!(leaf.spiffe_id, Some(issued.id));
        assert!(!leaf.is_ca);
    }
});
