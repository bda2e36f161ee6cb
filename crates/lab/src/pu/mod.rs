//! Split network namespaces across processing units (`flatmesh_pu`) shown and measured.
//!
//! - [`demo`]: `flatmesh pu demo`, one pod split over two emulated PUs, as a table of calls.
//! - [`bench`]: `flatmesh pu bench`, the mapping cost and the rule update time.
//! - [`echo`]: the line server that plays the app on a PU.
//! - [`mesh`]: `flatmesh pu demo --mesh`, HeteroK8s-Mesh-All: the node proxy on the host or
//!   the DPU, over veth or shared memory, measured side by side.

pub mod bench;
pub mod demo;
pub mod echo;
pub mod mesh;
