//! Helpers shared by the connector's integration tests, at two levels.
//!
//! **Whole engines** ([`engine`]): a real engine on the tiny random llama,
//! always written with seed 7, so every engine of a test has the same
//! weights and a colocated engine's greedy tokens and logits bits
//! ([`fingerprint`]) are the reference a P/D pair must reproduce exactly.
//! Requests are greedy, ignore EOS and return logits ([`request`]).
//!
//! **Connector sides** ([`side`]): one connector built from its JSON
//! configuration and driven through the `KvConnector` calls an engine makes,
//! on a real registered KV region of [`BLOCKS`] blocks of [`BB`] bytes in its
//! own pool. P writes a per-block [`pattern`] before it finishes, so D can
//! check byte for byte what landed.
//!
//! Nothing sleeps to synchronise: every wait is on an event (a request's
//! stream, an engine's stats publication, a connector's waker) or a bounded
//! poll, and fails the test with what it saw when its deadline passes.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use pdkv_connector::params;
use pdkv_connector::wire::{self, Message};
use pdkv_engine::connector::{
    Allocated, ConnectorRequest, Ended, FinishedTransfers, KvCacheSpec, MetricsReader,
};
use pdkv_engine::{
    EngineConfig, EngineHandle, EngineRequest, FinishReason, KvConnector, RequestOutput,
    RequestStream, SamplingParams,
};
use pdkv_model::Arch;
use pdkv_transfer::auth::{self, KvSecret, Port};
use pdkv_vmem::{Pool, PoolOptions, Region, Tag};
use serde_json::{json, Value};

// ---- whole engines ----

/// Bound on engine waits that only depend on the engines making progress.
pub const WAIT: Duration = Duration::from_secs(60);

pub use pdkv_testkit::engine::{prompt, Started};

/// The tests' engine configuration: 8 sequences, 256 tokens a step, 64 KV
/// blocks, prefix caching on, sleep mode off. Tests change fields with
/// struct update syntax (`EngineConfig { num_kv_blocks: 16, ..config() }`).
pub fn config() -> EngineConfig {
    EngineConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 256,
        num_kv_blocks: 64,
        enable_prefix_caching: true,
        max_model_len: None,
        enable_sleep_mode: false,
        ..EngineConfig::default()
    }
}

/// An engine on the tiny random llama (the same weights every time), with
/// the connector built from `(json, engine_id)` when given.
pub fn engine(connector: Option<(&str, &str)>, config: EngineConfig) -> Started {
    let c = connector.map(|(cfg, id)| pdkv_connector::build(cfg, id).unwrap());
    engine_with(c, config)
}

/// [`engine`] with a connector built by the caller.
pub fn engine_with(connector: Option<Box<dyn KvConnector>>, config: EngineConfig) -> Started {
    start_on(Arch::Llama, connector, config).unwrap()
}

/// An engine on the tiny random model of `arch` (Qwen3's has heads of 32
/// dimensions, Llama's of 16), or why it could not start.
pub fn start_on(
    arch: Arch,
    connector: Option<Box<dyn KvConnector>>,
    config: EngineConfig,
) -> anyhow::Result<Started> {
    pdkv_testkit::engine::start(arch, connector, config)
}

/// A prefill engine: a producer connector with `extra` fields, [`config`].
pub fn p_engine(extra: &str, id: &str) -> Started {
    engine(Some((&producer(extra), id)), config())
}

/// A decode engine: a consumer connector with `extra` fields, [`config`].
pub fn d_engine(extra: &str, id: &str) -> Started {
    engine(Some((&consumer(extra), id)), config())
}

/// The reference engine: no connector, [`config`].
pub fn colocated() -> Started {
    engine(None, config())
}

