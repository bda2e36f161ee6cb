//! QingNiao (papers/002) for flatmesh: a request protocol co-designed with its dispatcher so that an
//! L7 dispatch decision needs only the first packet of a request.
//!
//! - [`tlv`]: the on-wire field encoding (docs/qnp.md) and [`QnpMessage`], the trait generated code implements.
//! - [`idl`]: the IDL parser and the Rust code generator (`flatmesh qnp idl compile`).
//! - [`header`]: the QNP packet header, exactly Fig. 11.
//! - [`transport`]: reliable request delivery over UDP (segmentation, per-request ACKs, retransmit).
//! - [`rules`]: skip-and-check dispatch rules: file parser, plain semantics, fast matcher.
//! - [`image`]: the Matcher's RAM/CAM tables (§4.2.2), compiler and bit-exact reference executor
//!   (shared with tier N of the rule program: `flatmesh_rules::image`), and `rules eval` inputs.
//! - [`kernel_rsd`]: the sk_reuseport eBPF dispatcher and the lowering of rules into its maps.
//! - [`dispatch`]: receive-side dispatch across per-core shared-nothing workers.
//! - [`listener`]: the rules of a node's `qnp` listener, read and checked (crates/proxy runs it).
//! - [`cpu`]: pinning threads to CPUs.
//! - [`apps`]: generated messages of the example applications.
//!
//! The demo, the dispatch benchmark, the load generators and the example applications' services
//! (the RocksDB key-value store among them) are lab code: `flatmesh_lab::qnp`.

pub mod apps;
pub mod cpu;
pub mod dispatch;
pub mod error;
pub mod header;
pub mod idl;
pub mod image;
pub mod kernel_rsd;
pub mod listener;
pub mod rules;
pub mod tlv;
pub mod transport;

// Generated code names this crate `flatmesh_qnp`, also when it is compiled inside it (apps).
extern crate self as flatmesh_qnp;

pub use error::QnpError;
pub use tlv::QnpMessage;
