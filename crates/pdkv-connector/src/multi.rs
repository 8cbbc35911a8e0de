//! The multi-connector (`"kv_connector": "multi"`): several connectors
//! behind one, e.g. P/D transfer plus a host-memory offload tier.
//!
//! Rules:
//! - At admission every child is asked, in order; the first that offers
//!   tokens serves the request (it gets the real `update_state_after_alloc`,
//!   the others one with no external tokens, so they drop what they noted).
//! - A finished request goes to every child. Its blocks stay held while any
//!   child holds them: the request is named in `get_finished` once every
//!   child that kept its blocks has named it (in either list). A child's
//!   report about a held request it did not keep is swallowed, so that it
//!   cannot free blocks another child still uses.
//! - Sleep mode only when every child supports it; lifecycle calls
//!   (release, restore, abort, reset) go to every child. Release is all or
//!   nothing (a child that refuses makes the ones before it register
//!   again); restore is attempted on all children even after one failed.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use pdkv_engine::connector::{
    Allocated, ConnectorMeta, ConnectorRequest, Ended, ExternalMatch, FinishedTransfers,
    KvCacheSpec, KvTransferParams, LoadError, LoadFailurePolicy, MetricsReader, ParamsValidator,
    Waker,
};
use pdkv_engine::KvConnector;
use serde::Deserialize;
use serde_json::json;

use crate::config::ConfigError;

/// The connector name that selects this connector.
pub const CONNECTOR_NAME: &str = "multi";

/// Most children a multi-connector takes.
pub const MAX_CHILDREN: usize = 4;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    kv_connector: String,
    connectors: Vec<serde_json::Value>,
}

/// A child's configuration error, reported under `connectors[i]`.
fn child_error(i: usize, e: anyhow::Error) -> anyhow::Error {
    match e.downcast::<ConfigError>() {
        Ok(c) => ConfigError {
            field: format!("connectors[{i}].{}", c.field),
            message: c.message,
        }
        .into(),
        Err(e) => e.context(format!("kv_transfer_config: connectors[{i}]")),
    }
}

/// Metric names made unique by a prefix, leaked once each (the set of
/// names is small and fixed), so readers can hand out `&'static str`.
fn intern(name: String) -> &'static str {
    static NAMES: OnceLock<Mutex<HashSet<&'static str>>> = OnceLock::new();
    let mut names = NAMES.get_or_init(Default::default).lock().unwrap();
    if let Some(n) = names.get(name.as_str()) {
        return n;
    }
    let leaked: &'static str = Box::leak(name.into_boxed_str());
    names.insert(leaked);
    leaked
}

/// See the module docs.
pub struct MultiConnector {
    children: Vec<Box<dyn KvConnector>>,
    /// Each child's `kv_connector` name, for metric prefixes.
    kinds: Vec<String>,
    /// The child serving each request admitted with external tokens.
    winner: HashMap<Arc<str>, usize>,
    /// Finished requests whose blocks some children keep: which ones.
    holders: HashMap<Arc<str>, BTreeSet<usize>>,
}

impl MultiConnector {
    /// Builds the children of `{"kv_connector":"multi","connectors":[...]}`
    /// with [`crate::build`]; an error names the field, under
    /// `connectors[i]` for a child's.
    pub fn from_json(
        json: &str,
        engine_id: &str,
        secret: &pdkv_transfer::auth::KvSecret,
    ) -> anyhow::Result<MultiConnector> {
        let raw: Raw = crate::config::parse_fields(json)?;
        if raw.kv_connector != CONNECTOR_NAME {
            return Err(ConfigError {
                field: "kv_connector".into(),
                message: format!("expected {CONNECTOR_NAME:?}, got {:?}", raw.kv_connector),
            }
            .into());
        }
        if raw.connectors.is_empty() || raw.connectors.len() > MAX_CHILDREN {
            return Err(ConfigError {
                field: "connectors".into(),
                message: format!(
                    "takes 1 to {MAX_CHILDREN} connectors, got {}",
                    raw.connectors.len()
                ),
            }
            .into());
        }
        let mut children = Vec::new();
        let mut kinds = Vec::new();
        for (i, child) in raw.connectors.iter().enumerate() {
            let kind = child
                .get("kv_connector")
                .and_then(|k| k.as_str())
                .unwrap_or_default()
                .to_string();
            children.push(
                crate::build_with_secret(&child.to_string(), engine_id, secret)
                    .map_err(|e| child_error(i, e))?,
            );
            kinds.push(kind);
        }
        Ok(MultiConnector::new(children, kinds))
    }

