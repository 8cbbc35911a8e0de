//! What every case run shares: the cluster, the options, the baseline it
//! is compared with, and what its operations observed ([`OpReport`]).

use std::collections::{HashMap, HashSet};
use std::fmt::Display;
use std::time::Duration;

use serde_json::json;

use crate::cases::{Role, Target};
use crate::cluster::Cluster;
use crate::error::Problem;
use crate::options::Options;

/// The baseline every case is compared with.
pub(crate) struct Baseline {
    pub(crate) prompts: Vec<String>,
    pub(crate) texts: Vec<String>,
    pub(crate) p_awake: u64,
    pub(crate) d_awake: u64,
    /// Each engine's awake device bytes rank by rank.
    pub(crate) p_ranks: Vec<u64>,
    pub(crate) d_ranks: Vec<u64>,
}

impl Baseline {
    /// `role`'s awake device bytes, in all and rank by rank.
    pub(crate) fn awake(&self, role: Role) -> (u64, &[u64]) {
        match role {
            Role::P => (self.p_awake, &self.p_ranks),
            Role::D => (self.d_awake, &self.d_ranks),
        }
    }
}

/// Runs the cases of one matrix run.
pub(crate) struct Runner<'a> {
    pub(crate) c: Cluster,
    pub(crate) o: &'a Options,
    pub(crate) base: Baseline,
    /// Process-wide unique enough id for request ids of one run.
    pub(crate) run_id: u32,
}

/// What a case's operations observed.
#[derive(Default)]
pub(crate) struct OpReport {
    pub(crate) errors: Vec<String>,
    pub(crate) notes: Vec<String>,
    pub(crate) asleep: HashMap<Role, u64>,
    /// The same, rank by rank.
    pub(crate) asleep_ranks: HashMap<Role, Vec<u64>>,
    /// `abort_requests`: the ids D reported as aborted.
    pub(crate) aborted_ids: HashSet<String>,
}

impl OpReport {
    pub(crate) fn check<E: Display>(&mut self, r: Result<(), E>) {
        if let Err(e) = r {
            self.errors.push(e.to_string());
        }
    }

    pub(crate) fn fail(&mut self, e: impl Display) {
        self.errors.push(e.to_string());
    }
}

impl Runner<'_> {
    pub(crate) fn hold(&self) -> Duration {
        Duration::from_millis(self.o.hold_ms)
    }

    /// `/pause?mode=keep` bounded by `--op-timeout`.
    pub(crate) fn keep_pause(&self) -> String {
        format!("/pause?mode=keep&timeout={}", self.o.op_timeout)
    }

    pub(crate) async fn record_asleep(&self, rep: &mut OpReport, target: Target) {
        for role in [Role::P, Role::D] {
            if target.has(role) {
                match self.c.device_bytes(role).await {
                    Ok(b) => {
                        rep.asleep.insert(role, b);
                    }
                    Err(e) => rep.fail(e),
                }
                match self.c.rank_bytes(role).await {
                    Ok(b) => {
                        rep.asleep_ranks.insert(role, b);
                    }
                    Err(e) => rep.fail(e),
                }
            }
        }
    }

    /// Reloads the weights the servers started with on `target`. P and D
    /// must serve one weights version (a decode engine refuses KV computed
    /// with other weights, and recomputes): both get `fresh`, a single
    /// engine the version the other one serves (the checkpoint is the same).
    pub(crate) async fn reload(&self, target: Target, fresh: &str) -> Result<(), Problem> {
        let version = match target {
            Target::Both => json!(fresh),
            Target::P => {
                self.c.admin(Role::D, false, "/weight_info", None).await?["version"].clone()
            }
            Target::D => {
                self.c.admin(Role::P, false, "/weight_info", None).await?["version"].clone()
            }
        };
        let body = json!({"path": self.c.model.display().to_string(), "version": version});
        self.c
            .on_all(target, true, "/update_weights", Some(body))
            .await?;
        for role in [Role::P, Role::D] {
            if target.has(role) {
                let info = self.c.admin(role, false, "/weight_info", None).await?;
                if info["version"] != version {
                    return Err(Problem::Unexpected(format!(
                        "{} reports weights {info} after loading version {version}",
                        role.name()
                    )));
                }
            }
        }
        Ok(())
    }
}
