//! Token sampling: greedy, temperature, top-k and top-p, after the logits
//! adjustments of vLLM (min_tokens, logit_bias, repetition, presence and
//! frequency penalties), and the log-probabilities reported to clients.
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

use std::collections::BTreeMap;

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
    pub min_p: f32,
    pub seed: u64,
}

impl SamplingConfig {
    pub fn from_params(p: &SamplingParams, seed: u64) -> SamplingConfig {
        SamplingConfig {
            temperature: p.temperature,
            top_p: p.top_p,
            top_k: p.top_k,
            min_p: p.min_p,
            seed,
        }
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
    let top_k = if cfg.top_k == 0 {
        vocab
    } else {
        (cfg.top_k as usize).min(vocab)
    };
    let top_p = cfg.top_p as f64;

    // Candidates in the fixed order: logit descending, id ascending. Sorting
    // is only needed when top-k or top-p truncates.
    let key = |a: &u32, b: &u32| {
        let (va, vb) = (logits[*a as usize], logits[*b as usize]);
        vb.total_cmp(&va).then(a.cmp(b))
    };
    let mut ids: Vec<u32> = (0..vocab as u32)
        .filter(|&i| !logits[i as usize].is_nan())
        .collect();
    if ids.is_empty() {
        return 0;
    }
    if cfg.min_p > 0.0 {
        // p_i / p_max = exp((l_i - l_max) / T): the tokens below min_p
        // times the most likely one go, whatever top-k and top-p keep.
        let top = ids
            .iter()
            .map(|&i| logits[i as usize])
            .fold(f32::NEG_INFINITY, f32::max) as f64;
        let floor = (cfg.min_p as f64).ln();
        if top.is_finite() {
            ids.retain(|&i| (logits[i as usize] as f64 - top) * inv_t >= floor);
        }
    }
    if top_k < ids.len() {
        ids.select_nth_unstable_by(top_k - 1, key);
        ids.truncate(top_k);
        ids.sort_unstable_by(key);
    } else if top_p < 1.0 {
        ids.sort_unstable_by(key);
    }
    let max = ids
        .iter()
        .map(|&i| logits[i as usize])
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    if max == f64::NEG_INFINITY {
        return argmax(logits);
    }
    let mut probs: Vec<f64> = ids
        .iter()
        .map(|&i| ((logits[i as usize] as f64 - max) * inv_t).exp())
        .collect();
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

/// What a request changes in a logits row before sampling, with vLLM's
/// definitions and in vLLM's order: first `min_tokens` (stop tokens masked)
/// and `logit_bias`, then the penalties. Log-probabilities are reported from
/// the raw row, before any of this (vLLM's default, `raw_logprobs`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LogitsAdjust {
    /// Only these tokens may be sampled, sorted (empty: any); the others
    /// get `-inf` first.
    pub allowed: Vec<u32>,
    /// While fewer outputs than this exist, `stop_token_ids` get `-inf`.
    pub min_tokens: usize,
    /// The tokens that would end the request: EOS (unless ignored) and the
    /// request's stop token ids.
    pub stop_token_ids: Vec<u32>,
    /// `(token id, bias)`, added to the logit; ids are in the vocabulary.
    pub logit_bias: Vec<(u32, f32)>,
    /// 1.0 is off. A token seen in the prompt or the output has a positive
    /// logit divided by it and a negative one multiplied by it.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token the output contains.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per occurrence in the output.
    pub frequency_penalty: f32,
}

impl LogitsAdjust {
    /// The adjustments `p` asks for; `stop_token_ids` are the ones that end
    /// the request (EOS included unless `ignore_eos`).
    pub fn from_params(p: &SamplingParams, stop_token_ids: &[u32]) -> LogitsAdjust {
        let mut allowed = p.allowed_token_ids.clone().unwrap_or_default();
        allowed.sort_unstable();
        allowed.dedup();
        LogitsAdjust {
            allowed,
            min_tokens: p.min_tokens as usize,
            stop_token_ids: if p.min_tokens > 0 {
                stop_token_ids.to_vec()
            } else {
                Vec::new()
            },
            logit_bias: p.logit_bias.clone(),
            repetition_penalty: p.repetition_penalty,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
        }
    }