    /// A multi-connector over built children; `kinds` names them in metrics.
    pub fn new(children: Vec<Box<dyn KvConnector>>, kinds: Vec<String>) -> MultiConnector {
        assert_eq!(children.len(), kinds.len(), "one kind per child");
        MultiConnector {
            children,
            kinds,
            winner: HashMap::new(),
            holders: HashMap::new(),
        }
    }

    /// Metric names for child `i`: its own names where no other child uses
    /// them, else prefixed with its kind (and index if kinds repeat).
    fn metric_prefixes(&self, names: &[Vec<&'static str>]) -> Vec<Option<String>> {
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for n in names.iter().flat_map(|v| v.iter().collect::<HashSet<_>>()) {
            *seen.entry(n).or_default() += 1;
        }
        let clash = |i: usize| names[i].iter().any(|n| seen[n] > 1);
        (0..self.children.len())
            .map(|i| {
                clash(i).then(|| {
                    let kind = &self.kinds[i];
                    if self.kinds.iter().filter(|k| *k == kind).count() > 1 {
                        format!("{kind}{i}_")
                    } else {
                        format!("{kind}_")
                    }
                })
            })
            .collect()
    }
}

impl KvConnector for MultiConnector {
    fn name(&self) -> &str {
        CONNECTOR_NAME
    }

    fn supports_sleep_mode(&self) -> bool {
        self.children.iter().all(|c| c.supports_sleep_mode())
    }

    /// The children's infos; the first child with a bootstrap address (the
    /// P/D one) also lends its fields to the top level, so a proxy reads a
    /// multi-connector's P like any other.
    fn info(&self) -> serde_json::Value {
        let children: Vec<serde_json::Value> = self.children.iter().map(|c| c.info()).collect();
        let mut info = serde_json::Map::new();
        if let Some(serde_json::Value::Object(pd)) =
            children.iter().find(|c| c.get("bootstrap_addr").is_some())
        {
            info.extend(pd.clone());
        }
        info.insert("kv_connector".into(), json!(CONNECTOR_NAME));
        info.insert("connectors".into(), json!(children));
        serde_json::Value::Object(info)
    }

    fn validate_params(&self, params: Option<&KvTransferParams>) -> Result<(), String> {
        self.children
            .iter()
            .try_for_each(|c| c.validate_params(params))
    }

    fn params_validator(&self) -> ParamsValidator {
        let all: Vec<ParamsValidator> =
            self.children.iter().map(|c| c.params_validator()).collect();
        Arc::new(move |p| all.iter().try_for_each(|v| v(p)))
    }

    fn metrics_reader(&self) -> Option<MetricsReader> {
        let readers: Vec<Option<MetricsReader>> =
            self.children.iter().map(|c| c.metrics_reader()).collect();
        if readers.iter().all(Option::is_none) {
            return None;
        }
        // Which names clash is fixed by the children: decide it once.
        let names: Vec<Vec<&'static str>> = readers
            .iter()
            .map(|r| {
                r.as_ref()
                    .map(|r| r().into_iter().map(|m| m.0).collect())
                    .unwrap_or_default()
            })
            .collect();
        let prefixes = self.metric_prefixes(&names);
        Some(Arc::new(move || {
            let mut out = Vec::new();
            for (r, prefix) in readers.iter().zip(&prefixes) {
                let Some(r) = r else { continue };
                for (name, help, value) in r() {
                    let name = match prefix {
                        Some(p) => intern(format!("{p}{name}")),
                        None => name,
                    };
                    out.push((name, help, value));
                }
            }
            out
        }))
    }

