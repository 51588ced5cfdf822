//! flash-serve: an OpenAI-compatible HTTP server for flash-llama models.
//!
//! - [`engine`]: the model's worker thread and its queue ([`Engine`], the [`Backend`] trait);
//!   requests share one continuous batch ([`flash_llama::Batcher`]), joining it as slots free up.
//! - [`api`]: the request bodies and their checks.
//! - [`http`]: the routes (`/health`, `/v1/models`, `/v1/completions`, `/v1/chat/completions`),
//!   JSON answers and server-sent events.
//!
//! The `serve` example (examples/serve.rs) runs it on a model file.

pub mod api;
pub mod engine;
pub mod http;

pub use engine::{Backend, Engine, EngineOptions, Event, FinishReason, Job, StopFilter};
pub use http::Server;
