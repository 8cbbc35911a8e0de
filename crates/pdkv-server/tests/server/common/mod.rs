//! The harness the HTTP test files share: a real server on 127.0.0.1 with a
//! tiny random-weight model and a running engine, plus helpers to read its
//! metrics and check OpenAI error bodies.

#![allow(dead_code)] // each test file uses its own part of the harness

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use futures::future::BoxFuture;
use pdkv_engine::{Engine, EngineConfig, EngineHandle};
use pdkv_model::Arch;
use pdkv_server::listen::HttpLimits;
use pdkv_server::AppState;
use pdkv_testkit::{http, prom};
use pdkv_vmem::Pool;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

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
    listening: Listening,
    pub dir: tempfile::TempDir,
}

/// How a test server serves, beyond its model and engine: the bounds on
/// client connections, how long new requests wait while the engine is
/// paused, and whether the admin API is open without a token.
///
/// By default new requests to a paused engine are refused at once (a
/// pause wait of zero), so the tests of what a paused or sleeping engine
/// answers need no clock; a `pause_wait` keeps them waiting for `/resume`
/// (`pdkv serve`'s default behaviour).
#[derive(Default)]
pub struct Serving {
    pub limits: HttpLimits,
    pub pause_wait: Duration,
    pub dev_mode: bool,
    /// The format the weights are served in (default: as stored).
    pub weight_format: pdkv_model::loader::WeightFormat,
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
        Server::spawn_serving(preset, seed, token, config, Serving::default()).await
    }

    /// [`Server::spawn`], serving as `serving` says.
    pub async fn spawn_serving(
        preset: &str,
        seed: u64,
        token: Option<&str>,
        config: EngineConfig,
        serving: Serving,
    ) -> Server {
        let dir = checkpoint(preset, seed);
        let pool = Pool::default();
        let model = pdkv_model::loader::load_model_as(
            dir.path(),
            serving.weight_format,
            &pool,
            &mut |_| {},
        )
        .expect("load model");
        let engine = Engine::start(model, pool, config).expect("start engine");
        let mut state = AppState::new(engine.clone(), SERVED)
            .with_pause_wait(serving.pause_wait)
            .with_dev_mode(serving.dev_mode);
        if let Some(t) = token {
            state = state.with_admin_token(t).expect("admin token");
        }
        let listening = Listening::start(|listener, shutdown| {
            pdkv_server::serve_with(listener, state, serving.limits, shutdown)
        })
        .await;
        Server {
            base: listening.base.clone(),
            engine,
            client: reqwest::Client::new(),
            listening,
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

    /// The status `/health` answers with.
    pub async fn health(&self) -> reqwest::StatusCode {
        http::send(self.client.get(self.url("/health")))
            .await
            .status()
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

    pub async fn stop(self) {
        self.listening.stop().await;
        self.engine.shutdown();
    }
}

/// A server task on an ephemeral port of 127.0.0.1, ended by
/// [`Listening::stop`].
pub struct Listening {
    pub base: String,
    stop: oneshot::Sender<()>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Listening {
    /// Binds a port and spawns `serve(listener, shutdown)`, `shutdown`
    /// completing when [`Listening::stop`] is called.
    pub async fn start<F>(serve: impl FnOnce(TcpListener, BoxFuture<'static, ()>) -> F) -> Listening
    where
        F: Future<Output = std::io::Result<()>> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr: SocketAddr = listener.local_addr().expect("addr");
        let (stop, stopped) = oneshot::channel::<()>();
        let shutdown = Box::pin(async move {
            let _ = stopped.await;
        });
        Listening {
            base: format!("http://{addr}"),
            stop,
            task: tokio::spawn(serve(listener, shutdown)),
        }
    }

    /// Signals the shutdown and waits, bounded, for the task to end well.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        tokio::time::timeout(DEADLINE, self.task)
            .await
            .expect("server stops")
            .expect("join")
            .expect("serve");
    }
}