    fn set_waker(&mut self, waker: Waker) {
        for c in &mut self.children {
            c.set_waker(waker.clone());
        }
    }

    fn load_failure_policy(&self) -> LoadFailurePolicy {
        self.children[0].load_failure_policy()
    }

    fn get_num_new_matched_tokens(
        &mut self,
        req: ConnectorRequest<'_>,
        num_computed_tokens: usize,
    ) -> ExternalMatch {
        self.winner.remove(req.id);
        let mut best = ExternalMatch::default();
        // Every child is asked (some note the request's arrival); the first
        // offer wins.
        for (i, c) in self.children.iter_mut().enumerate() {
            let m = c.get_num_new_matched_tokens(req, num_computed_tokens);
            if best.num_tokens == 0 && m.num_tokens > 0 {
                best = m;
                self.winner.insert(req.id.clone(), i);
            }
        }
        best
    }

    fn update_state_after_alloc(&mut self, req: ConnectorRequest<'_>, alloc: Allocated<'_>) {
        let winner = self.winner.remove(req.id);
        for (i, c) in self.children.iter_mut().enumerate() {
            let num_external_tokens = if winner == Some(i) {
                alloc.num_external_tokens
            } else {
                0
            };
            c.update_state_after_alloc(
                req,
                Allocated {
                    num_external_tokens,
                    ..alloc
                },
            );
        }
    }

    fn request_added(&mut self, req: ConnectorRequest<'_>) {
        for c in &mut self.children {
            c.request_added(req);
        }
    }

    fn build_connector_meta(&mut self) -> ConnectorMeta {
        let metas: Vec<ConnectorMeta> = self
            .children
            .iter_mut()
            .map(|c| c.build_connector_meta())
            .collect();
        ConnectorMeta(Box::new(metas))
    }

    fn request_finished(
        &mut self,
        req: ConnectorRequest<'_>,
        end: Ended<'_>,
    ) -> (bool, Option<KvTransferParams>) {
        self.winner.remove(req.id);
        let mut keep = BTreeSet::new();
        let mut params = None;
        for (i, c) in self.children.iter_mut().enumerate() {
            let (delay, p) = c.request_finished(req, end);
            if delay {
                keep.insert(i);
            }
            if params.is_none() {
                params = p;
            }
        }
        let delay = !keep.is_empty();
        if delay {
            self.holders.insert(req.id.clone(), keep);
        }
        (delay, params)
    }

    fn update_connector_output(&mut self, finished: &FinishedTransfers) {
        for c in &mut self.children {
            c.update_connector_output(finished);
        }
    }

    fn reset_cache(&mut self) -> bool {
        // Every child resets, even after one could not.
        let mut ok = true;
        for c in &mut self.children {
            ok &= c.reset_cache();
        }
        ok
    }

    fn abort_transfers(&mut self) {
        for c in &mut self.children {
            c.abort_transfers();
        }
    }

    /// The largest child count: children hold the same blocks (a request's
    /// table), so their counts overlap.
    fn num_held_blocks(&self) -> usize {
        self.children
            .iter()
            .map(|c| c.num_held_blocks())
            .max()
            .unwrap_or(0)
    }

    /// Every child is asked (they hold the same blocks, so a block comes
    /// back once each child that held it let go): the largest count.
    fn reclaim_held_blocks(&mut self, blocks: usize) -> usize {
        self.children
            .iter_mut()
            .map(|c| c.reclaim_held_blocks(blocks))
            .max()
            .unwrap_or(0)
    }

    fn register_kv_caches(&mut self, spec: &KvCacheSpec) -> anyhow::Result<()> {
        for (i, c) in self.children.iter_mut().enumerate() {
            c.register_kv_caches(spec)
                .map_err(|e| e.context(format!("connector {i} ({})", self.kinds[i])))?;
        }
        Ok(())
    }

