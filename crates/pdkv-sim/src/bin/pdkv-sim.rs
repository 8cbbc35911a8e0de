//! `pdkv-sim --seeds A..B`: plays many seeds of the deterministic P/D
//! simulator and prints one line per seed; a violation prints the seed that
//! replays it (`--seeds N..N+1 --verbose`) and fails the command.

use std::time::Instant;

use clap::Parser;

#[derive(Parser)]
#[command(about = "Runs the deterministic P/D simulator over a range of seeds")]
struct Args {
    /// Seeds to run, `A..B` (B excluded) or one number.
    #[arg(long, default_value = "0..32")]
    seeds: String,
    /// Client requests per run.
    #[arg(long)]
    clients: Option<u64>,
    /// Simulated seconds of the safety phase per run.
    #[arg(long)]
    safety_s: Option<u64>,
    /// D's `kv_load_failure_policy` for every run (`fail`, `recompute`;
    /// default: drawn from the seed).
    #[arg(long)]
    policy: Option<String>,
    /// Network faults on or off for every run (default: drawn from the seed).
    #[arg(long)]
    faults: Option<bool>,
    /// Read mode on or off for every run (default: drawn from the seed).
    #[arg(long)]
    read_mode: Option<bool>,
    /// Tensor-parallel ranks of the prefill engine for every run, 1 to 4
    /// (default: drawn from the seed).
    #[arg(long)]
    p_tp: Option<usize>,
    /// Tensor-parallel ranks of the decode engine for every run, 1 to 4
    /// (default: drawn from the seed).
    #[arg(long)]
    d_tp: Option<usize>,
    /// Run every seed twice and fail when the two runs differ (a replay
    /// must be exact).
    #[arg(long)]
    replay: bool,
    /// Print every run's line with its trace hash (else only violations
    /// and a summary).
    #[arg(long)]
    verbose: bool,
    /// Runs played at once, each on a thread of its own (default: the
    /// CPUs this process may use). Lines come out in seed order either way.
    #[arg(long)]
    jobs: Option<usize>,
}

/// Seeds played (on every thread) before their lines are printed.
const CHUNK: usize = 64;

fn seeds(s: &str) -> anyhow::Result<std::ops::Range<u64>> {
    match s.split_once("..") {
        Some((a, b)) => Ok(a.trim().parse()?..b.trim().parse()?),
        None => {
            let n: u64 = s.trim().parse()?;
            Ok(n..n + 1)
        }
    }
}