/// A P/D producer connector configuration with `extra` fields (`,"k":v...`).
pub fn producer(extra: &str) -> String {
    format!(r#"{{"kv_connector":"pdkv","kv_role":"kv_producer"{extra}}}"#)
}

/// A P/D consumer connector configuration with `extra` fields (`,"k":v...`).
pub fn consumer(extra: &str) -> String {
    format!(r#"{{"kv_connector":"pdkv","kv_role":"kv_consumer"{extra}}}"#)
}

/// Four prompts with shared prefixes (the second and third start like the
/// first, so D has local prefix hits for them) and lengths that end inside
/// a block, past two blocks and below one block.
pub fn prefix_prompts() -> Vec<Vec<u32>> {
    let base = prompt(1, 40);
    vec![
        base.clone(),
        [&base[..32], &prompt(2, 9)[..]].concat(),
        [&base[..16], &prompt(3, 30)[..]].concat(),
        prompt(4, 5),
    ]
}

/// A greedy request that ignores EOS and returns its logits.
pub fn request(
    id: &str,
    tokens: Vec<u32>,
    max_tokens: u32,
    params: Option<Value>,
) -> EngineRequest {
    let sp = SamplingParams {
        temperature: 0.0,
        max_tokens,
        ignore_eos: true,
        return_logits: true,
        ..SamplingParams::default()
    };
    EngineRequest::new(id, tokens, sp).with_kv_transfer_params(params)
}

/// Adds [`request`] to `e`; the stream must be kept (dropping it aborts).
pub fn start(
    e: &EngineHandle,
    id: &str,
    tokens: Vec<u32>,
    max_tokens: u32,
    params: Option<Value>,
) -> RequestStream {
    e.add_request(request(id, tokens, max_tokens, params))
        .unwrap_or_else(|err| panic!("request {id} refused: {err}"))
}

/// Every output up to and including the final one.
pub fn collect(mut s: RequestStream) -> Vec<RequestOutput> {
    let mut out = Vec::new();
    while let Some(o) = s.blocking_next() {
        let last = o.finish_reason.is_some();
        out.push(o);
        if last {
            break;
        }
    }
    assert!(
        out.last().is_some_and(|o| o.finish_reason.is_some()),
        "stream ended without a final output"
    );
    out
}

/// Runs [`request`] on `e` to its end.
pub fn run(
    e: &EngineHandle,
    id: &str,
    tokens: Vec<u32>,
    max_tokens: u32,
    params: Option<Value>,
) -> Vec<RequestOutput> {
    collect(start(e, id, tokens, max_tokens, params))
}

/// The final output.
pub fn last(outs: &[RequestOutput]) -> &RequestOutput {
    outs.last().expect("at least the final output")
}

pub fn assert_finished(outs: &[RequestOutput], reason: FinishReason, what: &str) {
    let l = last(outs);
    assert_eq!(l.finish_reason, Some(reason), "{what}: {:?}", l.error);
}

/// The error of a request that ended with [`FinishReason::Error`].
pub fn error_of(outs: &[RequestOutput], what: &str) -> String {
    assert_finished(outs, FinishReason::Error, what);
    last(outs)
        .error
        .clone()
        .unwrap_or_else(|| panic!("{what}: an Error finish without a message"))
}

/// A request's tokens and the bits of its logits.
pub type Fingerprint = (Vec<u32>, Vec<Vec<u32>>);

pub fn fingerprint(outs: &[RequestOutput]) -> Fingerprint {
    let toks = outs.iter().flat_map(|o| o.token_ids.clone()).collect();
    let bits = outs
        .iter()
        .flat_map(|o| {
            o.logits
                .iter()
                .map(|r| r.iter().map(|x| x.to_bits()).collect())
        })
        .collect();
    (toks, bits)
}

/// The params of a P request that computes a prompt for a decode engine.
pub fn decode_params(transfer_id: &str) -> Value {
    params::for_prefill(transfer_id)
}

/// P's control address, from its connector's info.
pub fn bootstrap_addr(p: &EngineHandle) -> String {
    p.kv_connector_info().expect("P has a connector")["bootstrap_addr"]
        .as_str()
        .expect("a bootstrap address")
        .to_string()
}

/// The params a D request uses to load `transfer_id` from P (what P's final
/// output returns, written out before P finished).
pub fn pull_params(p: &EngineHandle, transfer_id: &str) -> Value {
    let info = p.kv_connector_info().expect("P has a connector");
    params::for_decode(
        transfer_id,
        info["engine_id"].as_str(),
        Some(&bootstrap_addr(p)),
    )
}

/// P computes `tokens` for a decode engine as request `id` under
/// `transfer_id`; returns the params its final output carries for D.
pub fn remote_prefill(p: &EngineHandle, id: &str, tokens: &[u32], transfer_id: &str) -> Value {
    let out = run(p, id, tokens.to_vec(), 1, Some(decode_params(transfer_id)));
    assert_finished(&out, FinishReason::Length, &format!("P request {id}"));
    last(&out)
        .kv_transfer_params
        .clone()
        .unwrap_or_else(|| panic!("P request {id} returned no transfer params"))
}

/// One P/D request under `transfer_id`: P computes `tokens` (request
/// `{transfer_id}-p`, which must succeed), D loads them and decodes
/// `max_tokens` (request `{transfer_id}-d`). D's outputs, or why D did not
/// finish by length.
pub fn pd(
    p: &EngineHandle,
    d: &EngineHandle,
    transfer_id: &str,
    tokens: &[u32],
    max_tokens: u32,
) -> Result<Vec<RequestOutput>, String> {
    let params = remote_prefill(p, &format!("{transfer_id}-p"), tokens, transfer_id);
    let dout = run(
        d,
        &format!("{transfer_id}-d"),
        tokens.to_vec(),
        max_tokens,
        Some(params),
    );
    let l = last(&dout);
    if l.finish_reason != Some(FinishReason::Length) {
        return Err(format!("D: {:?} {:?}", l.finish_reason, l.error));
    }
    Ok(dout)
}

/// The connector metric `name` of `e` now.
pub fn metric(e: &EngineHandle, name: &str) -> f64 {
    let all = e.kv_connector_metrics();
    all.iter()
        .find(|m| m.0 == name)
        .unwrap_or_else(|| panic!("no connector metric {name} in {all:?}"))
        .2
}

/// Waits until the connector metric `name` reads `value`. The predicate is
/// checked again at every stats publication of the engine's core, which
/// happens at least once per idle turn.
pub fn wait_metric(e: &EngineHandle, name: &str, value: f64, what: &str) {
    let ok = e.wait_stats(WAIT, |_| metric(e, name) == value);
    assert!(
        ok.is_some(),
        "{what}: {name} stayed {} (wanted {value})",
        metric(e, name)
    );
}

/// Waits (at most `within`) until the engine is idle with every block free
/// and none held for a transfer.
pub fn assert_idle(e: &EngineHandle, within: Duration, what: &str) {
    let ok = e.wait_stats(within, |s| {
        s.kv_blocks_free == s.kv_blocks_total
            && s.kv_blocks_held == 0
            && s.num_running == 0
            && s.num_waiting == 0
    });
    assert!(
        ok.is_some(),
        "{what}: not idle with all blocks free within {within:?}: {:?}",
        e.stats()
    );
}

/// [`assert_idle`] within [`WAIT`].
pub fn idle_and_free(e: &EngineHandle) {
    assert_idle(e, WAIT, "engine");
}

/// [`assert_idle`] within [`WAIT`] for each named engine.
pub fn all_idle(engines: &[(&EngineHandle, &str)]) {
    for (e, what) in engines {
        assert_idle(e, WAIT, what);
    }
}

// ---- connector sides ----

/// Blocks in a side's KV region.
pub const BLOCKS: usize = 32;
/// Bytes per block.
pub const BB: usize = 1024;
/// Bound on waits for a side's transfers.
pub const SIDE_WAIT: Duration = Duration::from_secs(10);

/// One connector with its registered KV region.
pub struct Side {
    pub c: Box<dyn KvConnector>,
    pub region: Arc<Region>,
    /// Signalled by the connector's waker.
    woke: mpsc::Receiver<()>,
    pub pool: Pool,
    pub metrics: MetricsReader,
}

/// The shape of a side's KV region: `blocks` blocks of [`BB`] bytes, in
/// memfd chunks of `chunk_size` bytes.
#[derive(Clone, Copy, Debug)]
pub struct Geometry {
    pub blocks: usize,
    pub chunk_size: usize,
}

/// [`BLOCKS`] blocks in chunks of 8 KiB (4 memfds).
pub const SMALL: Geometry = Geometry {
    blocks: BLOCKS,
    chunk_size: 8 << 10,
};

/// A `pdkv` connector of `role` over `transport` (`extra` fields appended to
/// its configuration) under `id`, with its [`SMALL`] KV region registered.
pub fn side(role: &str, transport: &str, id: &str, extra: &str) -> Side {
    side_with(role, transport, id, extra, SMALL).unwrap()
}

/// [`side`] with a KV region of `geometry`; the error is the connector's
/// refusal to register it.
pub fn side_with(
    role: &str,
    transport: &str,
    id: &str,
    extra: &str,
    geometry: Geometry,
) -> anyhow::Result<Side> {
    let cfg =
        format!(r#"{{"kv_connector":"pdkv","kv_role":"{role}","transport":"{transport}"{extra}}}"#);
    let mut c = pdkv_connector::build(&cfg, id).unwrap();
    let pool = Pool::new(PoolOptions {
        chunk_size: geometry.chunk_size,
        single_allocation: false,
    });
    let region = pool.allocate(Tag::KvCache, geometry.blocks * BB).unwrap();
    let (tx, woke) = mpsc::channel();
    let tx = Mutex::new(tx);
    c.set_waker(Arc::new(move || {
        let _ = tx.lock().unwrap().send(());
    }));
    let spec = KvCacheSpec::single(region.clone(), geometry.blocks, BB, 16, "test-layout");
    c.register_kv_caches(&spec)?;
    let metrics = c.metrics_reader().expect("the connector has metrics");
    Ok(Side {
        c,
        region,
        woke,
        pool,
        metrics,
    })
}

impl Side {
    /// Polls `get_finished` (after each wake) until `pred` holds for all
    /// that finished since the call; returns that.
    pub fn wait_finished(
        &mut self,
        mut pred: impl FnMut(&FinishedTransfers) -> bool,
    ) -> FinishedTransfers {
        let deadline = Instant::now() + SIDE_WAIT;
        let mut all = FinishedTransfers::default();
        loop {
            let f = self.c.get_finished();
            all.sending.extend(f.sending);
            all.recving.extend(f.recving);
            if pred(&all) {
                return all;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "timed out waiting; got {all:?}");
            let _ = self.woke.recv_timeout(left);
        }
    }

    /// Whether the connector called its waker since the last call (drains
    /// the wakes).
    pub fn drain_wakes(&self) -> bool {
        let mut any = false;
        while self.woke.try_recv().is_ok() {
            any = true;
        }
        any
    }

    /// The bytes of block `b` of the region.
    pub fn block(&self, b: u32) -> Vec<u8> {
        let mut v = vec![0; BB];
        self.region.read_bytes(b as usize * BB, &mut v).unwrap();
        v
    }

    /// The connector metric `name` now.
    pub fn gauge(&self, name: &str) -> f64 {
        (self.metrics)()
            .into_iter()
            .find(|m| m.0 == name)
            .unwrap_or_else(|| panic!("no metric {name}"))
            .2
    }

    /// The epoch of the region's current registration.
    pub fn epoch(&self) -> u64 {
        self.c.info()["registration_epoch"]
            .as_u64()
            .expect("registered")
    }

    /// Live bytes of the pool's KV memory.
    pub fn kv_device_bytes(&self) -> u64 {
        self.pool.device_bytes().get(Tag::KvCache)
    }
}

/// Waits (yielding, bounded by [`SIDE_WAIT`]) until `cond` holds; `what`
/// names it on failure.
pub fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < SIDE_WAIT, "{what}: not within {SIDE_WAIT:?}");
        std::thread::yield_now();
    }
}