    fn start_load_kv(&mut self, meta: ConnectorMeta) {
        let Ok(metas) = meta.0.downcast::<Vec<ConnectorMeta>>() else {
            tracing::error!("the multi-connector was handed another connector's metadata");
            return;
        };
        for (c, m) in self.children.iter_mut().zip(*metas) {
            c.start_load_kv(m);
        }
    }

    fn wait_for_save(&mut self) {
        for c in &mut self.children {
            c.wait_for_save();
        }
    }

    fn get_finished(&mut self) -> FinishedTransfers {
        let mut out = FinishedTransfers::default();
        let mut reported: HashSet<Arc<str>> = HashSet::new();
        for (i, c) in self.children.iter_mut().enumerate() {
            let f = c.get_finished();
            // A given-up load belongs to a live request: passed on as is.
            out.abandoned.extend(f.abandoned);
            for (ids, sending) in [(f.sending, true), (f.recving, false)] {
                for id in ids {
                    let pass = match self.holders.get_mut(&id) {
                        // Not held: a live request's load, passed on as is.
                        None => true,
                        Some(held) => {
                            if !held.remove(&i) {
                                tracing::debug!(id = %id, child = i, "report about a request this child does not hold; ignored");
                                false
                            } else if held.is_empty() {
                                self.holders.remove(&id);
                                true
                            } else {
                                false
                            }
                        }
                    };
                    if pass && reported.insert(id.clone()) {
                        if sending {
                            out.sending.push(id);
                        } else {
                            out.recving.push(id);
                        }
                    }
                }
            }
        }
        out
    }

    fn get_block_ids_with_load_errors(&mut self) -> Vec<(u32, LoadError)> {
        self.children
            .iter_mut()
            .flat_map(|c| c.get_block_ids_with_load_errors())
            .collect()
    }

    fn set_weights_version(&mut self, version: Option<&str>) {
        for c in &mut self.children {
            c.set_weights_version(version);
        }
    }

    /// All or nothing: when a child refuses, the children that released
    /// already register again, so the connectors stay in one state that a
    /// retry moves on from.
    fn release_kv_caches(&mut self, timeout: Duration) -> anyhow::Result<()> {
        for i in 0..self.children.len() {
            let Err(e) = self.children[i].release_kv_caches(timeout) else {
                continue;
            };
            tracing::error!(child = i, error = %format!("{e:#}"), "a child connector failed to release the KV cache; undoing the others");
            let mut e = e.context(format!("connector {i} ({})", self.kinds[i]));
            for (j, c) in self.children[..i].iter_mut().enumerate() {
                if let Err(r) = c.restore_kv_caches() {
                    e = e.context(format!(
                        "and connector {j} ({}) could not register again: {r:#}",
                        self.kinds[j]
                    ));
                }
            }
            return Err(e);
        }
        Ok(())
    }

    fn restore_kv_caches(&mut self) -> anyhow::Result<()> {
        let mut first = Ok(());
        for (i, c) in self.children.iter_mut().enumerate() {
            if let Err(e) = c.restore_kv_caches() {
                tracing::error!(child = i, error = %format!("{e:#}"), "a child connector failed to restore the KV cache");
                if first.is_ok() {
                    first = Err(e.context(format!("connector {i} ({})", self.kinds[i])));
                }
            }
        }
        first
    }
}

#[cfg(test)]
mod tests {
    //! The multi-connector's routing, with scripted children: each child
    //! answers what its script says and logs the calls it got.

    use super::*;
    use pdkv_engine::FinishReason;

    #[derive(Default)]
    struct Script {
        sleep: bool,
        offer: usize,
        keep: bool,
        params: Option<serde_json::Value>,
        reset_refused: bool,
        held: usize,
        finished: FinishedTransfers,
        load_errors: Vec<(u32, LoadError)>,
        release_fails: bool,
        restore_fails: bool,
        invalid: Option<String>,
        policy: LoadFailurePolicy,
        metric: Option<&'static str>,
        waker: Option<Waker>,
        calls: Vec<String>,
    }

    struct Child(Arc<Mutex<Script>>);

    impl Child {
        fn log(&self, call: String) {
            self.0.lock().unwrap().calls.push(call);
        }
    }