    /// Whether anything changes a row (else the raw row is sampled as is).
    pub fn is_active(&self) -> bool {
        self.min_tokens > 0
            || !self.logit_bias.is_empty()
            || !self.allowed.is_empty()
            || self.uses_history()
    }

    /// Whether the penalties need the tokens seen so far.
    pub fn uses_history(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }

    /// Applies the adjustments to `logits`, the row for the output token
    /// that follows `history`.
    pub fn apply(&self, logits: &mut [f32], history: &TokenHistory) {
        if !self.allowed.is_empty() {
            for (t, v) in logits.iter_mut().enumerate() {
                if self.allowed.binary_search(&(t as u32)).is_err() {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
        if history.num_outputs < self.min_tokens {
            for &t in &self.stop_token_ids {
                if let Some(v) = logits.get_mut(t as usize) {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
        for &(t, bias) in &self.logit_bias {
            if let Some(v) = logits.get_mut(t as usize) {
                *v += bias;
            }
        }
        if self.repetition_penalty != 1.0 {
            let r = self.repetition_penalty;
            // A token in both the prompt and the output is penalised once.
            let mut seen: Vec<u32> = history
                .prompt
                .iter()
                .chain(history.output.keys())
                .copied()
                .collect();
            seen.sort_unstable();
            seen.dedup();
            for t in seen {
                if let Some(v) = logits.get_mut(t as usize) {
                    *v = if *v > 0.0 { *v / r } else { *v * r };
                }
            }
        }
        if self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 {
            for (&t, &count) in &history.output {
                if let Some(v) = logits.get_mut(t as usize) {
                    *v -= self.frequency_penalty * count as f32 + self.presence_penalty;
                }
            }
        }
    }
}

/// The tokens a request has seen, as the penalties need them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenHistory {
    /// The prompt's distinct tokens, sorted (only kept when a repetition
    /// penalty needs them).
    prompt: Vec<u32>,
    /// Count per output token.
    output: BTreeMap<u32, u32>,
    num_outputs: usize,
}

impl TokenHistory {
    /// `keep_prompt`: remember the prompt's tokens (the repetition penalty
    /// covers them; the other penalties count outputs only).
    pub fn new(prompt: &[u32], keep_prompt: bool) -> TokenHistory {
        let mut p = if keep_prompt {
            prompt.to_vec()
        } else {
            Vec::new()
        };
        p.sort_unstable();
        p.dedup();
        TokenHistory {
            prompt: p,
            output: BTreeMap::new(),
            num_outputs: 0,
        }
    }

    /// Records a sampled output token.
    pub fn push(&mut self, token: u32) {
        *self.output.entry(token).or_insert(0) += 1;
        self.num_outputs += 1;
    }

    pub fn num_outputs(&self) -> usize {
        self.num_outputs
    }
}

/// The log-probabilities of one position: the chosen token's, its rank and
/// the most likely tokens'.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    /// `ln p(token)`; `-inf` for a token the row excludes.
    pub logprob: f64,
    /// 1 plus the number of tokens with a strictly larger log-probability.
    pub rank: u32,
    /// The `k` most likely tokens, by log-probability descending, ties by id
    /// ascending.
    pub top: Vec<(u32, f64)>,
}

/// Log-softmax of `logits` at `token` plus the `k` most likely tokens.
///
/// Computed in f64 in index order (the maximum, then the sum of
/// `exp(x - max)`), so a row gives the same values wherever it was computed;
/// NaN entries count as excluded (`-inf`).
pub fn logprobs(logits: &[f32], token: u32, k: usize) -> TokenLogprobs {
    let val = |v: f32| {
        if v.is_nan() {
            f64::NEG_INFINITY
        } else {
            v as f64
        }
    };
    let max = logits
        .iter()
        .map(|&v| val(v))
        .fold(f64::NEG_INFINITY, f64::max);
    let lse = if max == f64::NEG_INFINITY {
        0.0
    } else {
        let sum: f64 = logits.iter().map(|&v| (val(v) - max).exp()).sum();
        max + sum.ln()
    };
    let lp = |v: f32| val(v) - lse;
    let mine = logits
        .get(token as usize)
        .copied()
        .map_or(f64::NEG_INFINITY, lp);
    let rank = 1 + logits.iter().filter(|&&v| lp(v) > mine).count() as u32;
    let mut top = Vec::new();
    let k = k.min(logits.len());
    if k > 0 {
        let key = |a: &u32, b: &u32| {
            val(logits[*b as usize])
                .total_cmp(&val(logits[*a as usize]))
                .then(a.cmp(b))
        };
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        if k < ids.len() {
            ids.select_nth_unstable_by(k - 1, key);
            ids.truncate(k);
        }
        ids.sort_unstable_by(key);
        top = ids
            .into_iter()
            .map(|i| (i, lp(logits[i as usize])))
            .collect();
    }
    TokenLogprobs {
        token,
        logprob: mine,
        rank,
        top,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(temperature: f32, top_p: f32, top_k: u32, seed: u64) -> SamplingConfig {
        SamplingConfig {
            temperature,
            top_p,
            top_k,
            min_p: 0.0,
            seed,
        }
    }

    #[test]
    fn min_p_drops_tokens_below_its_share_of_the_most_likely() {
        // At T = 1: p(1)/p(0) = e^-1 ≈ 0.37, p(2)/p(0) = e^-3 ≈ 0.05.
        let logits = [5.0, 4.0, 2.0];
        let with = |min_p: f32| SamplingConfig {
            min_p,
            ..cfg(1.0, 1.0, 0, 0)
        };
        let seen = |c: &SamplingConfig| {
            let mut s: Vec<u32> = (0..4000).map(|i| sample(&logits, c, i)).collect();
            s.sort_unstable();
            s.dedup();
            s
        };
        assert_eq!(seen(&with(0.0)), vec![0, 1, 2]);
        assert_eq!(seen(&with(0.1)), vec![0, 1]);
        assert_eq!(seen(&with(0.5)), vec![0]);
        // At T = 0.5 the ratio is squared: e^-2 ≈ 0.135 < 0.2.
        let hot = SamplingConfig {
            temperature: 0.5,
            ..with(0.2)
        };
        assert_eq!(seen(&hot), vec![0]);
        // Every logit -inf: nothing to compare with, argmax as before.
        let none = [f32::NEG_INFINITY; 3];
        assert_eq!(sample(&none, &with(0.5), 0), 0);
    }

    #[test]
    fn allowed_token_ids_mask_every_other_token() {
        let p = SamplingParams {
            allowed_token_ids: Some(vec![3, 1, 3]),
            ..SamplingParams::default()
        };
        let adj = LogitsAdjust::from_params(&p, &[]);
        assert!(adj.is_active());
        assert_eq!(adj.allowed, vec![1, 3]);
        let mut row = vec![9.0, 1.0, 8.0, 2.0];
        adj.apply(&mut row, &TokenHistory::new(&[], false));
        assert_eq!(row[0], f32::NEG_INFINITY);
        assert_eq!(row[2], f32::NEG_INFINITY);
        assert_eq!((row[1], row[3]), (1.0, 2.0));
        assert_eq!(argmax(&row), 3);
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
        let sharp = (0..1000)
            .filter(|&i| sample(&logits, &cfg(0.05, 1.0, 0, 5), i) == 2)
            .count();
        assert!(sharp > 990);
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let a: Vec<u32> = (0..50)
            .map(|i| sample(&logits, &cfg(0.9, 0.95, 40, 77), i))
            .collect();
        let b: Vec<u32> = (0..50)
            .map(|i| sample(&logits, &cfg(0.9, 0.95, 40, 77), i))
            .collect();
        let c: Vec<u32> = (0..50)
            .map(|i| sample(&logits, &cfg(0.9, 0.95, 40, 78), i))
            .collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    fn history(prompt: &[u32], outputs: &[u32]) -> TokenHistory {
        let mut h = TokenHistory::new(prompt, true);
        for &t in outputs {
            h.push(t);
        }
        h
    }

    fn adjusted(adj: &LogitsAdjust, logits: &[f32], h: &TokenHistory) -> Vec<f32> {
        let mut row = logits.to_vec();
        adj.apply(&mut row, h);
        row
    }

    fn off() -> LogitsAdjust {
        LogitsAdjust {
            repetition_penalty: 1.0,
            ..Default::default()
        }
    }

    #[test]
    fn min_tokens_masks_stop_tokens_until_reached() {
        let adj = LogitsAdjust {
            min_tokens: 2,
            stop_token_ids: vec![0, 3],
            ..off()
        };
        let logits = [9.0f32, 1.0, 2.0, 8.0];
        let greedy = cfg(0.0, 1.0, 0, 0);
        let row = adjusted(&adj, &logits, &history(&[1], &[]));
        assert_eq!(row, [f32::NEG_INFINITY, 1.0, 2.0, f32::NEG_INFINITY]);
        assert_eq!(
            sample(&row, &greedy, 0),
            2,
            "EOS (0) and the stop id (3) are masked"
        );
        assert_eq!(
            sample(&adjusted(&adj, &logits, &history(&[1], &[2])), &greedy, 1),
            2
        );
        // Two outputs exist: the stop tokens may end the request now.
        assert_eq!(
            sample(
                &adjusted(&adj, &logits, &history(&[1], &[2, 2])),
                &greedy,
                2
            ),
            0
        );
        assert!(adj.is_active() && !off().is_active());
    }

    #[test]
    fn logit_bias_adds_to_the_logit() {
        let adj = LogitsAdjust {
            logit_bias: vec![(1, 100.0), (2, -100.0)],
            ..off()
        };
        let row = adjusted(&adj, &[5.0, 0.0, 4.0], &history(&[], &[]));
        assert_eq!(row, [5.0, 100.0, -96.0]);
        for i in 0..100 {
            assert_eq!(
                sample(&row, &cfg(1.0, 1.0, 0, 3), i),
                1,
                "a +100 bias forces the token"
            );
        }
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() {
        let adj = LogitsAdjust {
            repetition_penalty: 2.0,
            ..off()
        };
        // Token 0 in the prompt, 1 in the output (twice), 2 in both; 3 unseen.
        let h = history(&[0, 2], &[1, 2, 1]);
        let row = adjusted(&adj, &[4.0, -1.0, 3.0, 2.5], &h);
        assert_eq!(
            row,
            [2.0, -2.0, 1.5, 2.5],
            "penalised once each, whatever the count"
        );
        assert_eq!(
            argmax(&row),
            3,
            "the penalty moves the greedy choice to the unseen token"
        );
    }

    #[test]
    fn presence_and_frequency_penalties_count_output_tokens_only() {
        let h = history(&[0, 0, 0], &[1, 1, 1, 2]);
        let presence = LogitsAdjust {
            presence_penalty: 1.5,
            ..off()
        };
        assert_eq!(adjusted(&presence, &[3.0, 3.0, 3.0], &h), [3.0, 1.5, 1.5]);
        let frequency = LogitsAdjust {
            frequency_penalty: 0.5,
            ..off()
        };
        assert_eq!(adjusted(&frequency, &[3.0, 3.0, 3.0], &h), [3.0, 1.5, 2.5]);
        let both = LogitsAdjust {
            presence_penalty: 1.0,
            frequency_penalty: 1.0,
            ..off()
        };
        assert_eq!(adjusted(&both, &[3.0, 3.0, 3.0], &h), [3.0, -1.0, 1.0]);
        // Negative values reward repeats: the repeated token wins greedily.
        let reward = LogitsAdjust {
            presence_penalty: -2.0,
            ..off()
        };
        assert_eq!(argmax(&adjusted(&reward, &[3.0, 2.0, 1.0], &h)), 1);
    }

    #[test]
    fn logprobs_are_the_log_softmax_with_ranked_top_tokens() {
        let logits = [
            0.0f32,
            (2.0f32).ln(),
            (4.0f32).ln(),
            (2.0f32).ln(),
            f32::NEG_INFINITY,
        ];
        let lp = logprobs(&logits, 1, 3);
        assert!(
            (lp.logprob - (2.0f64 / 9.0).ln()).abs() < 1e-6,
            "{}",
            lp.logprob
        );
        assert_eq!(lp.rank, 2);
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [2, 1, 3], "descending, ties by id");
        assert!((lp.top[0].1 - (4.0f64 / 9.0).ln()).abs() < 1e-6);
        let excluded = logprobs(&logits, 4, 0);
        assert_eq!(
            (excluded.logprob, excluded.rank, excluded.top.len()),
            (f64::NEG_INFINITY, 5, 0)
        );
        let total: f64 = (0..5).map(|t| logprobs(&logits, t, 0).logprob.exp()).sum();
        assert!((total - 1.0).abs() < 1e-12);
    }
}
