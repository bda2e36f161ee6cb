//! The whole demo, end to end: built-in services, the real in-process node proxy with the
//! built-in config, load, report. Short duration: this checks behaviour, not speed.

use std::time::Duration;

use flatmesh_lab::demo::{run, Options};

#[test]
fn demo_runs_clean_through_the_node_proxy() -> Result<(), flatmesh_lab::LabError> {
    let report = run(&Options {
        duration: Duration::from_secs(2),
        connections: 4,
        progress: false,
    })?;
    println!("{report}");
    let problems = report.problems();
    assert!(problems.is_empty(), "{problems:#?}\n{report}");

    let names: Vec<_> = report.http.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["api", "items-split", "healthz", "no-route"]);
    for row in &report.http {
        assert!(row.requests > 0 && row.p50.is_some(), "{report}");
    }
    // The split route really reached the h2c canary, and round robin reached both api backends.
    let text = report.to_string();
    assert!(text.contains("canary"), "{text}");
    let tcp = report
        .tcp
        .as_ref()
        .ok_or_else(|| flatmesh_lab::LabError::Internal("the report has no TCP row".into()))?;
    assert!(tcp.requests > 10 && tcp.errors == 0, "{report}");
    // The mTLS part: every caller got what its identity should get (checked by problems()
    // above), and the four of them are in the report with their identities.
    let callers: Vec<_> = report.mtls.iter().map(|r| r.caller).collect();
    assert_eq!(callers, ["frontend", "intruder", "stranger", "anonymous"]);
    assert!(report.mtls.iter().all(|r| r.ok), "{report}");
    assert_eq!(report.mtls[1].got, "403", "{report}");
    assert!(
        text.contains("spiffe://demo.local/ns/shop/sa/intruder"),
        "{text}"
    );
    Ok(())
}
