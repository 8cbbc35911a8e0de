//! `kv_peers`: the bootstrap addresses a decode engine may connect to.

use pdkv_engine::FinishReason;

use crate::common::{
    assert_finished, bootstrap_addr, config, consumer, engine, idle_and_free, pd, producer, prompt,
    request,
};

/// With `kv_peers`, a decode engine refuses `kv_transfer_params` naming any
/// other bootstrap address when the request is added, naming the setting,
/// and opens no connection there (a listener counts none); a listed P
/// still serves.
#[test]
fn a_decode_engine_connects_only_to_its_kv_peers() {
    let p = engine(Some((&producer(""), "p-peer")), config());
    let ph = &p.handle;
    let allowed = bootstrap_addr(ph);
    let d_cfg = consumer(&format!(r#","kv_peers":["{allowed}"]"#));
    let d = engine(Some((&d_cfg, "d-peer")), config());
    let trap = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    trap.set_nonblocking(true).unwrap();
    let trap_addr = trap.local_addr().unwrap().to_string();
    let steered = pdkv_connector::params::for_decode("t-steered", Some("p-peer"), Some(&trap_addr));
    let err = d
        .handle
        .add_request(request("steered", prompt(70, 40), 2, Some(steered)))
        .err()
        .expect("refused");
    let msg = err.to_string();
    assert!(
        msg.contains("kv_peers") && msg.contains(&trap_addr),
        "{msg}"
    );
    assert_eq!(
        trap.accept().map_err(|e| e.kind()).err(),
        Some(std::io::ErrorKind::WouldBlock),
        "no connection was opened to the address the client named"
    );
    // The listed P serves as before.
    let out = pd(ph, &d.handle, "t-allowed", &prompt(71, 40), 3).unwrap();
    assert_finished(&out, FinishReason::Length, "the listed P");
    idle_and_free(ph);
    idle_and_free(&d.handle);
    // A bad entry is refused at start-up, naming the field.
    let bad = pdkv_connector::build(&consumer(r#","kv_peers":["10.0.0.0/40"]"#), "d-bad")
        .err()
        .expect("refused")
        .to_string();
    assert!(
        bad.contains("kv_peers") && bad.contains("10.0.0.0/40"),
        "{bad}"
    );
}