/// The bytes P writes into its block `block`.
pub fn pattern(block: u32) -> Vec<u8> {
    (0..BB)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(block * 7) as u8)
        .collect()
}

pub fn req<'a>(id: &'a Arc<str>, prompt: &'a [u32], params: &'a Value) -> ConnectorRequest<'a> {
    ConnectorRequest {
        cache_salt: None,
        id,
        prompt_tokens: prompt,
        kv_transfer_params: Some(params),
    }
}

/// P admits the request `rid` of `len` tokens for `tid` (WAITING).
pub fn admit(p: &mut Side, rid: &str, tid: &str, len: usize) {
    let id: Arc<str> = Arc::from(rid);
    let prompt = vec![1u32; len];
    let params = decode_params(tid);
    assert_eq!(
        p.c.get_num_new_matched_tokens(req(&id, &prompt, &params), 0)
            .num_tokens,
        0
    );
}

/// P's request ends for `reason` with its KV in `p_blocks` (each holding
/// its [`pattern`]); returns the connector's answer (held, params).
pub fn finish_with(
    p: &mut Side,
    rid: &str,
    tid: &str,
    len: usize,
    p_blocks: &[u32],
    reason: FinishReason,
) -> (bool, Option<Value>) {
    for &b in p_blocks {
        p.region.write_bytes(b as usize * BB, &pattern(b)).unwrap();
    }
    let id: Arc<str> = Arc::from(rid);
    let prompt = vec![1u32; len];
    let params = decode_params(tid);
    p.c.request_finished(req(&id, &prompt, &params), Ended::new(p_blocks, reason))
}

