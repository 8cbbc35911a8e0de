//! `--kv-transfer-config` parsing: good configs parse with their defaults,
//! and each bad field is named in the error.

use std::time::Duration;

use pdkv_connector::config::{KvRole, KvTransferConfig, TransferMode, Transport};
use pdkv_engine::LoadFailurePolicy;

#[test]
fn a_minimal_config_gets_the_defaults() {
    let c = KvTransferConfig::parse(r#"{"kv_connector":"pdkv","kv_role":"kv_producer"}"#).unwrap();
    assert_eq!(c.kv_role, KvRole::KvProducer);
    assert_eq!(
        (c.transport, c.transfer_mode),
        (Transport::Tcp, TransferMode::Write)
    );
    assert_eq!(
        (c.kv_ip.as_str(), c.kv_port, c.num_workers),
        ("127.0.0.1", 0, 4)
    );
    assert_eq!(c.abort_timeout, Duration::from_secs(30));
    assert_eq!(c.load_timeout, Duration::from_secs(40));
    assert_eq!(c.arrival_timeout, Duration::from_secs(10));
    assert_eq!(c.unproven_timeout, Duration::from_secs(10));
    assert_eq!(c.kv_load_failure_policy, LoadFailurePolicy::Fail);
    assert_eq!(c.shm_dir, std::env::temp_dir());
}

#[test]
fn a_full_config_parses() {
    let c = KvTransferConfig::parse(
        r#"{"kv_connector":"pdkv","kv_role":"kv_both","transport":"shm","transfer_mode":"read",
            "kv_ip":"0.0.0.0","kv_port":7000,"num_workers":2,"abort_timeout_s":0.5,
            "load_timeout_s":1.5,"arrival_timeout_s":0.25,"kv_load_failure_policy":"recompute",
            "shm_dir":"/run/pdkv","kv_unproven_timeout_s":2.5}"#,
    )
    .unwrap();
    assert_eq!(
        (c.kv_role, c.transport, c.transfer_mode),
        (KvRole::KvBoth, Transport::Shm, TransferMode::Read)
    );
    assert_eq!(
        (c.kv_ip.as_str(), c.kv_port, c.num_workers),
        ("0.0.0.0", 7000, 2)
    );
    assert_eq!(c.abort_timeout, Duration::from_millis(500));
    assert_eq!(c.load_timeout, Duration::from_millis(1500));
    assert_eq!(c.arrival_timeout, Duration::from_millis(250));
    assert_eq!(c.unproven_timeout, Duration::from_millis(2500));
    assert_eq!(c.kv_load_failure_policy, LoadFailurePolicy::Recompute);
    assert_eq!(c.shm_dir, std::path::PathBuf::from("/run/pdkv"));
    // load_timeout_s defaults to abort_timeout_s + 10.
    let c = KvTransferConfig::parse(
        r#"{"kv_connector":"pdkv","kv_role":"kv_consumer","abort_timeout_s":2}"#,
    )
    .unwrap();
    assert_eq!(c.load_timeout, Duration::from_secs(12));
}

