//! Token sampling: greedy, temperature, top-k and top-p.
//!
//! Determinism: the random number used for output token `n` of a request is
//! a pure function of `(seed, n)` (a counter-based generator), never of a
//! generator state advanced per step. Together with bit-identical logits, a
//! seeded request therefore yields the same tokens whatever it is batched
//! with, however its prefill is chunked and however often it is preempted.
//!
//! All arithmetic on probabilities is done in f64 in a fixed order (by logit
//! descending, ties by token id ascending), so equal inputs give equal
//! choices.

use crate::SamplingParams;

/// The splitmix64 finaliser: a bijective 64-bit mixer.
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E3779B97F4A7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
    z ^ (z >> 31)
}

/// A uniform number in `[0, 1)` for output token `index` of a request seeded
/// with `seed`.
pub fn uniform(seed: u64, index: u64) -> f64 {
    let bits = splitmix64(seed ^ splitmix64(index.wrapping_mul(0xD1B54A32D192ED03)));
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The sampling knobs that matter per token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingConfig {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    pub seed: u64,
}

impl SamplingConfig {
    pub fn from_params(p: &SamplingParams, seed: u64) -> SamplingConfig {
        SamplingConfig { temperature: p.temperature, top_p: p.top_p, top_k: p.top_k, seed }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// The id of the largest logit; ties go to the lowest id and NaNs are never
/// chosen unless every logit is NaN (then 0).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    let mut found = false;
    for (i, &v) in logits.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        if !found || v > best_v {
            best = i;
            best_v = v;
            found = true;
        }
    }
    best as u32
}

/// Picks output token `index` of a request from its logits row.
pub fn sample(logits: &[f32], cfg: &SamplingConfig, index: u64) -> u32 {
    assert!(!logits.is_empty(), "empty logits row");
    if cfg.is_greedy() || cfg.top_k == 1 {
        return argmax(logits);
    }
    let inv_t = 1.0 / cfg.temperature as f64;
    let vocab = logits.len();
    let top_k = if cfg.top_k == 0 { vocab } else { (cfg.top_k as usize).min(vocab) };
    let top_p = cfg.top_p as f64;

    // Candidates in the fixed order: logit descending, id ascending. Sorting
    // is only needed when top-k or top-p truncates.
    let key = |a: &u32, b: &u32| {
        let (va, vb) = (logits[*a as usize], logits[*b as usize]);
        vb.total_cmp(&va).then(a.cmp(b))
    };
    let mut ids: Vec<u32> = (0..vocab as u32).filter(|&i| !logits[i as usize].is_nan()).collect();
    if ids.is_empty() {
        return 0;
    }
    if top_k < ids.len() {
        ids.select_nth_unstable_by(top_k - 1, key);
        ids.truncate(top_k);
        ids.sort_unstable_by(key);
    } else if top_p < 1.0 {
        ids.sort_unstable_by(key);
    }
    let max = ids.iter().map(|&i| logits[i as usize]).fold(f32::NEG_INFINITY, f32::max) as f64;
    if max == f64::NEG_INFINITY {
        return argmax(logits);
    }
    let mut probs: Vec<f64> = ids.iter().map(|&i| ((logits[i as usize] as f64 - max) * inv_t).exp()).collect();
    let total: f64 = probs.iter().sum();
    // Top-p: the smallest prefix (in sorted order) with mass >= top_p.
    let mut keep = probs.len();
    if top_p < 1.0 {
        let mut acc = 0.0;
        for (n, p) in probs.iter().enumerate() {
            acc += p / total;
            if acc >= top_p {
                keep = n + 1;
                break;
            }
        }
        probs.truncate(keep);
        ids.truncate(keep);
    }
    let kept: f64 = probs.iter().sum();
    let target = uniform(cfg.seed, index) * kept;
    let mut acc = 0.0;
    for (n, p) in probs.iter().enumerate() {
        acc += p;
        if target < acc {
            return ids[n];
        }
    }
    // Rounding left `target` at the very top: the last candidate.
    *ids.last().expect("non-empty")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(temperature: f32, top_p: f32, top_k: u32, seed: u64) -> SamplingConfig {
        SamplingConfig { temperature, top_p, top_k, seed }
    }

    #[test]
    fn greedy_ties_to_lowest_id_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0, f32::NAN]), 1);
        assert_eq!(sample(&[0.0, 5.0, 5.0], &cfg(0.0, 1.0, 0, 1), 0), 1);
    }

    #[test]
    fn uniform_is_counter_based_and_in_range() {
        assert_eq!(uniform(7, 3), uniform(7, 3));
        assert_ne!(uniform(7, 3), uniform(7, 4));
        assert_ne!(uniform(7, 3), uniform(8, 3));
        for i in 0..1000 {
            let u = uniform(42, i);
            assert!((0.0..1.0).contains(&u));
        }
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        let logits = [0.0f32, 1.0, 2.0, 3.0, 4.0];
        for i in 0..500 {
            let t = sample(&logits, &cfg(1.0, 1.0, 2, 9), i);
            assert!(t == 3 || t == 4, "top_k=2 gave {t}");
        }
        // p(4) ~ 0.636, p(3) ~ 0.234: top_p 0.5 keeps only token 4.
        for i in 0..200 {
            assert_eq!(sample(&logits, &cfg(1.0, 0.5, 0, 9), i), 4);
        }
        for i in 0..500 {
            let t = sample(&logits, &cfg(1.0, 0.8, 0, 9), i);
            assert!(t == 3 || t == 4, "top_p=0.8 gave {t}");
        }
    }

    #[test]
    fn temperature_sampling_matches_softmax_frequencies() {
        let logits = [0.0f32, (2.0f32).ln(), (4.0f32).ln()]; // probs 1/7, 2/7, 4/7
        let n = 70_000;
        let mut counts = [0usize; 3];
        for i in 0..n {
            counts[sample(&logits, &cfg(1.0, 1.0, 0, 123), i as u64) as usize] += 1;
        }
        for (c, want) in counts.iter().zip([1.0 / 7.0, 2.0 / 7.0, 4.0 / 7.0]) {
            let got = *c as f64 / n as f64;
            assert!((got - want).abs() < 0.01, "frequency {got} vs {want}");
        }
        // Low temperature sharpens towards the argmax.
        let sharp = (0..1000).filter(|&i| sample(&logits, &cfg(0.05, 1.0, 0, 5), i) == 2).count();
        assert!(sharp > 990);
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let a: Vec<u32> = (0..50).map(|i| sample(&logits, &cfg(0.9, 0.95, 40, 77), i)).collect();
        let b: Vec<u32> = (0..50).map(|i| sample(&logits, &cfg(0.9, 0.95, 40, 77), i)).collect();
        let c: Vec<u32> = (0..50).map(|i| sample(&logits, &cfg(0.9, 0.95, 40, 78), i)).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }
}
