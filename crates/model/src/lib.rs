//! Llama-family decoders for candle whose attention runs through [`flash_attn3`].
//!
//! - [`Config`] / [`Architecture`]: Llama 2/3/3.1/3.2, SmolLM2, Mistral, Qwen2/2.5, Qwen3.
//! - [`Llama`]: the decoder; [`Llama::forward`] for full (differentiable) passes,
//!   [`Llama::step`] with a [`KvCache`] (the model's dtype or fp8) for prefill and decoding of
//!   one or many sequences.
//! - [`load`]: a model and its tokenizer from an HF directory or a GGUF file.
//! - [`TextTokenizer`], [`TokenStream`]: encoding, chat templates, incremental decoding;
//!   [`spm`] rebuilds SentencePiece vocabularies of GGUF files.
//! - [`perplexity()`]: a text's perplexity through the KV cache (fp8 or the model's dtype).
//! - [`Batcher`]: continuous batching (requests join and leave a running batch between steps).
//! - [`generate()`]: batched sampling loop ([`Sampler`]: temperature, top-k, top-p, repeat penalty).
//! - [`train`]: training from scratch (presets, AdamW, checkpoints that resume the same run),
//!   data-parallel over the ranks of a [`parallel::Communicator`] (threads, or GPUs through NCCL).

pub mod batch;
pub mod config;
#[cfg(feature = "cuda")]
mod decode_graph;
pub mod eval;
pub mod fused;
pub mod generate;
pub mod kv_cache;
pub mod loader;
pub mod model;
pub mod nn;
pub mod parallel;
pub mod sampling;
pub mod spm;
pub mod tokenizer;
pub mod train;
pub mod train_ops;

pub use batch::{Batcher, Emitted, Finish, Request};
pub use config::{Architecture, Config, Llama3RopeScaling};
pub use eval::{perplexity, Perplexity};
pub use generate::{generate, Flow, GenerateOptions, Generation};
pub use loader::{load, LoadedModel};
pub use model::{KvCache, Llama};
pub use nn::Kernels;
pub use sampling::{Sampler, SamplingParams};
pub use tokenizer::{ChatMessage, TextTokenizer, TokenStream};