    impl KvConnector for Child {
        fn name(&self) -> &str {
            "scripted"
        }
        fn supports_sleep_mode(&self) -> bool {
            self.0.lock().unwrap().sleep
        }
        fn info(&self) -> serde_json::Value {
            json!({})
        }
        fn validate_params(&self, _params: Option<&KvTransferParams>) -> Result<(), String> {
            self.0.lock().unwrap().invalid.clone().map_or(Ok(()), Err)
        }
        fn params_validator(&self) -> ParamsValidator {
            let invalid = self.0.lock().unwrap().invalid.clone();
            Arc::new(move |_| invalid.clone().map_or(Ok(()), Err))
        }
        fn metrics_reader(&self) -> Option<MetricsReader> {
            let name = self.0.lock().unwrap().metric?;
            Some(Arc::new(move || vec![(name, "a scripted counter", 1.0)]))
        }
        fn set_waker(&mut self, waker: Waker) {
            self.0.lock().unwrap().waker = Some(waker);
        }
        fn load_failure_policy(&self) -> LoadFailurePolicy {
            self.0.lock().unwrap().policy
        }
        fn get_num_new_matched_tokens(
            &mut self,
            _req: ConnectorRequest<'_>,
            _computed: usize,
        ) -> ExternalMatch {
            let offer = self.0.lock().unwrap().offer;
            self.log("match".into());
            ExternalMatch {
                num_tokens: offer,
                load_async: offer > 0,
            }
        }
        fn update_state_after_alloc(&mut self, _req: ConnectorRequest<'_>, a: Allocated<'_>) {
            self.log(format!("alloc {}", a.num_external_tokens));
        }
        fn request_added(&mut self, req: ConnectorRequest<'_>) {
            self.log(format!("added {}", req.id));
        }
        fn build_connector_meta(&mut self) -> ConnectorMeta {
            let n = self.0.lock().unwrap().calls.len();
            ConnectorMeta(Box::new(n))
        }
        fn update_connector_output(&mut self, finished: &FinishedTransfers) {
            self.log(format!(
                "output {}",
                finished.sending.len() + finished.recving.len()
            ));
        }
        fn wait_for_save(&mut self) {
            self.log("save".into());
        }
        fn request_finished(
            &mut self,
            _req: ConnectorRequest<'_>,
            _end: Ended<'_>,
        ) -> (bool, Option<KvTransferParams>) {
            let s = self.0.lock().unwrap();
            (s.keep, s.params.clone())
        }
        fn reset_cache(&mut self) -> bool {
            self.log("reset".into());
            !self.0.lock().unwrap().reset_refused
        }
        fn abort_transfers(&mut self) {
            self.log("abort".into());
        }
        fn num_held_blocks(&self) -> usize {
            self.0.lock().unwrap().held
        }
        fn register_kv_caches(&mut self, _spec: &KvCacheSpec) -> anyhow::Result<()> {
            Ok(())
        }
        fn start_load_kv(&mut self, meta: ConnectorMeta) {
            let mine = meta
                .0
                .downcast::<usize>()
                .expect("this child's own metadata");
            self.log(format!("load {mine}"));
        }
        fn get_finished(&mut self) -> FinishedTransfers {
            std::mem::take(&mut self.0.lock().unwrap().finished)
        }
        fn get_block_ids_with_load_errors(&mut self) -> Vec<(u32, LoadError)> {
            std::mem::take(&mut self.0.lock().unwrap().load_errors)
        }
        fn release_kv_caches(&mut self, _timeout: Duration) -> anyhow::Result<()> {
            self.log("release".into());
            if self.0.lock().unwrap().release_fails {
                anyhow::bail!("release refused");
            }
            Ok(())
        }
        fn restore_kv_caches(&mut self) -> anyhow::Result<()> {
            self.log("restore".into());
            if self.0.lock().unwrap().restore_fails {
                anyhow::bail!("restore refused");
            }
            Ok(())
        }
    }