/// Seed `seed`'s options with the command line's overrides, checked.
fn options(args: &Args, seed: u64) -> anyhow::Result<pdkv_sim::Options> {
    let mut opts = pdkv_sim::Options::for_seed(seed);
    if let Some(c) = args.clients {
        opts.clients = c;
    }
    match args.policy.as_deref() {
        Some("fail") => opts.policy = "fail",
        Some("recompute") => opts.policy = "recompute",
        Some(other) => anyhow::bail!("--policy must be fail or recompute, got {other:?}"),
        None => {}
    }
    if let Some(f) = args.faults {
        opts.faults = f;
        opts.crashes &= f;
    }
    if let Some(r) = args.read_mode {
        opts.read_mode = r;
    }
    for (tp, arg) in [(&mut opts.p_tp, args.p_tp), (&mut opts.d_tp, args.d_tp)] {
        if let Some(n) = arg {
            anyhow::ensure!(
                (1..=pdkv_sim::model::NUM_KV_HEADS).contains(&n),
                "--p-tp and --d-tp must be 1 to {}, got {n}",
                pdkv_sim::model::NUM_KV_HEADS
            );
            *tp = n;
        }
    }
    if let Some(s) = args.safety_s {
        opts.safety = std::time::Duration::from_secs(s);
    }
    Ok(opts)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let range = seeds(&args.seeds)?;
    let t0 = Instant::now();
    let (mut runs, mut bad, mut events, mut simulated) = (0u64, Vec::new(), 0u64, 0.0f64);
    let (mut copies, mut hetero, mut retried) = (0u64, 0u64, 0u64);
    let (mut release_faults, mut restore_faults, mut rollback_faults) = (0u64, 0u64, 0u64);
    // Claims sent, leases expired unclaimed / claimed, loads that found one expired.
    let mut leases = (0u64, 0u64, 0u64, 0u64);
    let mut reclaimed = 0u64;
    let mut resumed = (0u64, 0u64, 0u64);
    let mut pairs: std::collections::BTreeMap<(usize, usize), u64> = Default::default();
    let threads = args
        .jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    anyhow::ensure!(threads >= 1, "--jobs must be at least 1");
    let seeds: Vec<u64> = range.collect();
    // Seeds in chunks, each played on every thread, then reported in order.
    for chunk in seeds.chunks(CHUNK) {
        let opts = chunk
            .iter()
            .map(|&seed| options(&args, seed))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let again = if args.replay {
            pdkv_sim::run_each(opts.clone(), threads)
        } else {
            Vec::new()
        };
        let reports = pdkv_sim::run_each(opts, threads);
        for (i, (&seed, r)) in chunk.iter().zip(reports).enumerate() {
            if let Some(again) = again.get(i) {
                if (again.events, again.trace, again.line()) != (r.events, r.trace, r.line()) {
                    println!(
                        "seed {seed} does not replay: {} events (trace {:x}) then {} (trace {:x})",
                        r.events, r.trace, again.events, again.trace
                    );
                    bad.push(seed);
                }
            }
            runs += 1;
            events += r.events;
            copies += r.rank_copies;
            hetero += r.hetero_transfers;
            release_faults += r.rank_release_faults;
            restore_faults += r.rank_restore_faults;
            rollback_faults += r.rank_rollback_faults;
            retried += r.rank_faults_retried;
            leases.0 += r.claims_sent;
            leases.1 += r.leases_expired;
            leases.2 += r.claimed_leases_expired;
            leases.3 += r.loads_lease_expired;
            reclaimed += r.leases_reclaimed;
            resumed.0 += r.resumed;
            resumed.1 += r.checked_resumed;
            resumed.2 += r.crashes;
            *pairs.entry((r.p_tp, r.d_tp)).or_default() += 1;
            simulated += r.simulated.as_secs_f64();
            if args.verbose {
                // The trace hash: a digest of the run's every event, to compare
                // runs of one seed across builds.
                println!("{} (trace {:016x})", r.line(), r.trace);
            } else if !r.ok() {
                println!("{}", r.line());
            }
            if args.verbose {
                for (e, n) in &r.operation_errors {
                    println!("  {n} lifecycle calls answered: {e}");
                }
            }
            if !r.ok() {
                for v in r.violations.iter().chain(&r.losses) {
                    println!("  {v}");
                }
                bad.push(seed);
            }
        }
    }
    println!(
        "{runs} seeds, {events} events, {:.2} simulated hours, {:.1} s wall: {} with violations {:?}",
        simulated / 3600.0,
        t0.elapsed().as_secs_f64(),
        bad.len(),
        bad
    );
    let pairs: Vec<String> = pairs
        .iter()
        .map(|((p, d), n)| format!("{p}->{d}: {n}"))
        .collect();
    println!(
        "tensor parallelism (P->D: seeds) {}; {copies} per-rank KV copies, {hetero} heterogeneous-TP transfers, {} injected rank faults ({release_faults} on release, {restore_faults} on restore; {rollback_faults} releases whose rollback failed too), {retried} of them retried successfully",
        pairs.join(", "),
        release_faults + restore_faults
    );
    println!(
        "leases: {} transfers claimed for queued requests; expired {} unclaimed, {} claimed (only where an engine crashed or the network failed); {} loads found their lease expired; {reclaimed} held transfers reclaimed for new prompts",
        leases.0, leases.1, leases.2, leases.3
    );
    println!(
        "streams: {} resumed on a decode engine after theirs was lost ({} engine crashes); {} resumed streams ended whole and read exactly a colocated engine's tokens",
        resumed.0, resumed.2, resumed.1
    );
    anyhow::ensure!(bad.is_empty(), "violations in seeds {bad:?}");
    Ok(())
}
