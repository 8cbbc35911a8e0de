//! The background load: workers looping requests of varied lengths through
//! the proxy (streaming and not, some leaving after their first event on
//! purpose), each request's outcome, and their counts for a case.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde_json::{json, Value};

use crate::bounds::{POLL, PROGRESS_DEADLINE, REQUEST_DEADLINE, RETRY_BACKOFF};
use crate::complete::{complete, Reply};
use crate::prompts::{PREFIXES, QUESTIONS};

/// A load request's outcome as it ended, before the case classifies it.
#[derive(Debug)]
pub(crate) enum RawOutcome {
    Complete,
    Retryable,
    /// Finish reason `abort` (D aborted the request).
    Aborted,
    Disconnected,
    /// A 503 without `Retry-After`: lost (a client cannot tell that it
    /// clears by itself), counted apart.
    Bare503(String),
    Lost(String),
}

/// The background load's shared state.
pub(crate) struct Load {
    pub(crate) stop: AtomicBool,
    next: AtomicU64,
    pub(crate) completed: AtomicU64,
    pub(crate) inflight: Mutex<HashSet<String>>,
    outcomes: Mutex<Vec<(String, RawOutcome)>>,
    run_id: u32,
    cycle_tag: String,
    disconnect_every: usize,
    prompt_repeats: usize,
    url: String,
    client: reqwest::Client,
}

/// The load's request `i`: varied prompt length (its prefix repeated 1 to
/// `prompt_repeats` times), output length and shape.
fn load_body(i: u64, disconnect_every: usize, prompt_repeats: usize) -> (Value, bool) {
    let leave = disconnect_every > 0 && i % disconnect_every as u64 == disconnect_every as u64 - 1;
    let stream = leave || i % 2 == 1;
    let repeat = 1 + (i % prompt_repeats.max(1) as u64) as usize;
    let prompt = format!(
        "{} Request {i}:{}",
        PREFIXES[(i as usize / 3) % PREFIXES.len()].repeat(repeat),
        QUESTIONS[i as usize % QUESTIONS.len()]
    );
    let max_tokens = [4, 12, 24, 8, 16][(i % 5) as usize];
    (
        json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true, "stream": stream}),
        leave,
    )
}

pub(crate) fn raw_outcome(r: Reply) -> RawOutcome {
    if r.disconnected {
        return RawOutcome::Disconnected;
    }
    if let Some(why) = r.broken {
        return RawOutcome::Lost(format!("status {}: {why}", r.status));
    }
    if r.status == 503 {
        return if r.retry_after {
            RawOutcome::Retryable
        } else {
            RawOutcome::Bare503(format!(
                "503 without Retry-After: {}",
                r.error.unwrap_or_default()
            ))
        };
    }
    if r.status != 200 {
        return RawOutcome::Lost(format!(
            "status {}: {}",
            r.status,
            r.error.unwrap_or_default()
        ));
    }
    // The proxy's own errors (`upstream_error`, `upstream_timeout`, an error
    // event ending a stream D broke) are all failures.
    if let Some(err) = r.error {
        return RawOutcome::Lost(format!("an error in the body: {err}"));
    }
    if r.streamed && !r.done {
        return RawOutcome::Lost(format!(
            "the stream ended without [DONE] (finish {:?})",
            r.finish
        ));
    }
    match r.finish.as_deref() {
        Some("stop" | "length") => RawOutcome::Complete,
        Some("abort") => RawOutcome::Aborted,
        other => RawOutcome::Lost(format!("finished with {other:?}")),
    }
}

pub(crate) async fn load_worker(load: Arc<Load>) {
    while !load.stop.load(Ordering::Acquire) {
        let i = load.next.fetch_add(1, Ordering::Relaxed);
        let id = format!("lc-{}-{}-{i}", load.run_id, load.cycle_tag);
        let (body, leave) = load_body(i, load.disconnect_every, load.prompt_repeats);
        load.inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.clone());
        let reply = tokio::time::timeout(
            REQUEST_DEADLINE,
            complete(&load.client, &load.url, &body, Some(&id), leave),
        )
        .await;
        load.inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
        let mut outcome = match reply {
            Ok(r) => raw_outcome(r),
            Err(_) => RawOutcome::Lost(format!("no answer within {}s", REQUEST_DEADLINE.as_secs())),
        };
        // Anything but a finished request waits a little before the next
        // one, so a refusing engine is not flooded.
        let backoff = !matches!(outcome, RawOutcome::Complete | RawOutcome::Disconnected);
        if let RawOutcome::Complete = outcome {
            load.completed.fetch_add(1, Ordering::Relaxed);
        }
        if let RawOutcome::Lost(why) | RawOutcome::Bare503(why) = &mut outcome {
            *why = format!("{id}: {why}");
        }
        load.outcomes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((id, outcome));
        if backoff {
            tokio::time::sleep(RETRY_BACKOFF).await;
        }
    }
}

/// Counts of the load's outcomes in one case.
#[derive(Clone, Debug, Default)]
pub struct LoadCounts {
    pub sent: usize,
    pub complete: usize,
    /// 503s with `Retry-After` (a refusal a client retries).
    pub retryable: usize,
    /// Finish reason `abort` where the case aborts on purpose.
    pub aborted: usize,
    /// The client's own deliberate disconnects.
    pub disconnected: usize,
    /// Every lost request, with why.
    pub lost: Vec<String>,
    /// Of `lost`: 503s without `Retry-After`.
    pub bare_503: usize,
}

