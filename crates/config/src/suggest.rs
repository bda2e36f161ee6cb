//! "Did you mean" suggestions by edit distance.

/// The candidate closest to `word`, if it is close enough to be a plausible typo:
/// at most a third of the word's length in edits (at least 1, at most 3), and
/// fewer edits than the word has characters.
pub fn closest<'a, I>(word: &str, candidates: I) -> Option<&'a str>
where
    I: IntoIterator<Item = &'a str>,
{
    let budget = (word.chars().count() / 3).clamp(1, 3);
    let lower = word.to_ascii_lowercase();
    candidates
        .into_iter()
        .map(|c| (strsim::levenshtein(&lower, &c.to_ascii_lowercase()), c))
        // A suggestion must keep something of the word: `d` is no typo of `c`.
        .filter(|(distance, _)| *distance <= budget && *distance < lower.chars().count())
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, c)| c)
}

/// `did you mean `x`? ` or nothing, ready to prefix a hint.
pub fn did_you_mean<'a, I>(word: &str, candidates: I) -> String
where
    I: IntoIterator<Item = &'a str>,
{
    closest(word, candidates)
        .map(|c| format!("did you mean `{c}`? "))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_typos_and_ignores_strangers() {
        let keys = ["cluster", "split", "direct_response", "timeout"];
        assert_eq!(closest("clustr", keys), Some("cluster"));
        assert_eq!(closest("Cluster", keys), Some("cluster"));
        assert_eq!(closest("timeuot", keys), Some("timeout"));
        assert_eq!(closest("banana", keys), None);
        assert_eq!(closest("", keys), None);
        assert_eq!(closest("d", ["c", "db"]), None);
        assert_eq!(closest("ab", ["abc", "b"]), Some("abc"));
        assert_eq!(closest("d", ["c"]), None);
        assert_eq!(did_you_mean("splt", keys), "did you mean `split`? ");
        assert_eq!(did_you_mean("zzz", keys), "");
    }

    #[test]
    fn picks_the_nearest_of_several() {
        let names = ["api", "api-canary", "db"];
        assert_eq!(closest("apii", names), Some("api"));
        assert_eq!(closest("api-canery", names), Some("api-canary"));
    }
}