/// P's request finishes normally; returns whether P holds the blocks.
pub fn finish(p: &mut Side, rid: &str, tid: &str, len: usize, p_blocks: &[u32]) -> bool {
    finish_with(p, rid, tid, len, p_blocks, FinishReason::Length).0
}

/// P computes a prompt of `len` tokens into `p_blocks` and holds it for D
/// (READY); returns D's params.
pub fn prefill(p: &mut Side, rid: &str, tid: &str, len: usize, p_blocks: &[u32]) -> Value {
    admit(p, rid, tid, len);
    assert!(
        finish(p, rid, tid, len, p_blocks),
        "P holds the blocks for D"
    );
    d_params(p, tid)
}

/// The params a D request uses to load `tid` from `p`.
pub fn d_params(p: &Side, tid: &str) -> Value {
    let info = p.c.info();
    json!({"do_remote_prefill": true, "remote_engine_id": info["engine_id"], "remote_bootstrap_addr": info["bootstrap_addr"], "transfer_id": tid})
}

/// D admits the request with `computed` local tokens and decides its load
/// of the rest (but the last token) into `d_blocks`; returns the tokens to
/// load.
pub fn decide_load(
    d: &mut Side,
    rid: &str,
    len: usize,
    computed: usize,
    d_blocks: &[u32],
    params: &Value,
) -> usize {
    let id: Arc<str> = Arc::from(rid);
    let prompt = vec![1u32; len];
    let m =
        d.c.get_num_new_matched_tokens(req(&id, &prompt, params), computed);
    assert!(m.load_async);
    assert_eq!(m.num_tokens, len - 1 - computed);
    d.c.update_state_after_alloc(
        req(&id, &prompt, params),
        Allocated::new(d_blocks, computed, m.num_tokens),
    );
    m.num_tokens
}