    /// A multi-connector over children scripted by `scripts`, named k0, k1, …
    fn multi(scripts: Vec<Script>) -> (MultiConnector, Vec<Arc<Mutex<Script>>>) {
        let shared: Vec<_> = scripts
            .into_iter()
            .map(|s| Arc::new(Mutex::new(s)))
            .collect();
        let children: Vec<Box<dyn KvConnector>> = shared
            .iter()
            .map(|s| Box::new(Child(s.clone())) as Box<dyn KvConnector>)
            .collect();
        let kinds = (0..shared.len()).map(|i| format!("k{i}")).collect();
        (MultiConnector::new(children, kinds), shared)
    }

    fn calls(s: &Arc<Mutex<Script>>) -> Vec<String> {
        std::mem::take(&mut s.lock().unwrap().calls)
    }

    fn request(id: &Arc<str>) -> ConnectorRequest<'_> {
        ConnectorRequest {
            cache_salt: None,
            id,
            prompt_tokens: &[1, 2, 3],
            kv_transfer_params: None,
        }
    }

    #[test]
    fn sleep_support_is_the_and_of_the_children() {
        for (a, b) in [(true, true), (true, false), (false, true), (false, false)] {
            let (m, _) = multi(vec![
                Script {
                    sleep: a,
                    ..Script::default()
                },
                Script {
                    sleep: b,
                    ..Script::default()
                },
            ]);
            assert_eq!(m.supports_sleep_mode(), a && b, "children {a} {b}");
        }
    }

    #[test]
    fn release_is_all_or_nothing_and_restore_reaches_every_child() {
        let (mut m, s) = multi(vec![
            Script::default(),
            Script::default(),
            Script::default(),
        ]);
        m.release_kv_caches(Duration::from_secs(1)).unwrap();
        m.restore_kv_caches().unwrap();
        for c in &s {
            assert_eq!(calls(c), ["release", "restore"]);
        }

        // Child 1 refuses: child 0 registers again, child 2 is not asked.
        s[1].lock().unwrap().release_fails = true;
        let e = format!(
            "{:#}",
            m.release_kv_caches(Duration::from_secs(1)).unwrap_err()
        );
        assert!(
            e.contains("connector 1 (k1)") && e.contains("release refused"),
            "{e}"
        );
        assert_eq!(calls(&s[0]), ["release", "restore"], "undone");
        assert_eq!(calls(&s[1]), ["release"]);
        assert!(
            calls(&s[2]).is_empty(),
            "nothing released after the refusal"
        );
        // A failed undo is named too.
        s[0].lock().unwrap().restore_fails = true;
        let e = format!(
            "{:#}",
            m.release_kv_caches(Duration::from_secs(1)).unwrap_err()
        );
        assert!(
            e.contains("connector 0 (k0) could not register again"),
            "{e}"
        );
        calls(&s[0]);
        calls(&s[1]);

        s[1].lock().unwrap().release_fails = false;
        let e = format!("{:#}", m.restore_kv_caches().unwrap_err());
        assert!(
            e.contains("connector 0 (k0)") && e.contains("restore refused"),
            "{e}"
        );
        for c in &s {
            assert_eq!(
                calls(c),
                ["restore"],
                "every child is asked even after one failed"
            );
        }
    }

    #[test]
    fn aborts_and_resets_reach_every_child() {
        let (mut m, s) = multi(vec![Script::default(), Script::default()]);
        m.abort_transfers();
        assert!(m.reset_cache());
        for c in &s {
            assert_eq!(calls(c), ["abort", "reset"]);
        }
        s[0].lock().unwrap().reset_refused = true;
        assert!(
            !m.reset_cache(),
            "one child that cannot reset makes the reset fail"
        );
        assert_eq!(calls(&s[1]), ["reset"], "the other child still resets");
        s[0].lock().unwrap().reset_refused = false;
        s[1].lock().unwrap().reset_refused = true;
        assert!(!m.reset_cache());
    }

