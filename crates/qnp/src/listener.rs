//! A node's `qnp` listener (`flatmesh_config::QnpListener`, docs/qnp.md, "QNP in the node"):
//! its rules read, parsed and checked against its workers and the Matcher's tables, once, for
//! the node (at load and at every reload) and for `flatmesh check`.

use crate::dispatch::check_queues;
use crate::image::Image;
use crate::rules::RuleSet;
use crate::QnpError;
use flatmesh_config::{QnpListener, QNP_MAX_RULES_BYTES};
use std::io::Read as _;

/// A `qnp` listener's rules, checked: they parse, send only to listed workers, and fit the
/// Matcher's image, which is compiled here (the kernel dispatcher and `check --explain` use it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerRules {
    pub rules: RuleSet,
    pub image: Image,
}

/// Reads (`rules` or `rules_file`), parses and checks the rules of listener `name`.
pub fn compile(name: &str, listener: &QnpListener) -> Result<ListenerRules, QnpError> {
    let (label, text) = match (&listener.rules, &listener.rules_file) {
        (Some(text), _) => (format!("listener `{name}` qnp.rules"), text.clone()),
        (None, Some(path)) => (path.display().to_string(), read_bounded(name, path)?),
        (None, None) => {
            return Err(QnpError::Config(format!(
                "listener `{name}` has no qnp rules; add `qnp.rules` or `qnp.rules_file`"
            )))
        }
    };
    if text.len() > QNP_MAX_RULES_BYTES {
        return Err(QnpError::Config(format!(
            "{label}: the rules are more than {QNP_MAX_RULES_BYTES} bytes; the Matcher's tables hold 512 entries, keep the rules far shorter"
        )));
    }
    let rules = RuleSet::parse(&label, &text)?;
    check_queues(&label, &rules, listener.workers.len())?;
    let image = Image::compile(&rules).map_err(|e| match QnpError::from(e) {
        QnpError::TableFull(msg) => QnpError::TableFull(format!("{label}: {msg}")),
        other => other,
    })?;
    Ok(ListenerRules { rules, image })
}

/// The file's text, refused past [`QNP_MAX_RULES_BYTES`] without reading more of it.
fn read_bounded(name: &str, path: &std::path::Path) -> Result<String, QnpError> {
    let what = || {
        format!(
            "reading qnp.rules_file {} of listener `{name}`; check the path and that the node's user may read it",
            path.display()
        )
    };
    let file = std::fs::File::open(path).map_err(|e| QnpError::io(what(), e))?;
    let mut text = String::new();
    file.take(QNP_MAX_RULES_BYTES as u64 + 1)
        .read_to_string(&mut text)
        .map_err(|e| QnpError::io(what(), e))?;
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn listener(rules: &str, workers: usize) -> QnpListener {
        QnpListener {
            workers: (0..workers)
                .map(|w| std::net::SocketAddr::from(([127, 0, 0, 1], 7001 + w as u16)))
                .collect(),
            rules: Some(rules.to_owned()),
            rules_file: None,
            idle_timeout: Duration::from_secs(60),
            max_sessions: 16,
        }
    }

    #[test]
    fn compiles_rules_that_fit_and_name_listed_workers() {
        let r = compile(
            "kv",
            &listener("rule 1 0 0 \"a\" -> 1\ndefault 1 0 -> 0\n", 2),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.rules.rules.len(), 1);
        assert_eq!(
            r.image,
            Image::compile(&r.rules).unwrap_or_else(|e| panic!("{e}"))
        );
    }

    #[test]
    fn refuses_bad_rules_unknown_workers_and_full_tables_with_the_line() {
        let e = compile("kv", &listener("rule 1 0 0 a -> 1\n", 2)).unwrap_err();
        assert!(
            e.to_string().starts_with("listener `kv` qnp.rules:1: "),
            "{e}"
        );
        let e = compile("kv", &listener("\nrule 1 0 0 \"a\" -> 2\n", 2)).unwrap_err();
        assert!(e.to_string().contains("qnp.rules:2: "), "{e}");
        assert!(e.to_string().contains("queue 2"), "{e}");
        let many: String = (0..600)
            .map(|i| format!("rule 1 {} 0 \"{i:03}.x\" -> 0\n", i % 60))
            .collect();
        let e = compile("kv", &listener(&many, 1)).unwrap_err();
        assert!(matches!(e, QnpError::TableFull(_)), "{e}");
        assert!(e.to_string().contains("entries over"), "{e}");
    }

    #[test]
    fn reads_a_rule_file_and_says_which_one_is_missing() {
        let dir = std::env::temp_dir().join(format!("qnp-listener-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        let path = dir.join("kv.rules");
        std::fs::write(&path, "default 1 0 -> 0\n").unwrap_or_else(|e| panic!("{e}"));
        let mut l = listener("", 1);
        l.rules = None;
        l.rules_file = Some(path.clone());
        assert!(compile("kv", &l).is_ok());
        std::fs::write(&path, "#".repeat(QNP_MAX_RULES_BYTES + 1))
            .unwrap_or_else(|e| panic!("{e}"));
        let e = compile("kv", &l).unwrap_err();
        assert!(e.to_string().contains("more than"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        let e = compile("kv", &l).unwrap_err();
        assert!(e.to_string().contains("kv.rules of listener `kv`"), "{e}");
    }
}
