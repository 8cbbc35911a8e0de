//! An idle engine blocks on its command queue instead of spinning. This
//! test is alone in its binary, so the process's CPU time is the engine's.

use std::time::{Duration, Instant};

// Its own binary (it measures its process); the helpers of the engine tests.
#[path = "engine/common/mod.rs"]
mod common;

use pdkv_engine::{EngineConfig, FinishReason};
use pdkv_model::Arch;

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
    let e = common::start(Arch::Llama, EngineConfig::default());
    // One request first, so every thread the engine uses has started.
    let out = common::run_one(
        &e,
        common::request("warm", common::prompt(1, 30), common::greedy(2)),
    );
    assert_eq!(out.finish, Some(FinishReason::Length));
    common::wait_idle(&e);

    // Idle for a second: wait for a request that never comes.
    let (cpu0, t0) = (cpu_time(), Instant::now());
    assert!(e
        .wait_stats(Duration::from_secs(1), |s| s.num_running > 0)
        .is_none());
    let (cpu, wall) = (cpu_time() - cpu0, t0.elapsed());
    eprintln!("idle engine: {cpu:?} of CPU in {wall:?}");
    assert!(
        cpu * 4 < wall,
        "the idle engine used {cpu:?} of CPU in {wall:?}"
    );
}