    #[test]
    fn held_blocks_are_the_largest_childs_count() {
        let (m, s) = multi(vec![
            Script {
                held: 3,
                ..Script::default()
            },
            Script {
                held: 7,
                ..Script::default()
            },
        ]);
        assert_eq!(m.num_held_blocks(), 7);
        s[0].lock().unwrap().held = 9;
        assert_eq!(m.num_held_blocks(), 9);
    }

    #[test]
    fn every_child_checks_the_params() {
        let (m, s) = multi(vec![Script::default(), Script::default()]);
        assert_eq!(m.validate_params(None), Ok(()));
        assert_eq!(m.params_validator()(None), Ok(()));
        s[1].lock().unwrap().invalid = Some("transfer_id: missing".into());
        assert_eq!(m.validate_params(None), Err("transfer_id: missing".into()));
        assert_eq!(
            m.params_validator()(None),
            Err("transfer_id: missing".into())
        );
    }

    #[test]
    fn the_first_offer_wins_and_only_the_winner_loads() {
        let (mut m, s) = multi(vec![
            Script::default(),
            Script {
                offer: 32,
                ..Script::default()
            },
            Script {
                offer: 16,
                ..Script::default()
            },
        ]);
        let id: Arc<str> = "r1".into();
        assert_eq!(
            m.get_num_new_matched_tokens(request(&id), 0),
            ExternalMatch {
                num_tokens: 32,
                load_async: true
            }
        );
        m.update_state_after_alloc(request(&id), Allocated::new(&[4, 5], 0, 32));
        assert_eq!(calls(&s[0]), ["match", "alloc 0"]);
        assert_eq!(calls(&s[1]), ["match", "alloc 32"]);
        assert_eq!(
            calls(&s[2]),
            ["match", "alloc 0"],
            "every child is asked; a later offer loses"
        );

        // Nobody offers: nobody loads.
        s[1].lock().unwrap().offer = 0;
        s[2].lock().unwrap().offer = 0;
        assert_eq!(
            m.get_num_new_matched_tokens(request(&id), 0),
            ExternalMatch::default()
        );
        m.update_state_after_alloc(request(&id), Allocated::new(&[4, 5], 0, 0));
        for c in &s {
            assert_eq!(calls(c), ["match", "alloc 0"]);
        }
    }

    #[test]
    fn finished_blocks_stay_held_until_every_keeping_child_names_them() {
        let (mut m, s) = multi(vec![
            Script {
                keep: true,
                ..Script::default()
            },
            Script {
                keep: true,
                params: Some(json!({"from": 1})),
                ..Script::default()
            },
            Script {
                params: Some(json!({"from": 2})),
                ..Script::default()
            },
        ]);
        let id: Arc<str> = "r1".into();
        let (delay, params) =
            m.request_finished(request(&id), Ended::new(&[1, 2], FinishReason::Length));
        assert!(delay);
        assert_eq!(params, Some(json!({"from": 1})), "the first child's params");
        let report = |c: &Arc<Mutex<Script>>| c.lock().unwrap().finished.sending.push(id.clone());

        report(&s[2]); // does not hold it: must not free the blocks
        report(&s[0]);
        assert!(
            m.get_finished().is_empty(),
            "child 1 still holds the blocks"
        );
        report(&s[1]);
        assert_eq!(m.get_finished().sending, std::slice::from_ref(&id));
        assert!(m.get_finished().is_empty());

        // A request no child keeps is freed at once; a live request's load
        // report passes through as it is.
        for c in &s {
            c.lock().unwrap().keep = false;
        }
        let id2: Arc<str> = "r2".into();
        assert!(
            !m.request_finished(request(&id2), Ended::new(&[3], FinishReason::Stop))
                .0
        );
        s[0].lock().unwrap().finished.recving.push(id2.clone());
        s[1].lock().unwrap().finished.recving.push(id2.clone());
        assert_eq!(m.get_finished().recving, [id2], "reported once");
    }

