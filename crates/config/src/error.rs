//! The crate's error: a file that cannot be read, or a list of diagnostics.

use std::fmt;
use std::path::PathBuf;

/// One problem in a config file: where, what, and what to do about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    /// The file name (or other origin) given to [`crate::parse`].
    pub origin: String,
    /// 1-based line.
    pub line: usize,
    /// 1-based column, counted in characters.
    pub column: usize,
    /// What is wrong.
    pub message: String,
    /// What to do about it.
    pub hint: String,
}

impl fmt::Display for Diagnostic {
    /// `web.yaml:12:9: message` then `  hint: ...` on the next line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}\n  hint: {}",
            self.origin, self.line, self.column, self.message, self.hint
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read at all.
    #[error("cannot read config file {}: {source}; check that the path is right and readable", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The text was read but is not a valid config. Holds every problem found.
    #[error("{}", DisplayAll(diagnostics))]
    Invalid { diagnostics: Vec<Diagnostic> },
}

impl ConfigError {
    /// Every diagnostic, in file order. Empty for [`ConfigError::Read`].
    pub fn diagnostics(&self) -> &[Diagnostic] {
        match self {
            ConfigError::Read { .. } => &[],
            ConfigError::Invalid { diagnostics } => diagnostics,
        }
    }

    /// The first diagnostic, if any (handy in tests).
    pub fn first(&self) -> Option<&Diagnostic> {
        self.diagnostics().first()
    }
}

struct DisplayAll<'a>(&'a [Diagnostic]);

impl fmt::Display for DisplayAll<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{d}")?;
        }
        Ok(())
    }
}
