//! The ILP baseline of E3 §5.4, solved with good_lp + microlp (pure Rust, small instances only).
//!
//! Binary x[i][n] = instance i on node n, for every (i, n) that pinning and the offload rule allow.
//! Like the paper's ILP its objective puts the highest weight on co-execution interference: minimise
//! the peak node utilisation z, with active energy as a small tie-breaker. Constraints: each instance
//! on exactly one node; cores and memory per node; shared port bandwidth per server; and at most one
//! member of each replica group per server (fault domains).

use good_lp::{
    constraint, microlp, variable, Expression, ProblemVariables, Solution, SolverModel, Variable,
    WithMipGap, WithTimeLimit,
};

use super::State;
use crate::error::{ControlError, Result};
use crate::topology::Topology;
use crate::workload::Workload;

/// Above this many binaries microlp's branch and bound takes minutes or more on this hardware.
pub const MAX_VARIABLES: usize = 5_000;
/// Default wall-clock budget; the best solution found so far is returned when it runs out.
pub const TIME_LIMIT_SECONDS: f64 = 20.0;

pub fn run(topo: &Topology, wl: &Workload, time_limit_seconds: f64) -> Result<Vec<usize>> {
    let mut st = State::new(topo, wl);
    let all: Vec<usize> = (0..wl.instances.len()).collect();
    place_into(&mut st, &all, time_limit_seconds, MAX_VARIABLES)?;
    st.complete()
}

/// Places `targets` (unplaced instances) into the free capacity of `st` by solving the ILP; the
/// load already on each node counts toward its utilisation.
pub fn place_into(
    st: &mut State,
    targets: &[usize],
    time_limit_seconds: f64,
    max_variables: usize,
) -> Result<()> {
    let (topo, wl) = (st.topo, st.wl);
    let pairs: Vec<Vec<usize>> = targets
        .iter()
        .map(|&i| {
            (0..topo.nodes.len())
                .filter(|&n| st.allowed(i, n))
                .collect()
        })
        .collect();
    let nvars: usize = pairs.iter().map(Vec::len).sum();
    if nvars > max_variables {
        return Err(ControlError::TooLarge(format!(
            "the ILP has {nvars} binary variables ({} instances x up to {} nodes), above the {max_variables} that microlp solves in reasonable time; use --algo hcm or --algo anneal for instances this large",
            targets.len(),
            topo.nodes.len()
        )));
    }
    for (t, p) in pairs.iter().enumerate() {
        if p.is_empty() {
            return Err(st.no_fit(targets[t]));
        }
    }
    let mut vars = ProblemVariables::new();
    let x: Vec<Vec<Variable>> = pairs
        .iter()
        .map(|p| p.iter().map(|_| vars.add(variable().binary())).collect())
        .collect();
    let z = vars.add(variable().min(0.0).max(1.0));
    // Energy tie-breaker, scaled so it can never outweigh a 1% change in peak utilisation.
    let energy = |i: usize, n: usize| {
        let inst = &wl.instances[i];
        inst.rps * inst.joules_on(topo.nodes[n].core)
    };
    let e_max: f64 = pairs
        .iter()
        .enumerate()
        .map(|(t, p)| p.iter().map(|&n| energy(targets[t], n)).fold(0.0, f64::max))
        .sum::<f64>()
        .max(1e-12);
    let mut objective: Expression = z.into();
    for (t, p) in pairs.iter().enumerate() {
        for (k, &n) in p.iter().enumerate() {
            objective += (0.01 * energy(targets[t], n) / e_max) * x[t][k];
        }
    }
    let mut model = vars
        .minimise(objective)
        .using(microlp)
        .with_time_limit(time_limit_seconds)
        .with_mip_gap(0.01)
        .map_err(|e| ControlError::Solver(e.to_string()))?;
    let mut cores: Vec<Expression> = vec![Expression::from(0.0); topo.nodes.len()];
    let mut mem: Vec<Expression> = vec![Expression::from(0.0); topo.nodes.len()];
    let mut bw: Vec<Expression> = vec![Expression::from(0.0); topo.servers.len()];
    let mut touched = vec![false; topo.nodes.len()];
    let mut touched_server = vec![false; topo.servers.len()];
    let mut group_server: std::collections::HashMap<(usize, usize), Expression> =
        Default::default();
    for (t, p) in pairs.iter().enumerate() {
        let i = targets[t];
        let inst = &wl.instances[i];
        let mut one = Expression::from(0.0);
        for (k, &n) in p.iter().enumerate() {
            let node = &topo.nodes[n];
            touched[n] = true;
            touched_server[node.server] = true;
            one += x[t][k];
            cores[n] += inst.cores_on(node.core) * x[t][k];
            mem[n] += (inst.memory_mb as f64) * x[t][k];
            bw[node.server] += inst.bandwidth_gbps * x[t][k];
            if !wl.replicas[inst.replica_of.unwrap_or(i)].is_empty() {
                *group_server.entry((inst.group, node.server)).or_default() += x[t][k];
            }
        }
        model = model.with(constraint!(one == 1.0));
    }
    for (n, node) in topo.nodes.iter().enumerate() {
        if !touched[n] {
            continue;
        }
        let c = std::mem::take(&mut cores[n]) + st.cores_used[n];
        model = model.with(constraint!(c.clone() <= node.cores));
        model = model.with(constraint!(c <= node.cores * z));
        let m = std::mem::take(&mut mem[n]) + st.mem_used[n] as f64;
        model = model.with(constraint!(m <= node.memory_mb as f64));
    }
    for (s, server) in topo.servers.iter().enumerate() {
        if touched_server[s] {
            let b = std::mem::take(&mut bw[s]);
            model = model.with(constraint!(b + st.bw_used[s] <= server.bandwidth_gbps));
        }
    }
    for (_, e) in group_server {
        model = model.with(constraint!(e <= 1.0));
    }
    let sol = model
        .solve()
        .map_err(|e| ControlError::Solver(e.to_string()))?;
    for (t, p) in pairs.iter().enumerate() {
        // The chosen node is the binary closest to 1 (microlp returns 0/1 up to rounding).
        let k = (0..p.len())
            .max_by(|&a, &b| sol.value(x[t][a]).total_cmp(&sol.value(x[t][b])))
            .unwrap_or(0);
        // A solution cut short by the time limit may not be integral: never place what does not
        // fit. (The check runs in solution order, so it also sees what was placed before.)
        if sol.value(x[t][k]) < 0.5 || !st.fits(targets[t], p[k]) {
            return Err(ControlError::Solver(format!(
                "the solver stopped without a usable assignment for {} (time limit {time_limit_seconds} s)",
                wl.instances[targets[t]].id
            )));
        }
        st.place(targets[t], p[k]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::run;
    use crate::placement::tests::setup;
    use crate::placement::{place, verify, Algorithm};

    #[test]
    fn ilp_places_a_small_app_validly() {
        let (topo, mut wl) = setup("preset:3xType1-SmartNIC", "preset:NFV-DIN");
        let assign = run(&topo, &wl, 2.0).unwrap();
        verify(&topo, &wl, &assign).unwrap();
        // Make it too large: many copies of the app.
        let mut app = crate::model::load_app("preset:IOT-DH").unwrap();
        for k in 0..60 {
            app.name = format!("IOT-DH#{k}");
            wl.add_app(&app, 0.01).unwrap();
        }
        let err = place(&topo, &wl, Algorithm::Ilp, 0)
            .unwrap_err()
            .to_string();
        assert!(err.contains("use --algo hcm"), "{err}");
    }
}