#[test]
fn each_bad_field_is_named() {
    let base = r#""kv_connector":"pdkv","kv_role":"kv_consumer""#;
    let cases: Vec<(String, &str, &[&str])> = vec![
        (
            r#"{"kv_connector":"pdkv","kv_role":"kv_prod"}"#.into(),
            "kv_role",
            &[
                "unknown variant `kv_prod`",
                "kv_producer",
                "kv_consumer",
                "kv_both",
            ],
        ),
        (
            r#"{"kv_role":"kv_consumer"}"#.into(),
            "kv_connector",
            &["missing field `kv_connector`"],
        ),
        (
            r#"{"kv_connector":"pdkv"}"#.into(),
            "kv_role",
            &["missing field `kv_role`"],
        ),
        (
            r#"{"kv_connector":"nixl","kv_role":"kv_consumer"}"#.into(),
            "kv_connector",
            &["\"nixl\""],
        ),
        (
            format!(r#"{{{base},"transport":"rdma"}}"#),
            "transport",
            &["rdma"],
        ),
        (
            format!(r#"{{{base},"transfer_mode":"push"}}"#),
            "transfer_mode",
            &["push"],
        ),
        (
            format!(r#"{{{base},"kv_ip":"localhost"}}"#),
            "kv_ip",
            &["not an IP address"],
        ),
        (
            format!(r#"{{{base},"kv_port":70000}}"#),
            "kv_port",
            &["70000"],
        ),
        (
            format!(r#"{{{base},"num_workers":0}}"#),
            "num_workers",
            &["at least 1"],
        ),
        (
            format!(r#"{{{base},"abort_timeout_s":-1}}"#),
            "abort_timeout_s",
            &["positive"],
        ),
        (
            format!(r#"{{{base},"abort_timeout_s":"30"}}"#),
            "abort_timeout_s",
            &["invalid type"],
        ),
        (
            format!(r#"{{{base},"abort_timeout_s":5,"load_timeout_s":5}}"#),
            "load_timeout_s",
            &["load_timeout_s (5)", "abort_timeout_s (5)"],
        ),
        (
            format!(r#"{{{base},"arrival_timeout_s":0}}"#),
            "arrival_timeout_s",
            &["positive"],
        ),
        (
            format!(r#"{{{base},"kv_unproven_timeout_s":-1}}"#),
            "kv_unproven_timeout_s",
            &["positive"],
        ),
        (
            format!(r#"{{{base},"kv_load_failure_policy":"retry"}}"#),
            "kv_load_failure_policy",
            &["retry", "fail", "recompute"],
        ),
        (
            format!(r#"{{{base},"kv_buffer_size":1}}"#),
            "kv_buffer_size",
            &["unknown field `kv_buffer_size`"],
        ),
    ];
    for (json, field, needles) in cases {
        let e = KvTransferConfig::parse(&json).expect_err(&json);
        assert_eq!(e.field, field, "{json}: {e}");
        let msg = e.to_string();
        assert!(
            msg.starts_with(&format!("kv_transfer_config: {field}: ")),
            "{msg}"
        );
        for n in needles {
            assert!(msg.contains(n), "{msg:?} lacks {n:?}");
        }
    }
    assert!(KvTransferConfig::parse("not json").is_err());
}

#[test]
fn build_takes_read_mode_refuses_bad_configs_and_reports_its_addresses() {
    let c = pdkv_connector::build(
        r#"{"kv_connector":"pdkv","kv_role":"kv_consumer","transfer_mode":"read"}"#,
        "d1",
    )
    .unwrap();
    assert_eq!(c.info()["transfer_mode"], "read");
    let e = pdkv_connector::build(r#"{"kv_connector":"pdkv","kv_role":"kv_prod"}"#, "p1")
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.starts_with("kv_transfer_config: kv_role: unknown variant `kv_prod`"),
        "{e}"
    );

    let c =
        pdkv_connector::build(r#"{"kv_connector":"pdkv","kv_role":"kv_producer"}"#, "p1").unwrap();
    let info = c.info();
    assert_eq!(info["engine_id"], "p1");
    assert_eq!(info["kv_role"], "kv_producer");
    assert_eq!(info["transport"], "tcp");
    assert_eq!(info["transfer_mode"], "write");
    let boot: std::net::SocketAddr = info["bootstrap_addr"].as_str().unwrap().parse().unwrap();
    assert_ne!(boot.port(), 0, "the control listener is bound in build");
    assert!(std::net::TcpStream::connect(boot).is_ok());
    let xfer: std::net::SocketAddr = info["transfer_addr"].as_str().unwrap().parse().unwrap();
    assert_ne!(xfer.port(), 0);
    assert!(c.supports_sleep_mode());
    assert_eq!(info["supports_sleep_mode"], true);
    assert_eq!(
        info["registration_epoch"],
        serde_json::Value::Null,
        "nothing registered before register_kv_caches"
    );
}

#[test]
fn params_are_validated_naming_the_bad_field() {
    let p =
        pdkv_connector::build(r#"{"kv_connector":"pdkv","kv_role":"kv_producer"}"#, "p1").unwrap();
    let d =
        pdkv_connector::build(r#"{"kv_connector":"pdkv","kv_role":"kv_consumer"}"#, "d1").unwrap();
    let v = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap();
    assert!(p.validate_params(None).is_ok());
    assert!(p
        .validate_params(Some(&v(r#"{"do_remote_decode":true,"transfer_id":"x"}"#)))
        .is_ok());
    assert!(
        d.validate_params(Some(&v(r#"{"other":1}"#))).is_ok(),
        "no flag: untouched"
    );
    let good_d = r#"{"do_remote_prefill":true,"remote_engine_id":"p1","remote_bootstrap_addr":"127.0.0.1:5","transfer_id":"x"}"#;
    assert!(d.validate_params(Some(&v(good_d))).is_ok());
    assert!((d.params_validator())(Some(&v(good_d))).is_ok());
    let cases: [(&dyn pdkv_engine::KvConnector, &str, &str); 8] = [
        (
            &*p,
            r#"{"do_remote_decode":"yes","transfer_id":"x"}"#,
            "do_remote_decode must be a boolean",
        ),
        (
            &*p,
            r#"{"do_remote_decode":true}"#,
            "transfer_id is required",
        ),
        (
            &*p,
            r#"{"do_remote_decode":true,"transfer_id":7}"#,
            "transfer_id must be a string",
        ),
        (&*p, r#"[1]"#, "must be a JSON object"),
        (
            &*d,
            r#"{"do_remote_prefill":true,"remote_bootstrap_addr":"127.0.0.1:5","transfer_id":"x"}"#,
            "remote_engine_id is required",
        ),
        (
            &*d,
            r#"{"do_remote_prefill":true,"remote_engine_id":"p","remote_bootstrap_addr":"nowhere","transfer_id":"x"}"#,
            "remote_bootstrap_addr",
        ),
        (
            &*d,
            r#"{"do_remote_decode":true,"transfer_id":"x"}"#,
            "kv_consumer and sends no KV",
        ),
        (&*p, good_d, "kv_producer and receives no KV"),
    ];
    for (c, params, needle) in cases {
        let e = c.validate_params(Some(&v(params))).expect_err(params);
        assert!(e.contains(needle), "{e:?} lacks {needle:?}");
        let e2 = (c.params_validator())(Some(&v(params))).expect_err(params);
        assert_eq!(e, e2);
    }
}