/// D starts the loads it decided (the step's metadata to the worker side).
pub fn start_loads(d: &mut Side) {
    let meta = d.c.build_connector_meta();
    d.c.start_load_kv(meta);
}

/// P admits `p_rid` (40 tokens) for `tid` and D starts loading it as
/// `d_rid` into `d_blocks`; returns D's params.
pub fn start_pull(
    p: &mut Side,
    d: &mut Side,
    p_rid: &str,
    tid: &str,
    d_rid: &str,
    d_blocks: &[u32],
) -> Value {
    admit(p, p_rid, tid, 40);
    let params = d_params(p, tid);
    decide_load(d, d_rid, 40, 0, d_blocks, &params);
    start_loads(d);
    params
}

/// Waits until a pull (from [`start_pull`]) is parked on P (P's request
/// still runs).
pub fn wait_parked(p: &Side) {
    wait_until("D's pull reaches P", || p.gauge("pulls_pending") >= 1.0);
}

/// D loads `params` as `rid` (40 tokens, nothing local) into `d_blocks`
/// and the load fails for every block; returns the errors and how long the
/// load took from its start.
pub fn failed_load(
    d: &mut Side,
    rid: &str,
    d_blocks: &[u32],
    params: &Value,
) -> (Vec<(u32, String)>, Duration) {
    let t0 = Instant::now();
    decide_load(d, rid, 40, 0, d_blocks, params);
    start_loads(d);
    d.wait_finished(|f| f.recving.iter().any(|r| &**r == rid));
    let took = t0.elapsed();
    let errs = load_errors(d);
    assert_eq!(
        errs.len(),
        d_blocks.len(),
        "load {rid}: every block fails: {errs:?}"
    );
    (errs, took)
}

