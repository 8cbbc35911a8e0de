//! The case catalogue: which lifecycle operation each case drives on which
//! engine(s), in a stable order, and the selection `--cases` makes.

use crate::error::LifecycleError;

/// An engine of the deployment: the prefill server or the decode server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Role {
    P,
    D,
}

impl Role {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Role::P => "P",
            Role::D => "D",
        }
    }
}

/// Which engine(s) a case operates on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Target {
    P,
    D,
    Both,
}

impl Target {
    pub(crate) fn suffix(self) -> &'static str {
        match self {
            Target::P => "p",
            Target::D => "d",
            Target::Both => "both",
        }
    }

    pub(crate) fn has(self, role: Role) -> bool {
        matches!(
            (self, role),
            (Target::Both, _) | (Target::P, Role::P) | (Target::D, Role::D)
        )
    }
}

/// The lifecycle operation a case drives.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Op {
    /// `/pause?mode=..&clear_cache=..`, hold, `/resume`.
    Pause { mode: &'static str, clear: bool },
    /// `/sleep?level=..&mode=keep`, hold, `/wake_up` (level 2: inside an
    /// explicit keep pause, with a weight reload before `/resume`).
    Sleep { level: u32 },
    /// Level-1 sleep of D, then `/wake_up` for one tag and the other.
    SelectiveWake { weights_first: bool },
    /// `/abort_requests` on D with ids of load requests in flight.
    AbortRequests,
    /// `/reset_prefix_cache?reset_running_requests=true`, idle then under load.
    ResetPrefixCache,
    /// Pause (keep), `/release_kv_cache_memory`, `/resume`.
    ReleaseKv,
    /// Pause (keep), `/update_weights` with the same checkpoint, `/resume`.
    WeightReload,
    /// Level-1 sleep (keep) of P while a transfer waits at P (see the
    /// module docs), then wake.
    PSleepsWhileDPulls,
    /// The RL trainer's calls: `/pause?mode=keep`, `/sleep?level=1` (no
    /// mode), `/wake_up`, `/resume`.
    TrainerSequence,
}

#[derive(Clone, Debug)]
pub(crate) struct Case {
    pub(crate) name: String,
    pub(crate) op: Op,
    pub(crate) target: Target,
}

impl Case {
    fn new(name: impl Into<String>, op: Op, target: Target) -> Case {
        Case {
            name: name.into(),
            op,
            target,
        }
    }

    /// Whether any load request may end with finish reason `abort`: D
    /// aborts its requests. (P's aborted requests never reach a client: D
    /// computes their prompts.)
    pub(crate) fn aborts_all(&self) -> bool {
        matches!(self.op, Op::Pause { mode: "abort", .. }) && self.target.has(Role::D)
    }

    /// The engines whose memory must drop to at most 2% while asleep.
    pub(crate) fn sleeping(&self) -> Option<Target> {
        match self.op {
            Op::Sleep { level } if level >= 1 => Some(self.target),
            Op::SelectiveWake { .. } => Some(Target::D),
            Op::PSleepsWhileDPulls => Some(Target::P),
            Op::TrainerSequence => Some(self.target),
            _ => None,
        }
    }
}

/// Every case, in a stable order.
pub(crate) fn all_cases() -> Vec<Case> {
    let targets = [Target::P, Target::D, Target::Both];
    let mut v = Vec::new();
    for mode in ["abort", "wait", "keep"] {
        for clear in [false, true] {
            for t in targets {
                let name = format!(
                    "pause_{mode}{}_{}",
                    if clear { "_clear" } else { "" },
                    t.suffix()
                );
                v.push(Case::new(name, Op::Pause { mode, clear }, t));
            }
        }
    }
    for level in [0, 1, 2] {
        for t in targets {
            v.push(Case::new(
                format!("sleep_l{level}_{}", t.suffix()),
                Op::Sleep { level },
                t,
            ));
        }
    }
    v.push(Case::new(
        "wake_weights_first_d",
        Op::SelectiveWake {
            weights_first: true,
        },
        Target::D,
    ));
    v.push(Case::new(
        "wake_kv_first_d",
        Op::SelectiveWake {
            weights_first: false,
        },
        Target::D,
    ));
    v.push(Case::new("abort_requests", Op::AbortRequests, Target::D));
    for t in [Target::P, Target::D] {
        v.push(Case::new(
            format!("reset_prefix_cache_{}", t.suffix()),
            Op::ResetPrefixCache,
            t,
        ));
    }
    for t in targets {
        v.push(Case::new(
            format!("release_kv_cache_memory_{}", t.suffix()),
            Op::ReleaseKv,
            t,
        ));
    }
    for t in [Target::P, Target::D] {
        v.push(Case::new(
            format!("weight_reload_{}", t.suffix()),
            Op::WeightReload,
            t,
        ));
    }
    v.push(Case::new(
        "p_sleeps_while_d_pulls",
        Op::PSleepsWhileDPulls,
        Target::P,
    ));
    for t in [Target::P, Target::Both] {
        v.push(Case::new(
            format!("trainer_sequence_{}", t.suffix()),
            Op::TrainerSequence,
            t,
        ));
    }
    v
}

/// The cases `spec` names (`all`, or names separated by commas).
pub(crate) fn select_cases(spec: &str) -> Result<Vec<Case>, LifecycleError> {
    let all = all_cases();
    if spec.trim() == "all" {
        return Ok(all);
    }
    let mut out = Vec::new();
    for name in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let case = all
            .iter()
            .find(|c| c.name == name)
            .ok_or_else(|| LifecycleError::UnknownCase(name.to_string()))?;
        out.push(case.clone());
    }
    if out.is_empty() {
        return Err(LifecycleError::NoCase);
    }
    Ok(out)
}

/// The name of every case, in the catalogue's order.
pub fn case_names() -> Vec<String> {
    all_cases().into_iter().map(|c| c.name).collect()
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn case_names_are_unique_and_complete() {
        let cases = all_cases();
        let names: HashSet<&str> = cases.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names.len(), cases.len());
        assert_eq!(
            cases
                .iter()
                .filter(|c| c.name.starts_with("pause_"))
                .count(),
            18
        );
        assert_eq!(
            cases
                .iter()
                .filter(|c| c.name.starts_with("sleep_l"))
                .count(),
            9
        );
        assert_eq!(cases.len(), 40);
        for n in [
            "pause_keep_clear_both",
            "sleep_l2_d",
            "wake_kv_first_d",
            "abort_requests",
            "p_sleeps_while_d_pulls",
            "trainer_sequence_p",
            "trainer_sequence_both",
        ] {
            assert!(names.contains(n), "{n}");
        }
        assert_eq!(select_cases("sleep_l1_p, abort_requests").unwrap().len(), 2);
        assert!(select_cases("sleep_l3_p").is_err());
        assert!(select_cases(",").is_err());
    }
}
