//! The simulator's fixed seeds (part of the test command): every run must
//! end without a violation, and a seed must replay exactly (0..500 under
//! `scripts/test.sh --full`). More seeds:
//! `cargo run --release -p pdkv-sim -- --seeds 0..10000`.

use pdkv_sim::{run, run_each, Options};

/// Seeds the test command runs: every variant (write/read mode, fail/
/// recompute policy, with and without network faults and crashes, engines
/// of one rank and split over ranks alike or not) many times over.
const SEEDS: std::ops::Range<u64> = 0..64;

/// Seeds of the full suite (`scripts/test.sh --full`, `PDKV_FULL_SUITE=1`).
const FULL_SEEDS: std::ops::Range<u64> = 0..500;

/// The seeds this run covers.
fn seeds() -> std::ops::Range<u64> {
    if std::env::var_os("PDKV_FULL_SUITE").is_some() {
        FULL_SEEDS
    } else {
        SEEDS
    }
}

/// Seeds that found real bugs, kept as regressions: 133 — waiting requests
/// holding loaded (or recomputing) KV blocks while the first in line could
/// not get its blocks and nothing ran: the decode engine stopped serving.
const REGRESSIONS: [u64; 1] = [133];

#[test]
fn fixed_seeds_hold_every_safety_and_liveness_check() {
    let mut bad = Vec::new();
    let (mut events, mut checked, mut frames) = (0, 0, 0);
    let (mut hetero, mut faults, mut retried, mut tp1) = (0, 0, 0, 0);
    let (mut resumed, mut resumed_checked) = (0, 0);
    let opts = seeds().chain(REGRESSIONS).map(Options::for_seed).collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    for r in run_each(opts, threads) {
        events += r.events;
        checked += r.checked_outputs;
        frames += r.frames;
        hetero += r.hetero_transfers;
        faults += r.rank_release_faults + r.rank_restore_faults;
        retried += r.rank_faults_retried;
        tp1 += u32::from((r.p_tp, r.d_tp) == (1, 1));
        resumed += r.resumed;
        resumed_checked += r.checked_resumed;
        if !r.ok() {
            bad.push(format!("{}\n  {}", r.line(), r.violations.join("\n  ")));
        }
    }
    assert!(
        bad.is_empty(),
        "replay with `cargo run --release -p pdkv-sim -- --seeds N --verbose`:\n{}",
        bad.join("\n")
    );
    // The runs did real work: transfers moved KV and outputs were compared.
    assert!(
        events > 100_000 && checked > 1000 && frames > 1000,
        "events {events}, outputs checked {checked}, KV frames {frames}"
    );
    // Engines of one rank and engines split differently both ran, and
    // faults on one rank failed lifecycle calls that then succeeded.
    assert!(
        tp1 > 0 && hetero > 100 && faults > 0 && retried > 0,
        "TP1-only seeds {tp1}, heterogeneous transfers {hetero}, rank faults {faults} ({retried} retried)"
    );
    // Decode engines died mid-stream and the proxy resumed those streams,
    // some of which ended whole with a colocated engine's tokens.
    assert!(
        resumed > 0 && resumed_checked > 0,
        "streams resumed {resumed}, of them checked whole {resumed_checked}"
    );
}

/// Every split of P and D over ranks that moves a block as more than one
/// copy, or as copies of another shape than the block's, in both modes
/// and with faults (seed 4: network faults, no crash).
#[test]
fn heterogeneous_splits_hold_every_check_in_both_modes() {
    let mut bad = Vec::new();
    for (p_tp, d_tp) in [(2, 1), (1, 2), (4, 3), (2, 2)] {
        for read_mode in [false, true] {
            let mut opts = Options::for_seed(4);
            (opts.p_tp, opts.d_tp, opts.read_mode) = (p_tp, d_tp, read_mode);
            opts.clients = 150;
            let r = run(opts);
            if !r.ok() {
                bad.push(format!("{}\n  {}", r.line(), r.violations.join("\n  ")));
                continue;
            }
            // Pairs of ranks whose heads overlap: a copy each per block.
            let copies_per_block = if (p_tp, d_tp) == (4, 3) { 4 } else { 2 };
            assert!(
                r.loads_ok > 0 && r.rank_copies >= r.loads_ok * copies_per_block,
                "P TP{p_tp} -> D TP{d_tp} (read mode {read_mode}): {}",
                r.line()
            );
            assert_eq!(
                r.hetero_transfers > 0,
                p_tp != d_tp,
                "P TP{p_tp} -> D TP{d_tp} (read mode {read_mode}): {}",
                r.line()
            );
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn a_seed_replays_exactly() {
    // Seeds where an unordered table in a machine made two runs differ:
    // played alone, then again on two threads at once, in order.
    let seeds = [4, 6, 20];
    let again = run_each(seeds.iter().map(|&s| Options::for_seed(s)).collect(), 2);
    assert_eq!(again.len(), seeds.len());
    for (seed, b) in seeds.into_iter().zip(again) {
        let a = run(Options::for_seed(seed));
        assert_eq!(b.seed, seed, "run_each's reports are in the seeds' order");
        assert!(a.ok(), "{}", a.line());
        assert_eq!(a.line(), b.line(), "seed {seed} did not replay");
        assert_eq!(
            (a.events, a.trace),
            (b.events, b.trace),
            "seed {seed}: the event sequence differs"
        );
    }
}