/// The load errors a side reports now, as their messages.
pub fn load_errors(d: &mut Side) -> Vec<(u32, String)> {
    d.c.get_block_ids_with_load_errors()
        .into_iter()
        .map(|(b, e)| (b, e.message))
        .collect()
}

/// The answer to a bootstrap from the engine `engine_id` with the sides'
/// layout and block size.
pub fn bootstrap_ok(engine_id: &str) -> Message {
    Message::BootstrapOk {
        engine_id: engine_id.into(),
        layout: "test-layout".into(),
        block_bytes: BB as u64,
    }
}

/// A control connection to `addr`, through the handshake (no secret).
pub fn control(addr: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    auth::connect_blocking(
        &mut s,
        &KvSecret::open(),
        Port::Control,
        Duration::from_secs(10),
    )
    .expect("control handshake");
    s
}

/// The server's side of the control handshake, on a connection accepted by
/// a stand-in engine.
pub fn accept_control(s: &mut TcpStream) {
    auth::accept_blocking(s, &KvSecret::open(), Port::Control, Duration::from_secs(10))
        .expect("the peer's handshake");
}

/// Writes one control message to `s`.
pub fn send_msg(s: &mut TcpStream, m: &Message) {
    s.write_all(&wire::encode(m).unwrap()).unwrap();
}

/// Reads one control message from `s`.
pub fn recv_msg(s: &mut TcpStream) -> Message {
    let mut n = [0u8; 4];
    s.read_exact(&mut n).unwrap();
    let mut body = vec![0; wire::decode_len(n).unwrap()];
    s.read_exact(&mut body).unwrap();
    wire::decode_body(&body).unwrap()
}

/// A full 40-token transfer (blocks 0..3 of the request) that must succeed;
/// checks the bytes landed in D's region and nothing stays held.
pub fn transfer_ok(p: &mut Side, d: &mut Side, tag: &str, p_blocks: [u32; 3], d_blocks: [u32; 3]) {
    let params = prefill(p, &format!("p-{tag}"), tag, 40, &p_blocks);
    decide_load(d, &format!("d-{tag}"), 40, 0, &d_blocks, &params);
    start_loads(d);
    d.wait_finished(|f| f.recving.len() == 1);
    assert_eq!(
        d.c.get_block_ids_with_load_errors(),
        vec![],
        "transfer {tag}"
    );
    for (pb, db) in p_blocks.into_iter().zip(d_blocks) {
        assert_eq!(d.block(db), pattern(pb), "transfer {tag}: D block {db}");
    }
    p.wait_finished(|f| f.sending.len() == 1);
    assert_eq!((p.c.num_held_blocks(), d.c.num_held_blocks()), (0, 0));
}

/// D's outputs equal a colocated run of the same prompt: tokens and logits bits.
pub fn assert_matches_colocated(
    colo: &EngineHandle,
    outs: &[RequestOutput],
    tokens: &[u32],
    max_tokens: u32,
    what: &str,
) {
    assert_finished(outs, FinishReason::Length, what);
    let c = run(
        colo,
        &format!("colo-{what}"),
        tokens.to_vec(),
        max_tokens,
        None,
    );
    let (got, want) = (fingerprint(outs), fingerprint(&c));
    assert_eq!(
        got.0, want.0,
        "{what}: tokens differ from the colocated run"
    );
    assert!(
        got.1 == want.1,
        "{what}: logits differ from the colocated run"
    );
}
