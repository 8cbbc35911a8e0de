//! The Python publisher (`python/pdkv-publish`) against a real pdkv P/D:
//! its script starts `pdkv up`, publishes a second checkpoint, drives the
//! weight sync through the proxy and checks refusals and the result.

use std::process::Command;

#[test]
fn the_python_publisher_syncs_a_real_pd_deployment() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../python/pdkv-publish");
    let out = Command::new("python3")
        .arg(format!("{root}/tests/sync_pd.py"))
        .arg(env!("CARGO_BIN_EXE_pdkv"))
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the script failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("all checks passed"), "{stdout}");
}
