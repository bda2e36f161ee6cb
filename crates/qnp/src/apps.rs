//! The example applications' messages, generated from `examples/idl/*.qnp` by
//! `flatmesh qnp idl compile` and checked in (a test fails when they are stale). Their services
//! (the RocksDB key-value GET service, PingPong) are in the lab (`flatmesh_lab::qnp::services`).

#[rustfmt::skip]
pub mod kv;
#[rustfmt::skip]
pub mod pingpong;
