//! Weighted split: pick a cluster with probability weight / total.

use crate::ClusterId;

/// Clusters with weights, stored as cumulative upper bounds so a pick is one binary search.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightedSplit {
    /// `(cluster, weight)` as configured, for explain/JSON and lowerings.
    entries: Vec<(ClusterId, u32)>,
    /// `bounds[i]` = sum of weights `0..=i`.
    bounds: Vec<u64>,
}

impl WeightedSplit {
    /// The largest total weight: `pick` maps a 32-bit random onto `0..total` by multiply-shift.
    pub const MAX_TOTAL: u64 = u32::MAX as u64;

    /// `None` if the total weight is 0 or above [`Self::MAX_TOTAL`].
    pub fn new(entries: Vec<(ClusterId, u32)>) -> Option<WeightedSplit> {
        let mut total = 0u64;
        let bounds = entries
            .iter()
            .map(|(_, w)| {
                total += u64::from(*w);
                total
            })
            .collect();
        if total == 0 || total > Self::MAX_TOTAL {
            return None;
        }
        Some(WeightedSplit { entries, bounds })
    }

    pub fn entries(&self) -> &[(ClusterId, u32)] {
        &self.entries
    }

    pub fn total(&self) -> u64 {
        self.bounds.last().copied().unwrap_or(0)
    }

    /// Pick a cluster from a uniform 32-bit random number.
    ///
    /// `slot = random * total / 2^32` (multiply-shift: no division, no modulo bias beyond one
    /// part in 2^32 / total). Every slot in `0..total` is hit by either floor or ceil of
    /// `2^32 / total` randoms, so cluster i gets weight_i / total of the random space ± weight_i.
    pub fn pick(&self, random: u32) -> ClusterId {
        let slot = (u64::from(random) * self.total()) >> 32;
        // First bound strictly above the slot. `slot < total` so one always exists.
        let i = self.bounds.partition_point(|&b| b <= slot);
        self.entries[i.min(self.entries.len() - 1)].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Exact number of 32-bit randoms that pick each entry, computed from the slot boundaries
    /// (the smallest random reaching slot s is ceil(s * 2^32 / total)) and checked by probing
    /// `pick` on both sides of every boundary. This covers all 2^32 inputs without looping over them.
    fn exact_shares(split: &WeightedSplit) -> Vec<u64> {
        let total = split.total();
        let first_random = |slot: u64| -> u64 { (slot << 32).div_ceil(total) };
        let mut shares = Vec::new();
        let mut lower = 0u64;
        for (i, &bound) in split.bounds.iter().enumerate() {
            let (start, end) = (first_random(lower), first_random(bound));
            if end > start {
                assert_eq!(split.pick(start as u32), split.entries[i].0);
                assert_eq!(split.pick((end - 1) as u32), split.entries[i].0);
                if start > 0 {
                    assert_ne!(
                        split.pick((start - 1) as u32),
                        split.entries[i].0,
                        "entry {i} starts late"
                    );
                }
                if end <= u64::from(u32::MAX) {
                    assert_ne!(
                        split.pick(end as u32),
                        split.entries[i].0,
                        "entry {i} ends late"
                    );
                }
            }
            shares.push(end - start);
            lower = bound;
        }
        assert_eq!(shares.iter().sum::<u64>(), 1 << 32);
        shares
    }

    #[test]
    fn ninety_ten_is_exact() {
        let split = WeightedSplit::new(vec![(0, 90), (1, 10)]).unwrap();
        let shares = exact_shares(&split);
        let space = (1u64 << 32) as f64;
        assert!((shares[0] as f64 / space - 0.9).abs() < 1e-8);
        assert!((shares[1] as f64 / space - 0.1).abs() < 1e-8);
    }

    #[test]
    fn shares_are_within_one_slot_of_ideal() {
        for weights in [
            vec![1, 1],
            vec![1, 2, 3],
            vec![7, 0, 5],
            vec![1, 999_999],
            vec![u32::MAX - 3, 3],
            vec![3; 17],
        ] {
            let entries: Vec<_> = weights.iter().enumerate().map(|(i, w)| (i, *w)).collect();
            let split = WeightedSplit::new(entries).unwrap();
            let total = split.total() as f64;
            let shares = exact_shares(&split);
            for (share, w) in shares.iter().zip(&weights) {
                let ideal = f64::from(*w) / total * (1u64 << 32) as f64;
                assert!(
                    (*share as f64 - ideal).abs() <= f64::from(*w) + 1.0,
                    "{weights:?}: {share} vs {ideal}"
                );
            }
        }
    }

    #[test]
    fn zero_weight_is_never_picked_and_evenly_spaced_sample_agrees() {
        let split = WeightedSplit::new(vec![(4, 0), (5, 3), (6, 0), (7, 1)]).unwrap();
        let mut counts = [0u32; 8];
        for i in 0..(1u32 << 16) {
            counts[split.pick(i << 16)] += 1;
        }
        assert_eq!(counts[4], 0);
        assert_eq!(counts[6], 0);
        assert_eq!(counts[5], 3 << 14);
        assert_eq!(counts[7], 1 << 14);
        assert_eq!(split.pick(0), 5);
        assert_eq!(split.pick(u32::MAX), 7);
    }

    #[test]
    fn bad_totals_are_refused() {
        assert!(WeightedSplit::new(vec![]).is_none());
        assert!(WeightedSplit::new(vec![(0, 0), (1, 0)]).is_none());
        assert!(WeightedSplit::new(vec![(0, u32::MAX), (1, 1)]).is_none());
        assert!(WeightedSplit::new(vec![(0, u32::MAX)]).is_some());
    }
}
