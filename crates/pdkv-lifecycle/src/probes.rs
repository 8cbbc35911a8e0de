//! The probe set: greedy prompts through the proxy whose texts must equal
//! the baseline's after every case.

use serde_json::{json, Value};

use crate::bounds::PROBE_BATCH;
use crate::cluster::Cluster;
use crate::complete::complete;

/// Why a probe gave no text.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ProbeFailure {
    #[error("probe task: {0}")]
    Task(tokio::task::JoinError),
    /// It ended with another finish reason than `length` or `stop`.
    #[error("finished with {0:?}")]
    Finish(Option<String>),
    #[error("status {status} {broken:?} {error:?}")]
    Answer {
        status: u16,
        broken: Option<String>,
        error: Option<Value>,
    },
}

/// Runs the probe set through the proxy, 8 at a time, odd ones streamed;
/// the texts in order, or why a probe gave none.
pub(crate) async fn run_probes(
    c: &Cluster,
    prompts: &[String],
    tokens: u32,
) -> Vec<Result<String, ProbeFailure>> {
    let url = format!("{}/v1/completions", c.proxy);
    let mut out = Vec::with_capacity(prompts.len());
    for batch in prompts.chunks(PROBE_BATCH).enumerate() {
        let (b, chunk) = batch;
        let mut tasks = Vec::new();
        for (j, prompt) in chunk.iter().enumerate() {
            let i = b * PROBE_BATCH + j;
            let body = json!({"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": true, "stream": i % 2 == 1});
            let (client, url) = (c.client.clone(), url.clone());
            tasks.push(tokio::spawn(async move {
                complete(&client, &url, &body, None, false).await
            }));
        }
        for t in tasks {
            let r = match t.await {
                Err(e) => Err(ProbeFailure::Task(e)),
                Ok(r) if r.status == 200 && r.broken.is_none() && r.error.is_none() => {
                    match r.finish.as_deref() {
                        Some("length" | "stop") => Ok(r.text),
                        _ => Err(ProbeFailure::Finish(r.finish)),
                    }
                }
                Ok(r) => Err(ProbeFailure::Answer {
                    status: r.status,
                    broken: r.broken,
                    error: r.error,
                }),
            };
            out.push(r);
        }
    }
    out
}
