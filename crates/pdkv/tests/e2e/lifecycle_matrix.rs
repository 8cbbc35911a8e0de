//! The lifecycle matrix end to end: every case of the catalogue on a tiny
//! random Llama checkpoint, in write mode over TCP and read mode over shared
//! memory, both with D's `kv_load_failure_policy` `fail` (where a failed
//! transfer would fail its request, and every case requires none).
//! `pdkv_lifecycle::run_matrix` starts P, D and the proxy (this package's
//! `pdkv` binary in every child), runs every case under load with client
//! disconnects, and checks outputs against the awake baseline, lost
//! requests, quiescence and device memory; here every case of the catalogue
//! must have run once and passed, its reasons shown when it did not.

use std::path::Path;
use std::time::Duration;

use pdkv_lifecycle::{
    case_names, run_matrix, FailurePolicy, MatrixReport, Options, TransferMode, Transport,
};

/// Bound on one whole matrix run.
const RUN_DEADLINE: Duration = Duration::from_secs(900);

/// An error with its causes, one after the other.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(&format!(": {c}"));
        cause = c.source();
    }
    s
}

/// Every case once in `transport` and `mode`, bounded by [`RUN_DEADLINE`]
/// (the deployment is stopped when the run ends or is cut short).
fn run_all(
    model: &Path,
    transport: Transport,
    mode: TransferMode,
    policy: FailurePolicy,
) -> MatrixReport {
    let mut o = Options::new(env!("CARGO_BIN_EXE_pdkv").into(), model.to_path_buf());
    o.cases = "all".to_string();
    o.transport = transport;
    o.transfer_mode = mode;
    o.kv_load_failure_policy = policy;
    o.probes = 30;
    o.load_concurrency = 4;
    // P gives up on transfers nobody collects after 5 s (the default 30 s
    // would only make the run slower).
    o.kv_abort_timeout_s = Some(5.0);
    o.on_case = Some(Box::new(|r| println!("{}  ({:.1}s)", r.line(), r.wall_s)));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime
        .block_on(async { tokio::time::timeout(RUN_DEADLINE, run_matrix(o)).await })
        .unwrap_or_else(|_| {
            panic!("{transport:?} {mode:?} {policy:?}: the matrix did not finish within {RUN_DEADLINE:?}")
        })
        .unwrap_or_else(|e| panic!("{transport:?} {mode:?} {policy:?}: the matrix stopped: {}", chain(&e)))
}

/// Write mode over TCP and read mode over shared memory, with D's policy
/// `fail` (strict: any failed transfer fails a request): each transfer mode
/// and each transport once. The full suite (`scripts/test.sh --full`,
/// `PDKV_FULL_SUITE=1`) runs every transport with every mode, under both
/// policies.
fn configurations() -> Vec<(Transport, TransferMode, FailurePolicy)> {
    if std::env::var_os("PDKV_FULL_SUITE").is_none() {
        return vec![
            (Transport::Tcp, TransferMode::Write, FailurePolicy::Fail),
            (Transport::Shm, TransferMode::Read, FailurePolicy::Fail),
        ];
    }
    let mut all = Vec::new();
    for transport in [Transport::Tcp, Transport::Shm] {
        for mode in [TransferMode::Write, TransferMode::Read] {
            for policy in [FailurePolicy::Fail, FailurePolicy::Recompute] {
                all.push((transport, mode, policy));
            }
        }
    }
    all
}

#[test]
fn every_lifecycle_case_passes_under_load_in_write_and_read_mode() {
    let dir = pdkv_testkit::models::checkpoint(pdkv_model::Arch::Llama, "tiny", 0);
    let cases = case_names();
    assert_eq!(cases.len(), 40, "{cases:?}");

    for (transport, mode, policy) in configurations() {
        let report = run_all(dir.path(), transport, mode, policy);
        println!("{}", report.summary());
        let ran: Vec<&str> = report.results.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(
            ran, cases,
            "{transport:?} {mode:?} {policy:?}: every case once, in order"
        );
        let failed: Vec<String> = report
            .failed()
            .iter()
            .map(|r| format!("{}: {}", r.name, r.reasons.join("; ")))
            .collect();
        assert!(
            failed.is_empty(),
            "{transport:?} {mode:?} {policy:?}: cases not passing:\n{}",
            failed.join("\n")
        );
        assert!(report.results.iter().all(|r| r.cycle == 1));
    }
}
