//! Memory and KV blocks over time: each engine's `/metrics` (device memory
//! summed over its tags, KV blocks free, total and held), the resident set
//! of each child process from `/proc/PID/status`, and the wait for the
//! engines to go quiet after the load.

use std::time::{Duration, Instant};

use pdkv_deploy::prom::metric_sum;

/// An engine whose `/metrics` are sampled.
#[derive(Clone, Debug)]
pub struct Engine {
    pub name: String,
    pub url: String,
}

/// One scrape of an engine's `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineSample {
    /// `pdkv_device_memory_bytes`, summed over its `tag` labels.
    pub device_bytes: Option<f64>,
    pub blocks_free: Option<f64>,
    pub blocks_total: Option<f64>,
    pub blocks_held: Option<f64>,
    pub running: Option<f64>,
    pub waiting: Option<f64>,
}

impl EngineSample {
    pub fn parse(text: &str) -> EngineSample {
        EngineSample {
            device_bytes: metric_sum(text, "pdkv_device_memory_bytes"),
            blocks_free: metric_sum(text, "pdkv_kv_blocks_free"),
            blocks_total: metric_sum(text, "pdkv_kv_blocks_total"),
            blocks_held: metric_sum(text, "pdkv_kv_blocks_held"),
            running: metric_sum(text, "pdkv_num_requests_running"),
            waiting: metric_sum(text, "pdkv_num_requests_waiting"),
        }
    }

    /// No request in the engine and every block free, none held.
    pub fn quiet(&self) -> bool {
        self.running == Some(0.0)
            && self.waiting == Some(0.0)
            && self.blocks_held == Some(0.0)
            && self.blocks_free.is_some()
            && self.blocks_free == self.blocks_total
    }
}

pub async fn scrape(client: &reqwest::Client, url: &str) -> Result<EngineSample, String> {
    let resp = client
        .get(format!("{url}/metrics"))
        .send()
        .await
        .map_err(|e| super::load::error_chain(&e))?;
    if !resp.status().is_success() {
        return Err(format!("/metrics answered {}", resp.status()));
    }
    let text = resp
        .text()
        .await
        .map_err(|e| super::load::error_chain(&e))?;
    Ok(EngineSample::parse(&text))
}

/// `VmRSS` of process `pid`, in bytes.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().next()?.parse().ok()?;
    Some(kib * 1024)
}

/// One sample of the whole deployment.
#[derive(Clone, Debug)]
pub struct Sample {
    pub elapsed: Duration,
    /// Per engine, in the order of the engines (`None`: the scrape failed).
    pub engines: Vec<Option<EngineSample>>,
    /// Per engine: how long its `/metrics` took to answer, or why it failed.
    pub scrapes: Vec<Result<Duration, String>>,
    /// Per child process, in the order of the processes.
    pub rss: Vec<Option<u64>>,
    pub ok: u64,
    pub failed: u64,
    pub disconnected: u64,
    pub tokens: u64,
}

/// The engines' states once quiet, or at the deadline.
pub struct Quiesced {
    pub engines: Vec<Option<EngineSample>>,
    pub waited: Duration,
}

/// Polls every engine until each is [quiet](EngineSample::quiet) or
/// `bound` passes.
pub async fn wait_quiet(client: &reqwest::Client, engines: &[Engine], bound: Duration) -> Quiesced {
    let t0 = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tick.tick().await;
        let mut now = Vec::with_capacity(engines.len());
        for e in engines {
            now.push(scrape(client, &e.url).await.ok());
        }
        let all_quiet = now.iter().all(|s| s.is_some_and(|s| s.quiet()));
        if all_quiet || t0.elapsed() >= bound {
            return Quiesced {
                engines: now,
                waited: t0.elapsed(),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labelled_samples_are_summed_and_prefixes_not_confused() {
        let text = "# HELP pdkv_device_memory_bytes x\n# TYPE pdkv_device_memory_bytes gauge\n\
            pdkv_device_memory_bytes{tag=\"weights\"} 100\npdkv_device_memory_bytes{tag=\"kv_cache\"} 200\n\
            pdkv_kv_blocks_free 4\npdkv_kv_blocks_free_ratio 0.5\npdkv_kv_blocks_total 4\npdkv_kv_blocks_held 0\n\
            pdkv_num_requests_running 0\npdkv_num_requests_waiting 0\n";
        let s = EngineSample::parse(text);
        assert_eq!(s.device_bytes, Some(300.0));
        assert_eq!(s.blocks_free, Some(4.0));
        assert!(s.quiet());
        assert_eq!(metric_sum(text, "pdkv_missing"), None);
    }
}
