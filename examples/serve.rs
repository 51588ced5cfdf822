//! An OpenAI-compatible HTTP server over a Llama-family model (attention through flash-attn3).
//!
//! ```text
//! scripts/fetch-default-model.sh     # SmolLM2-135M-Instruct (GGUF) into models/
//! cargo run --release --example serve -- --port 8080
//! curl localhost:8080/v1/chat/completions -H 'Content-Type: application/json' \
//!     -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "stream": true}'
//! ```
//!
//! Routes: `GET /health`, `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`
//! (temperature, top_p, top_k, max_tokens, stop, seed, stream). Requests from many clients share
//! the model's steps in one continuous batch of up to `--slots` (crates/serve).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Parser;
use flash_llama::Kernels;
use flash_serve::{Engine, EngineOptions, Server};

mod common;

#[derive(Parser, Debug)]
#[command(about = "Serve a Llama-family model over OpenAI's HTTP API (attention through flash-attn3)")]
struct Args {
    /// A .gguf file or an HF model directory.
    #[arg(long, default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: PathBuf,

    /// The name clients give as `model` (default: the model file's name without extension).
    #[arg(long)]
    name: Option<String>,

    #[arg(long, default_value = "127.0.0.1")]
    host: String,

    #[arg(long, default_value_t = 8080)]
    port: u16,

    /// Compute dtype: f32, bf16 or f16. Default: bf16 on the GPU, f32 on the CPU.
    #[arg(long)]
    dtype: Option<String>,

    /// Run on the CPU even when a GPU is available.
    #[arg(long)]
    cpu: bool,

    /// The KV cache's dtype: `model` (the compute dtype) or `fp8` (e4m3, half the bytes of bf16).
    #[arg(long, default_value = "model", value_parser = ["model", "fp8"])]
    kv_cache_dtype: String,

    /// Requests that share a model step at most (continuous batching; more wait in arrival
    /// order). The KV cache holds slots × max-seq tokens.
    #[arg(long, default_value_t = 8)]
    slots: usize,

    /// Tokens (prompt and generated) one request may hold; longer requests get a 400.
    #[arg(long, default_value_t = 2048)]
    max_seq: usize,

    /// Prompt tokens a request feeds per step at most (chunked prefill: a long prompt does not
    /// stall the other requests' tokens); 0 feeds whole prompts.
    #[arg(long, default_value_t = 256)]
    prefill_chunk: usize,

    /// A paged KV cache with pages of this many tokens (16 to 256, a power of two; 0: one slot
    /// of --max-seq tokens per request). Memory then follows what requests hold: see --pages.
    #[arg(long, default_value_t = 0)]
    page_size: usize,

    /// With --page-size: pages in the pool (default: slots × max-seq / page-size, the memory of
    /// the slot cache). A request waits until the pool has pages for its prompt and max_tokens.
    #[arg(long)]
    pages: Option<usize>,

    /// Decode step by step with eager launches instead of replaying CUDA graphs of the decode
    /// step (on the GPU, with a contiguous cache of the model's dtype, graphs are the default).
    #[arg(long)]
    no_cuda_graphs: bool,
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<()> {
    // (Device work runs on the engine's one thread, after the load's work on this one has finished:
    // candle gives each thread a stream of its own.)
    let device = common::device(args.cpu)?;
    let dtype = common::inference_dtype(args.dtype.as_deref(), &device)?;
    let t0 = std::time::Instant::now();
    let loaded = flash_llama::load(&args.model, dtype, &device, Kernels::Fused)
        .with_context(|| format!("loading {}", args.model.display()))?;
    let name = match args.name {
        Some(n) => n,
        None => args
            .model
            .file_stem()
            .map_or("model".into(), |s| s.to_string_lossy().into_owned()),
    };
    eprintln!(
        "loaded {} in {:.1}s on {:?} as {dtype:?}",
        args.model.display(),
        t0.elapsed().as_secs_f64(),
        device.location()
    );
    let kv_cache_dtype = common::kv_cache_dtype(&args.kv_cache_dtype, dtype)?;
    let opts = EngineOptions {
        slots: args.slots,
        max_seq: args.max_seq,
        kv_cache_dtype: Some(kv_cache_dtype),
        prefill_chunk: args.prefill_chunk,
        paged: match args.page_size {
            0 => None,
            size => Some((args.pages.unwrap_or(args.slots * args.max_seq / size), size)),
        },
        cuda_graphs: !args.no_cuda_graphs,
    };
    let engine = Engine::start(name.clone(), loaded.model, loaded.tokenizer, opts)?;
    eprintln!(
        "continuous batching: {} slots of {} tokens, prefill chunks of {}, KV cache {kv_cache_dtype:?}{}",
        args.slots,
        args.max_seq,
        args.prefill_chunk,
        match opts.paged {
            Some((pages, size)) => format!(", paged: {pages} pages of {size}"),
            None => String::new(),
        }
    );
    let addr = format!("{}:{}", args.host, args.port);
    let server = Server::bind(&addr)?;
    eprintln!("serving `{name}` on http://{}", server.local_addr()?);
    server.run(Arc::new(engine));
    Ok(())
}