impl Load {
    /// The load of case run `cycle_tag` through the proxy at `proxy`.
    pub(crate) fn new(
        client: reqwest::Client,
        proxy: &str,
        run_id: u32,
        cycle_tag: String,
        disconnect_every: usize,
        prompt_repeats: usize,
    ) -> Load {
        Load {
            stop: AtomicBool::new(false),
            next: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            inflight: Mutex::new(HashSet::new()),
            outcomes: Mutex::new(Vec::new()),
            run_id,
            cycle_tag,
            disconnect_every,
            prompt_repeats,
            url: format!("{proxy}/v1/completions"),
            client,
        }
    }

    /// The ids of the requests in flight now.
    pub(crate) fn inflight_ids(&self) -> Vec<String> {
        self.inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    /// Every outcome so far, taken out.
    pub(crate) fn take_outcomes(&self) -> Vec<(String, RawOutcome)> {
        std::mem::take(&mut *self.outcomes.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl LoadCounts {
    /// The counts of a case's outcomes: an abort is intended when the case
    /// aborts D's requests (`aborts_all`) or D reported the id as aborted.
    pub(crate) fn tally(
        outcomes: Vec<(String, RawOutcome)>,
        aborts_all: bool,
        aborted_ids: &HashSet<String>,
    ) -> LoadCounts {
        let mut n = LoadCounts {
            sent: outcomes.len(),
            ..LoadCounts::default()
        };
        for (id, o) in outcomes {
            match o {
                RawOutcome::Complete => n.complete += 1,
                RawOutcome::Retryable => n.retryable += 1,
                RawOutcome::Disconnected => n.disconnected += 1,
                RawOutcome::Aborted if aborts_all || aborted_ids.contains(&id) => n.aborted += 1,
                RawOutcome::Aborted => n.lost.push(format!("{id}: aborted outside an abort")),
                RawOutcome::Bare503(why) => {
                    n.bare_503 += 1;
                    n.lost.push(why);
                }
                RawOutcome::Lost(why) => n.lost.push(why),
            }
        }
        n
    }

    /// The case's reason when requests were lost.
    pub(crate) fn lost_reason(&self) -> Option<String> {
        if self.lost.is_empty() {
            return None;
        }
        // Other kinds first: they are rarer and say more.
        let mut shown: Vec<&str> = self
            .lost
            .iter()
            .filter(|w| !w.contains("503 without Retry-After"))
            .take(3)
            .map(String::as_str)
            .collect();
        if shown.is_empty() {
            shown.push(&self.lost[0]);
        }
        Some(format!(
            "{} lost ({} of them 503s without Retry-After): {}",
            self.lost.len(),
            self.bare_503,
            shown.join(" | ")
        ))
    }
}

/// Waits until `load` completed `n` more requests than `from`, bounded.
pub(crate) async fn wait_progress(load: &Load, from: u64, n: u64) -> bool {
    let deadline = Instant::now() + PROGRESS_DEADLINE;
    while load.completed.load(Ordering::Relaxed) < from + n {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(POLL).await;
    }
    true
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn outcomes_are_classified() {
        let ok = Reply {
            status: 200,
            streamed: true,
            finish: Some("length".into()),
            done: true,
            ..Reply::default()
        };
        assert!(matches!(raw_outcome(ok), RawOutcome::Complete));
        let retry = Reply {
            status: 503,
            retry_after: true,
            ..Reply::default()
        };
        assert!(matches!(raw_outcome(retry), RawOutcome::Retryable));
        let bare = Reply {
            status: 503,
            ..Reply::default()
        };
        assert!(matches!(raw_outcome(bare), RawOutcome::Bare503(_)));
        let abort = Reply {
            status: 200,
            finish: Some("abort".into()),
            ..Reply::default()
        };
        assert!(matches!(raw_outcome(abort), RawOutcome::Aborted));
        // The proxy has no error event for an aborted prefill (D computes
        // the prompt): every error event is a failure.
        let event = Reply {
            status: 200,
            streamed: true,
            done: true,
            error: Some(json!({"code": "upstream_error"})),
            ..Reply::default()
        };
        assert!(matches!(raw_outcome(event), RawOutcome::Lost(_)));
        let timeout = Reply {
            status: 504,
            error: Some(json!({"code": "upstream_timeout"})),
            ..Reply::default()
        };
        assert!(matches!(raw_outcome(timeout), RawOutcome::Lost(_)));
        let unfinished = Reply {
            status: 200,
            ..Reply::default()
        };
        assert!(matches!(raw_outcome(unfinished), RawOutcome::Lost(_)));
        let no_done = Reply {
            status: 200,
            streamed: true,
            finish: Some("stop".into()),
            ..Reply::default()
        };
        assert!(matches!(raw_outcome(no_done), RawOutcome::Lost(_)));
        let left = Reply {
            status: 200,
            streamed: true,
            disconnected: true,
            ..Reply::default()
        };
        assert!(matches!(raw_outcome(left), RawOutcome::Disconnected));
        let failed = Reply {
            status: 200,
            error: Some(json!({"code": "kv_transfer_failed"})),
            ..Reply::default()
        };
        assert!(matches!(raw_outcome(failed), RawOutcome::Lost(_)));
    }
}
