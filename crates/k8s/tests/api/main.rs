//! The tests against a real API server, one test binary: each file below used to be its own,
//! and each linked kube-rs and k8s-openapi anew (2-3 minutes of the CI build apiece). Each
//! test starts its own kube-apiserver and etcd (`common::TestEnv`), and `TestEnv` runs them
//! one at a time, as separate binaries did: their deadlines (a change within a second) assume
//! the machine's two cores are theirs.
//!
//! `cargo test --release -p flatmesh-k8s --test api k8s_control` runs one file's test.

mod common;
mod k8s_control;
mod k8s_identities;
mod k8s_install;
mod k8s_orchestrate;
mod k8s_restart;
mod k8s_schedule;
mod k8s_traffic;
