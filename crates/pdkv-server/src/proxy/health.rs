//! The health checks of the backends: `GET /health` on each, and
//! `GET /kv_transfer/info` on prefill servers, every `health_interval`.

use std::sync::Arc;

use axum::http::StatusCode;
use pdkv_relay::plan::Role;
use serde_json::Value;

use super::backends::{Backend, BackendStatus, KvTransferInfo};
use super::shared::Shared;
use crate::error::error_chain;

/// Why a prefill server's `GET /kv_transfer/info` gave no usable answer.
#[derive(Debug, thiserror::Error)]
pub(super) enum InfoError {
    #[error("/kv_transfer/info failed: {0}")]
    Call(String),
    #[error("/kv_transfer/info body: {0}")]
    Body(String),
    #[error("/kv_transfer/info is not the expected JSON: {0}")]
    Json(serde_json::Error),
    #[error("/kv_transfer/info answered {0}")]
    Status(StatusCode),
}

impl Shared {
    /// One round of health checks, all backends at once: `GET /health`, and
    /// for prefill servers `GET /kv_transfer/info`. Returns when every
    /// check has answered or timed out.
    pub(super) async fn check_backends(&self) {
        let checks = self.all_backends().map(|b| self.check_one(b.clone()));
        futures::future::join_all(checks).await;
    }

    async fn check_one(&self, b: Arc<Backend>) {
        let timeout = self.config.health_timeout;
        let health = self
            .client
            .get(format!("{}/health", b.url))
            .timeout(timeout)
            .send()
            .await;
        let (problem, refusing) = match health {
            Ok(r) if r.status().is_success() => (None, None),
            Ok(r)
                if r.status() == StatusCode::SERVICE_UNAVAILABLE
                    && r.headers().contains_key(reqwest::header::RETRY_AFTER) =>
            {
                let body = r.bytes().await.unwrap_or_default();
                let why = serde_json::from_slice::<Value>(&body)
                    .ok()
                    .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
                    .unwrap_or_else(|| "not serving for now".into());
                (None, Some(why))
            }
            Ok(r) => (Some(format!("/health answered {}", r.status())), None),
            Err(e) => (Some(format!("/health failed: {}", error_chain(&e))), None),
        };
        if let Some(reason) = problem {
            tracing::debug!(role = %b.role, url = %b.url, %reason, "health check failed");
            b.set_status(BackendStatus {
                healthy: false,
                refusing: None,
                kv_info: b.status().kv_info,
                last_error: Some(reason),
            });
            return;
        }
        let kv_info = match b.role {
            Role::Decode => None,
            Role::Prefill => match self.fetch_info(&b).await {
                Ok(info) => info,
                Err(reason) => {
                    // A server that is up but cannot describe its connector is
                    // not usable as P: D would get no bootstrap address.
                    b.set_status(BackendStatus {
                        healthy: false,
                        refusing: None,
                        kv_info: None,
                        last_error: Some(reason.to_string()),
                    });
                    return;
                }
            },
        };
        b.set_status(BackendStatus {
            healthy: true,
            refusing,
            kv_info,
            last_error: None,
        });
    }

    /// A prefill server's connector info; `Ok(None)` when it has none (404).
    async fn fetch_info(&self, b: &Backend) -> Result<Option<KvTransferInfo>, InfoError> {
        let timeout = self.config.health_timeout;
        let resp = self
            .client
            .get(format!("{}/kv_transfer/info", b.url))
            .timeout(timeout)
            .send()
            .await
            .map_err(|e| InfoError::Call(error_chain(&e)))?;
        match resp.status() {
            StatusCode::NOT_FOUND => Ok(None),
            s if s.is_success() => {
                let bytes = resp
                    .bytes()
                    .await
                    .map_err(|e| InfoError::Body(error_chain(&e)))?;
                serde_json::from_slice::<KvTransferInfo>(&bytes)
                    .map(Some)
                    .map_err(InfoError::Json)
            }
            s => Err(InfoError::Status(s)),
        }
    }
}

/// Checks every `health_interval` until the returned task is aborted.
pub(super) fn spawn_loop(proxy: Arc<Shared>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(proxy.config.health_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            proxy.check_backends().await;
        }
    })
}