    #[test]
    fn load_errors_come_from_every_child_and_the_policy_from_the_first() {
        let (mut m, s) = multi(vec![
            Script {
                policy: LoadFailurePolicy::Recompute,
                ..Script::default()
            },
            Script::default(),
        ]);
        s[0].lock()
            .unwrap()
            .load_errors
            .push((1, LoadError::failed("a")));
        s[1].lock()
            .unwrap()
            .load_errors
            .push((2, LoadError::recompute("b")));
        assert_eq!(
            m.get_block_ids_with_load_errors(),
            [(1, LoadError::failed("a")), (2, LoadError::recompute("b"))]
        );
        assert_eq!(m.load_failure_policy(), LoadFailurePolicy::Recompute);
        s[0].lock().unwrap().policy = LoadFailurePolicy::Fail;
        s[1].lock().unwrap().policy = LoadFailurePolicy::Recompute;
        assert_eq!(m.load_failure_policy(), LoadFailurePolicy::Fail);
    }

    #[test]
    fn clashing_metric_names_get_the_kind_as_prefix() {
        let (m, _) = multi(vec![
            Script {
                metric: Some("multi_test_clash_total"),
                ..Script::default()
            },
            Script {
                metric: Some("multi_test_clash_total"),
                ..Script::default()
            },
            Script {
                metric: Some("multi_test_own_total"),
                ..Script::default()
            },
        ]);
        let names: Vec<&str> = m.metrics_reader().unwrap()()
            .into_iter()
            .map(|x| x.0)
            .collect();
        assert_eq!(
            names,
            [
                "k0_multi_test_clash_total",
                "k1_multi_test_clash_total",
                "multi_test_own_total"
            ]
        );
        let (m, _) = multi(vec![Script::default()]);
        assert!(m.metrics_reader().is_none(), "no child has metrics");
    }

    #[test]
    fn per_step_calls_reach_every_child_with_its_own_metadata() {
        let (mut m, s) = multi(vec![Script::default(), Script::default()]);
        let id: Arc<str> = "r1".into();
        m.request_added(request(&id));
        s[1].lock().unwrap().calls.push("extra".into());
        // Each child's metadata is the number of calls it had logged.
        let meta = m.build_connector_meta();
        m.start_load_kv(meta);
        m.wait_for_save();
        m.update_connector_output(&FinishedTransfers {
            sending: vec![id.clone()],
            recving: vec![],
            abandoned: vec![],
        });
        assert_eq!(calls(&s[0]), ["added r1", "load 1", "save", "output 1"]);
        assert_eq!(
            calls(&s[1]),
            ["added r1", "extra", "load 2", "save", "output 1"]
        );
        // Another connector's metadata is refused, not misrouted.
        m.start_load_kv(ConnectorMeta::empty());
        assert!(calls(&s[0]).is_empty() && calls(&s[1]).is_empty());
    }

    #[test]
    fn every_child_can_wake_the_engine() {
        let (mut m, s) = multi(vec![Script::default(), Script::default()]);
        let woken = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let w = woken.clone();
        m.set_waker(Arc::new(move || {
            w.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }));
        for c in &s {
            let waker = c
                .lock()
                .unwrap()
                .waker
                .clone()
                .expect("the child got the waker");
            waker();
        }
        assert_eq!(woken.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    #[test]
    fn takes_up_to_max_children() {
        let child = json!({"kv_connector": "offload"});
        for n in 1..=MAX_CHILDREN {
            let cfg =
                json!({"kv_connector": "multi", "connectors": vec![child.clone(); n]}).to_string();
            let m = MultiConnector::from_json(&cfg, "e", &Default::default())
                .unwrap_or_else(|e| panic!("{n} children: {e:#}"));
            assert_eq!(m.children.len(), n);
        }
        let cfg = json!({"kv_connector": "multi", "connectors": vec![child; MAX_CHILDREN + 1]})
            .to_string();
        assert!(MultiConnector::from_json(&cfg, "e", &Default::default()).is_err());
        let e = MultiConnector::from_json(
            r#"{"kv_connector":"pdkv","connectors":[{"kv_connector":"offload"}]}"#,
            "e",
            &Default::default(),
        )
        .err()
        .unwrap();
        assert!(format!("{e:#}").contains("kv_connector"), "{e:#}");
    }
}
