//! Arbitrary bytes → `SplitConfig::parse` never panics; an accepted config yields a topology
//! whose names fit Linux's limits and whose rules render.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(config) = flatmesh_pu::SplitConfig::parse(&text, "fuzz.yaml") {
        let topo = flatmesh_pu::Topology::new(&config);
        for pu in 0..topo.pus.len() {
            for link in topo.links(pu) {
                assert!(link.ifname.len() <= 15, "{}", link.ifname);
            }
            let desired = flatmesh_pu::rules::Desired {
                remote: Default::default(),
                proxy_owner: vec![Some(pu); config.intercept.len()],
            };
            let _ = flatmesh_pu::rules::full_script(&topo, pu, &config.intercept, &desired);
        }
    }
});
