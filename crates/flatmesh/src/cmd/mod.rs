//! One module per subcommand.

pub mod check;
pub mod demo;
pub mod node;
