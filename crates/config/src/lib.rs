//! flatmesh configuration plane, first stage: YAML → validated [`Config`].
//!
//! [`parse`] reads YAML with serde_norway (unknown keys rejected), then validates
//! the model. Every problem becomes a [`Diagnostic`] with `file:line:column`, what
//! is wrong and what to do. Positions for validation problems come from a
//! [`locate::LocationIndex`] built over the same text.
#![forbid(unsafe_code)]

pub mod admin;
pub mod cidr;
mod decode;
pub mod destination;
pub mod duration;
pub mod endpoints;
pub mod error;
pub mod load_report;
pub mod locate;
pub mod model;
pub mod suggest;
pub mod validate;

use std::path::Path;

pub use cidr::Cidr;
pub use endpoints::{Endpoint, Endpoints};
pub use error::{ConfigError, Diagnostic};
pub use model::*;

use locate::{LocationIndex, Position};

/// Parse and validate a config. `origin` names the text in diagnostics (usually the file name).
pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
    let index = LocationIndex::build(text);
    if index.is_blank() {
        return Err(ConfigError::Invalid {
            diagnostics: vec![diagnostic(
                origin,
                Position::START,
                "config is empty: it needs at least one listener".into(),
                "start with a `listeners:` list and the `clusters:` they send to; docs/config.md has a full example".into(),
            )],
        });
    }
    let config = decode::decode(text, origin, &index).map_err(|d| ConfigError::Invalid {
        diagnostics: vec![d],
    })?;

    let mut diagnostics: Vec<Diagnostic> = validate::validate(&config)
        .into_iter()
        .map(|problem| {
            let at = index.find(&problem.path, problem.target);
            let mut hint = problem.hint;
            if let Some(first) = problem
                .first
                .as_deref()
                .and_then(|p| index.get(p, locate::Target::Value))
            {
                hint.push_str(&format!(
                    " (the first is at line {}, column {})",
                    first.line, first.column
                ));
            }
            diagnostic(origin, at, problem.message, hint)
        })
        .collect();
    if diagnostics.is_empty() {
        return Ok(config);
    }
    // File order reads best; the sort is stable, so problems at one spot keep their order.
    diagnostics.sort_by_key(|d| (d.line, d.column));
    Err(ConfigError::Invalid { diagnostics })
}

/// Read and parse a config file; diagnostics name the file as given.
pub fn load(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&text, &path.display().to_string())
}

fn diagnostic(origin: &str, at: Position, message: String, hint: String) -> Diagnostic {
    Diagnostic {
        origin: origin.to_string(),
        line: at.line,
        column: at.column,
        message,
        hint,
    }
}

#[cfg(test)]
mod tests;
