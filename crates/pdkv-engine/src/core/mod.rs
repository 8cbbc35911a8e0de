//! The engine core, in four parts:
//! - `stepper.rs` ([`EngineCore`]): everything the core decides and does —
//!   requests, steps, sampling and stops, outputs — with the model behind
//!   [`crate::ModelRunner`] and time from [`crate::Clock`]; no threads,
//!   channels or system clock. `executor.rs` is its lifecycle side: it
//!   applies what [`crate::lifecycle::Machine`] decides;
//! - `command.rs` ([`Command`]): what callers ask of the core, answered
//!   through closures ([`OutputSink`], [`Reply`]) rather than channels;
//! - `driver.rs`: the production thread that owns the stepper, drains the
//!   bounded command channel into it, ticks it and waits on the channel
//!   when idle;
//! - `handle.rs` ([`EngineHandle`], [`RequestStream`]): validation, the
//!   admission gate and the blocking lifecycle calls on the caller's
//!   thread; it wraps its channels in the command's closures and reads the
//!   snapshot the stepper publishes.
//!
//! [`Engine::start`] builds the real model runner, the stepper and the
//! thread; a simulator builds an [`EngineCore`] with [`EngineCore::new`] and
//! drives it itself (see `stepper.rs` for the contract).

mod command;
mod driver;
mod executor;
mod handle;
mod limits;
mod requests;
mod stepper;

use std::sync::mpsc::sync_channel;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use pdkv_model::LoadedModel;
use pdkv_vmem::{Backing, Pool, RankPools};

pub use command::{AddRequest, Command, LifecycleReply, OutputSink, Reply};
pub use handle::{EngineHandle, RequestStream};
pub use stepper::{CoreParts, EngineCore, LifecycleUpdate, NoPublisher, Publisher};

use crate::clock::{Clock, SystemClock};
use crate::connector::{KvConnector, Waker};
use crate::lifecycle::{Machine, WeightInfo};
use crate::model::{CpuModelRunner, ModelRunner, TpModelRunner};
use crate::{EngineConfig, EngineStats};
use driver::{Driver, COMMAND_CAPACITY};
use handle::{Inner, Shared, SharedPublisher};

/// Starts engines.
pub struct Engine;

impl Engine {
    /// Allocates the KV cache (`num_kv_blocks` blocks) and workspace in `pool`
    /// and starts the engine core thread.
    pub fn start(
        model: LoadedModel,
        pool: Pool,
        config: EngineConfig,
    ) -> anyhow::Result<EngineHandle> {
        Engine::start_with_connector(model, pool, config, None)
    }

    /// [`Engine::start`] with a KV connector: its `register_kv_caches` is
    /// called with the new KV cache before the core starts, and the core
    /// drives it from then on (see [`crate::connector`]).
    pub fn start_with_connector(
        model: LoadedModel,
        pool: Pool,
        config: EngineConfig,
        connector: Option<Box<dyn KvConnector>>,
    ) -> anyhow::Result<EngineHandle> {
        limits::check_config(&config)?;
        let LoadedModel {
            model,
            tokenizer,
            chat_template,
            name,
            source,
        } = model;
        let model_config = model.config().clone();
        let tp = config.tensor_parallel_size;
        // A connector may register the KV cache for transfers, which pin
        // and export its memfd chunks; without one it stays in this process.
        let backing = if connector.is_some() {
            Backing::Shared
        } else {
            Backing::Private
        };
        let (runner, pools): (Box<dyn ModelRunner>, RankPools) = if tp == 1 {
            let runner = CpuModelRunner::new(
                model,
                &pool,
                (config.num_kv_blocks, config.kv_cache_dtype, backing),
                config.max_num_batched_tokens,
            )?;
            (Box::new(runner), RankPools::single(pool))
        } else {
            // Each rank gets a pool of its own; the whole model (in `pool`)
            // is freed once it is split.
            let ranks: Vec<Pool> = (0..tp).map(|_| Pool::new(pool.options().clone())).collect();
            let runner = TpModelRunner::new(
                model,
                ranks.clone(),
                (config.num_kv_blocks, config.kv_cache_dtype, backing),
                config.max_num_batched_tokens,
            )?;
            (Box::new(runner), RankPools::new(ranks))
        };
        let weights_layout = runner.weights().cloned();
        let tokenizer = Arc::new(tokenizer);
        let connector_info = connector.as_ref().map(|c| c.info());
        let connector_metrics = connector.as_ref().and_then(|c| c.metrics_reader());
        let weight_info = WeightInfo {
            version: None,
            path: source,
        };
        let stats = EngineStats {
            kv_blocks_total: config.num_kv_blocks,
            kv_blocks_free: config.num_kv_blocks,
            ..EngineStats::default()
        };
        let shared = Arc::new(Shared::new(
            stats,
            Machine::new().status(),
            weight_info.clone(),
        ));
        let (cmd_tx, cmd_rx) = sync_channel(COMMAND_CAPACITY);
        let nudge = cmd_tx.clone();
        let waker: Waker = Arc::new(move || {
            // A full channel means the core has commands to read and will
            // look at the connector anyway.
            let _ = nudge.try_send(Command::Nudge);
        });
        let eos_token_ids = tokenizer
            .eos_token_ids()
            .iter()
            .chain(&model_config.eos_token_ids)
            .copied()
            .collect::<std::collections::BTreeSet<u32>>()
            .into_iter()
            .collect();
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let core = EngineCore::new(CoreParts {
            runner,
            pools: pools.clone(),
            config: config.clone(),
            connector,
            waker,
            decoder: tokenizer.clone(),
            eos_token_ids,
            weight_info,
            clock: clock.clone(),
            publisher: Box::new(SharedPublisher(shared.clone())),
        })?;
        let limits = core.limits().clone();
        let driver = Driver::new(core, cmd_rx, shared.clone(), clock.clone());
        let thread = std::thread::Builder::new()
            .name("pdkv-engine-core".into())
            .spawn(move || driver.run())
            .context("spawning the engine core thread")?;
        Ok(EngineHandle {
            inner: Arc::new(Inner {
                cmd_tx,
                send_lock: Mutex::new(()),
                shared,
                tokenizer,
                config,
                model_name: name,
                chat_template,
                model_config,
                pools,
                limits,
                connector_info,
                connector_metrics,
                weights_layout,
                clock,
                thread: Mutex::new(Some(thread)),
            }),
        })
    }
}
