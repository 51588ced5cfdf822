//! Prefill and decode tokens/s of the Llama-3.2-1B shape on the CPU, through `generate` (the
//! example's path), with random weights (written into memory: untouched zero-filled allocations
//! would all read the same cached zero page and flatter the bandwidth-bound decode): batch 1 and
//! batch 16, f32 and bf16. SmolLM2's CPU numbers come from the real model with the
//! `generate` example (docs/model.md).
//!
//!     cargo bench -p flash-llama --bench cpu_generate [-- PROMPT_TOKENS NEW_TOKENS]
//!
//! Defaults: 16 prompt tokens and 4 new tokens per sequence (the 1B shape is slow on a laptop).

use candle_core::Tensor;
use candle_core::{DType, Device, Result};
use candle_nn::{VarBuilder, VarMap};
use flash_llama::{generate, Config, Flow, GenerateOptions, Kernels, Llama, SamplingParams};

const LLAMA32_1B: &str = include_str!("llama32_1b.json");

fn main() -> Result<()> {
    let arg = |i: usize, default: usize| std::env::args().nth(i).and_then(|a| a.parse().ok()).unwrap_or(default);
    let (prompt_len, new) = (arg(1, 16), arg(2, 4));
    let cfg = Config::from_hf_json(LLAMA32_1B).map_err(candle_core::Error::wrap)?;
    println!(
        "Llama-3.2-1B shape on the CPU ({} threads), {prompt_len}-token prompts, {new} new tokens:",
        cpu_threads()
    );
    println!("| dtype | batch | prefill tokens/s | decode tokens/s |");
    println!("|---|---|---|---|");
    for dtype in [DType::F32, DType::BF16] {
        let vars = VarMap::new();
        let model = Llama::load(
            VarBuilder::from_varmap(&vars, dtype, &Device::Cpu),
            &cfg,
            Kernels::Fused,
        )?;
        // The model shares the storage of every weight it did not concatenate at load (those
        // copies are written, hence real memory, already).
        for var in vars.all_vars() {
            var.set(&Tensor::randn(0f32, 0.02, var.shape(), &Device::Cpu)?.to_dtype(dtype)?)?;
        }
        for batch in [1, 16] {
            let prompts: Vec<Vec<u32>> = (0..batch)
                .map(|b| (0..prompt_len as u32).map(|i| (i * 7 + b * 13 + 3) % 1000).collect())
                .collect();
            let opts = GenerateOptions {
                max_tokens: new,
                sampling: SamplingParams::default(),
                stop_tokens: Vec::new(),
                kv_cache_dtype: None,
                cuda_graphs: true,
            };
            let g = generate(&model, &prompts, &opts, |_, _| Ok(Flow::Continue))?;
            println!(
                "| {dtype:?} | {batch} | {:.1} | {:.2} |",
                g.prefill_tokens_per_sec(),
                g.decode_tokens_per_sec()
            );
        }
    }
    Ok(())
}

fn cpu_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
