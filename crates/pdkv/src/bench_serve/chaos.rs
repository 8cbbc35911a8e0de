//! `bench serve --chaos`: engines of the bench's own deployment killed with
//! SIGKILL on a schedule (no shutdown runs: a crash, an OOM kill) and
//! started again at once on their ports, while the load runs. What a fleet
//! should survive without a client noticing: the proxy resumes the streams
//! of a decode engine that died on another one, and lets a decode engine
//! compute the prompts while the prefill engine is gone.

use std::time::{Duration, Instant};

use anyhow::Context;
use pdkv_deploy::{EngineLaunch, EngineRole, Logs, Proc};
use serde_json::{json, Value};

use super::WHO;

/// Which engines are killed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Victims {
    Decode,
    Prefill,
    Both,
}

impl Victims {
    fn takes(self, role: EngineRole) -> bool {
        match self {
            Victims::Both => true,
            Victims::Decode => role == EngineRole::Decode,
            Victims::Prefill => role == EngineRole::Prefill,
        }
    }
}

/// One kill and its restart.
struct Kill {
    engine: String,
    /// From the kill to the new process's first healthy answer.
    back_after: Duration,
}

/// The schedule's state: whose turn it is and what happened.
pub struct Chaos {
    launches: Vec<EngineLaunch>,
    /// Indexes into `launches` (and the deployment's children) in the
    /// order they are killed, round robin.
    order: Vec<usize>,
    next: usize,
    restarts: Vec<u32>,
    kills: Vec<Kill>,
    logs: Logs,
    startup_timeout: Duration,
}

impl Chaos {
    pub fn new(
        launches: Vec<EngineLaunch>,
        victims: Victims,
        logs: Logs,
        startup_timeout: Duration,
    ) -> anyhow::Result<Chaos> {
        // Decode engines and the prefill engine in turn (d0, p, d1, p, ...
        // with both), so each role is hit while the other serves.
        let decodes: Vec<usize> = (0..launches.len())
            .filter(|&i| {
                launches[i].role == EngineRole::Decode && victims.takes(EngineRole::Decode)
            })
            .collect();
        let prefills: Vec<usize> = (0..launches.len())
            .filter(|&i| {
                launches[i].role == EngineRole::Prefill && victims.takes(EngineRole::Prefill)
            })
            .collect();
        let mut order = Vec::new();
        for k in 0..decodes.len().max(prefills.len()) {
            for role in [&decodes, &prefills] {
                if !role.is_empty() {
                    order.push(role[k % role.len()]);
                }
            }
        }
        anyhow::ensure!(!order.is_empty(), "--chaos found no engine to kill");
        let restarts = vec![0; launches.len()];
        Ok(Chaos {
            launches,
            order,
            next: 0,
            restarts,
            kills: Vec::new(),
            logs,
            startup_timeout,
        })
    }

    /// Kills the next engine in turn (its child is `procs[i]`, as
    /// `launches[i]`), starts it again and waits until it is healthy,
    /// bounded by the start-up timeout; returns its new pid.
    pub async fn kill_next(
        &mut self,
        procs: &mut [Proc],
        client: &reqwest::Client,
    ) -> anyhow::Result<(usize, u32)> {
        let i = self.order[self.next % self.order.len()];
        self.next += 1;
        let launch = &self.launches[i];
        let killed = Instant::now();
        procs[i].kill();
        eprintln!(
            "{WHO}: chaos: killed the {} (SIGKILL); starting it again",
            launch.name
        );
        self.restarts[i] += 1;
        procs[i] = launch
            .respawn(self.restarts[i], &self.logs)
            .with_context(|| format!("starting the {} again", launch.name))?;
        let deadline = killed + self.startup_timeout;
        pdkv_deploy::wait_healthy(client, &mut procs[i..=i], deadline, WHO)
            .await
            .with_context(|| format!("the restarted {} never became healthy", launch.name))?;
        let back_after = killed.elapsed();
        eprintln!(
            "{WHO}: chaos: the {} serves again after {:.1}s",
            launch.name,
            back_after.as_secs_f64()
        );
        self.kills.push(Kill {
            engine: launch.name.clone(),
            back_after,
        });
        Ok((i, procs[i].pid()))
    }

    pub fn json(&self, interval: Duration) -> Value {
        let back: Vec<f64> = self
            .kills
            .iter()
            .map(|k| k.back_after.as_secs_f64())
            .collect();
        let max = back.iter().copied().fold(0.0, f64::max);
        json!({
            "interval_s": interval.as_secs_f64(),
            "kills": self.kills.iter().map(|k| json!({"engine": k.engine, "back_after_s": k.back_after.as_secs_f64()})).collect::<Vec<_>>(),
            "killed": self.kills.len(),
            "back_after_s_max": max,
        })
    }

    /// One line for the table.
    pub fn line(&self) -> String {
        let max = self
            .kills
            .iter()
            .map(|k| k.back_after.as_secs_f64())
            .fold(0.0, f64::max);
        format!(
            "chaos: {} engines killed (SIGKILL) and started again, each serving again within {max:.1}s",
            self.kills.len()
        )
    }
}

/// What the proxy did about the kills, from its `/metrics`: streams it
/// resumed, requests whose decode engine computed the prompt because the
/// prefill engine was gone (or refused), requests counted by outcome.
pub async fn proxy_counters(client: &reqwest::Client, proxy: &str) -> Value {
    let text = match client.get(format!("{proxy}/metrics")).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(e) => return json!({"error": e.to_string()}),
    };
    let prom = pdkv_deploy::prom::metric;
    json!({
        "streams_resumed": prom(&text, "pdkv_proxy_requests_resumed_total"),
        "prefill_down": prom(&text, "pdkv_proxy_prefill_down_total"),
        "prefill_skipped": pdkv_deploy::prom::sums_by_label(&text, "pdkv_proxy_prefill_skipped_total", "reason"),
        "outcomes": pdkv_deploy::prom::sums_by_label(&text, "pdkv_proxy_requests_total", "outcome"),
    })
}
