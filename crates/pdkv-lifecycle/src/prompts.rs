//! The texts of the probes and of the load: a few prefixes many prompts
//! share (so the prefix cache and transfers of shared blocks are exercised)
//! and the questions that make them distinct.

pub(crate) const PREFIXES: [&str; 6] = [
    "The library opens at nine and closes at five on weekdays, and on Saturdays it opens at ten.",
    "The river flows through the old town, passes under seven bridges and reaches the sea at the docks.",
    "To bake bread you need flour, water, salt and yeast, then patience while the dough rises twice.",
    "The server rack in room four has twelve machines, two switches and a backup battery unit.",
    "A young fox lived at the edge of a forest and every morning watched the farmer feed his hens.",
    "The train left the station at noon, crossed the valley and climbed slowly towards the mountains.",
];

pub(crate) const QUESTIONS: [&str; 5] = [
    " Question: what is this about? Answer:",
    " In five words:",
    " The key detail is",
    " Next,",
    " A title for it:",
];

/// `n` distinct prompts, groups of which share a prefix.
pub(crate) fn probe_prompts(n: usize) -> Vec<String> {
    let per_round = PREFIXES.len() * QUESTIONS.len();
    (0..n)
        .map(|i| {
            let p = PREFIXES[i % PREFIXES.len()];
            let q = QUESTIONS[(i / PREFIXES.len()) % QUESTIONS.len()];
            match i / per_round {
                0 => format!("{p}{q}"),
                round => format!("{p} (variant {round}){q}"),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn probe_prompts_are_distinct_and_share_prefixes() {
        let p = probe_prompts(70);
        assert_eq!(p.iter().collect::<HashSet<_>>().len(), 70);
        assert!(p[0].starts_with(PREFIXES[0]) && p[PREFIXES.len()].starts_with(PREFIXES[0]));
    }
}
