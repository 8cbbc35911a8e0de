//! The harness the HTTP test files share: a real server on 127.0.0.1 with a
//! tiny random-weight model and a running engine, plus helpers to read its
//! metrics and check OpenAI error bodies.

#![allow(dead_code)] // each test file uses its own part of the harness

use std::net::SocketAddr;

use pdkv_engine::{Engine, EngineConfig, EngineHandle};
use pdkv_model::Arch;
use pdkv_server::AppState;
use pdkv_testkit::{http, prom};
use pdkv_vmem::Pool;
use tokio::sync::oneshot;

pub use pdkv_testkit::DEADLINE;

pub const SERVED: &str = "tiny-test";

/// A random Llama checkpoint of `preset` with `seed` in a new temp dir.
pub fn checkpoint(preset: &str, seed: u64) -> tempfile::TempDir {
    pdkv_testkit::models::checkpoint(Arch::Llama, preset, seed)
}

pub struct Server {
    pub base: String,
    pub engine: EngineHandle,
    pub client: reqwest::Client,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    pub dir: tempfile::TempDir,
}

impl Server {
    /// A server for a random checkpoint (`preset`, `seed`), with the admin
    /// API on when `token` is given.
    pub async fn spawn(
        preset: &str,
        seed: u64,
        token: Option<&str>,
        config: EngineConfig,
    ) -> Server {
        Server::spawn_with_limits(
            preset,
            seed,
            token,
            config,
            pdkv_server::listen::HttpLimits::default(),
        )
        .await
    }

    /// [`Server::spawn`] with the given bounds on client connections.
    ///
    /// New requests to a paused engine are refused at once (a pause wait
    /// of zero), so the tests of what a paused or sleeping engine answers
    /// need no clock; [`Server::spawn_holding`] keeps them waiting.
    pub async fn spawn_with_limits(
        preset: &str,
        seed: u64,
        token: Option<&str>,
        config: EngineConfig,
        limits: pdkv_server::listen::HttpLimits,
    ) -> Server {
        Server::spawn_holding(
            preset,
            seed,
            token,
            config,
            limits,
            std::time::Duration::ZERO,
            false,
        )
        .await
    }

    /// [`Server::spawn_with_limits`] whose new requests wait up to
    /// `pause_wait` for `/resume` while the engine is paused (`pdkv
    /// serve`'s default behaviour); `dev_mode`: the admin API without a
    /// token.
    pub async fn spawn_holding(
        preset: &str,
        seed: u64,
        token: Option<&str>,
        config: EngineConfig,
        limits: pdkv_server::listen::HttpLimits,
        pause_wait: std::time::Duration,
        dev_mode: bool,
    ) -> Server {
        let dir = checkpoint(preset, seed);
        let pool = Pool::default();
        let model = pdkv_model::load_model(dir.path(), &pool, &mut |_| {}).expect("load model");
        let engine = Engine::start(model, pool, config).expect("start engine");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr: SocketAddr = listener.local_addr().expect("addr");
        let (stop, stopped) = oneshot::channel::<()>();
        let mut state = AppState::new(engine.clone(), SERVED)
            .with_pause_wait(pause_wait)
            .with_dev_mode(dev_mode);
        if let Some(t) = token {
            state = state.with_admin_token(t).expect("admin token");
        }
        let task = tokio::spawn(pdkv_server::serve_with(
            listener,
            state,
            limits,
            async move {
                let _ = stopped.await;
            },
        ));
        Server {
            base: format!("http://{addr}"),
            engine,
            client: reqwest::Client::new(),
            stop: Some(stop),
            task: Some(task),
            dir,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// Posts `body` as JSON to `path`: the status and the JSON answer.
    pub async fn post(
        &self,
        path: &str,
        body: &serde_json::Value,
    ) -> (reqwest::StatusCode, serde_json::Value) {
        http::post_json(&self.client, &self.url(path), body).await
    }

    pub async fn metrics(&self) -> String {
        http::metrics(&self.client, &self.base).await
    }

    /// Polls `/metrics` until `pred` holds; fails at the deadline.
    pub async fn wait_metrics(&self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        http::wait_metrics(&self.client, &self.base, what, pred).await
    }

    pub async fn wait_all_blocks_free(&self) -> String {
        self.wait_metrics(
            "all KV blocks free and no request running",
            prom::all_blocks_free,
        )
        .await
    }

    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            tokio::time::timeout(DEADLINE, t)
                .await
                .expect("server stops")
                .expect("join")
                .expect("serve");
        }
        self.engine.shutdown();
    }
}
