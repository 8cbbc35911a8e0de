//! An idle engine blocks on its command queue instead of spinning. This
//! test is alone in its binary, so the process's CPU time is the engine's.

use std::time::{Duration, Instant};

use pdkv_engine::{Engine, EngineConfig, EngineRequest, FinishReason, SamplingParams};

/// User + system CPU time of this process (all threads), from /proc.
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    // Fields after the command name, which is in parentheses: utime and
    // stime are fields 14 and 15, in USER_HZ (100 per second) ticks.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

#[test]
fn an_idle_engine_does_not_spin() {
    let dir = tempfile::tempdir().unwrap();
    pdkv_model::init::write_random_checkpoint(pdkv_model::Arch::Llama, "tiny", 7, dir.path()).unwrap();
    let pool = pdkv_vmem::Pool::default();
    let model = pdkv_model::load_model(dir.path(), &pool, &mut |_| {}).unwrap();
    let e = Engine::start(model, pool, EngineConfig::default()).unwrap();
    // One request first, so every thread the engine uses has started.
    let mut stream = e
        .add_request(EngineRequest {
            id: "warm".into(),
            prompt_tokens: (10..40).collect(),
            params: SamplingParams { max_tokens: 2, ..SamplingParams::default() },
            kv_transfer_params: None,
        })
        .unwrap();
    let mut last = None;
    while let Some(out) = stream.blocking_next() {
        last = out.finish_reason;
    }
    assert_eq!(last, Some(FinishReason::Length));
    assert!(e.wait_stats(Duration::from_secs(30), |s| s.num_running == 0 && s.num_waiting == 0).is_some());

    // Idle for a second: wait for a request that never comes.
    let (cpu0, t0) = (cpu_time(), Instant::now());
    assert!(e.wait_stats(Duration::from_secs(1), |s| s.num_running > 0).is_none());
    let (cpu, wall) = (cpu_time() - cpu0, t0.elapsed());
    eprintln!("idle engine: {cpu:?} of CPU in {wall:?}");
    assert!(cpu * 4 < wall, "the idle engine used {cpu:?} of CPU in {wall:?}");
    e.shutdown();
}
