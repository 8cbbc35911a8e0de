//! `--verify-outputs`: once the load is over (and, with `--chaos`, no
//! engine is being killed), every request that ended well is sent again,
//! whole and greedy, to the deployment at rest; the tokens its stream
//! carried under load must equal the ones it gets now. Under `--chaos`
//! this is what says a resumed stream, or a prompt a decode engine computed
//! while the prefill engine was gone, gave the client exactly what an
//! undisturbed run gives.

use std::sync::Arc;

use serde_json::{json, Value};

use super::load::{self, LoadConfig, Outcome, Record};

/// At most this many differences are kept as examples.
const EXAMPLES: usize = 3;

#[derive(Default)]
pub struct Verdict {
    pub checked: usize,
    pub differ: usize,
    /// Replays that got no answer to compare.
    pub failed: usize,
    pub examples: Vec<String>,
}

impl Verdict {
    pub fn json(&self) -> Value {
        json!({"checked": self.checked, "differ": self.differ, "failed": self.failed,
               "examples": self.examples})
    }

    pub fn line(&self) -> String {
        format!(
            "outputs verified: {} requests sent again at rest, {} differ, {} got no answer",
            self.checked, self.differ, self.failed
        )
    }

    /// Why the run counts as failed, if it does.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.differ > 0 {
            p.push(format!(
                "{} of {} greedy outputs differ from the same request at rest: {}",
                self.differ,
                self.checked,
                self.examples.join("; ")
            ));
        }
        if self.failed > 0 {
            p.push(format!(
                "{} requests sent again to verify their outputs got no answer",
                self.failed
            ));
        }
        p
    }
}

/// The tokens request `index` gets alone (non-streamed), or why none.
async fn replay(
    client: &reqwest::Client,
    cfg: &LoadConfig,
    index: u64,
) -> Result<Vec<u32>, String> {
    let plan = load::plan(cfg, index);
    let mut body = load::body(cfg, &plan);
    body["stream"] = json!(false);
    if let Some(o) = body.as_object_mut() {
        o.remove("stream_options");
    }
    let resp = client
        .post(format!("{}/v1/completions", cfg.url))
        .json(&body)
        .timeout(cfg.request_timeout)
        .send()
        .await
        .map_err(|e| load::error_chain(&e))?;
    let status = resp.status();
    let v: Value = resp.json().await.map_err(|e| load::error_chain(&e))?;
    if !status.is_success() {
        return Err(format!("http {status}: {}", load::clip(&v.to_string())));
    }
    v["choices"][0]["token_ids"]
        .as_array()
        .ok_or_else(|| format!("no token_ids: {}", load::clip(&v.to_string())))?
        .iter()
        .map(|t| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or("a token id that is not one".to_string())
        })
        .collect()
}

/// Sends every request of `records` that ended well again, `concurrency`
/// at a time, and compares.
pub async fn verify(cfg: Arc<LoadConfig>, records: &[Record]) -> anyhow::Result<Verdict> {
    let client = reqwest::Client::builder().build()?;
    let wanted: Vec<(u64, Vec<u32>)> = records
        .iter()
        .filter(|r| r.outcome == Outcome::Ok)
        .map(|r| (r.index, r.token_ids.clone()))
        .collect();
    let gate = Arc::new(tokio::sync::Semaphore::new(cfg.concurrency.max(1)));
    let mut replays = tokio::task::JoinSet::new();
    for (index, streamed) in wanted {
        let (client, cfg, gate) = (client.clone(), cfg.clone(), gate.clone());
        replays.spawn(async move {
            let _turn = gate.acquire_owned().await;
            (index, streamed, replay(&client, &cfg, index).await)
        });
    }
    let mut v = Verdict::default();
    while let Some(done) = replays.join_next().await {
        let (index, streamed, at_rest) = done?;
        v.checked += 1;
        match at_rest {
            Err(why) => {
                v.failed += 1;
                if v.examples.len() < EXAMPLES {
                    v.examples.push(format!("request {index}: {why}"));
                }
            }
            Ok(ids) if ids != streamed => {
                v.differ += 1;
                if v.examples.len() < EXAMPLES {
                    let at = ids
                        .iter()
                        .zip(&streamed)
                        .take_while(|(a, b)| a == b)
                        .count();
                    v.examples.push(format!(
                        "request {index}: from token {at} the stream carried {:?}, at rest {:?}",
                        &streamed[at.min(streamed.len())..(at + 4).min(streamed.len())],
                        &ids[at.min(ids.len())..(at + 4).min(ids.len())]
                    ));
                }
            }
            Ok(_) => {}
        }
    }
    Ok(v)
}
