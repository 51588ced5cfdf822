//! The generation loop: one prefill step for all prompts, then one decode step per token for
//! the sequences that have not finished.

use std::time::Instant;

use candle_core::{bail, Device, Result};

use crate::model::Llama;
use crate::sampling::{Sampler, SamplingParams};

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// Tokens to generate per sequence at most (the stop token included).
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Tokens that end a sequence (EOS, end of turn).
    pub stop_tokens: Vec<u32>,
}

/// Tokens produced for each prompt, and the time spent.
#[derive(Debug, Clone)]
pub struct Generation {
    /// Generated tokens per prompt, a stop token included when one ended the sequence.
    pub tokens: Vec<Vec<u32>>,
    pub prompt_tokens: usize,
    /// Wall time of the prefill step (all prompts in one call, first tokens sampled).
    pub prefill_secs: f64,
    /// Tokens produced by decode steps (all but the first token of each sequence).
    pub decode_tokens: usize,
    pub decode_secs: f64,
}

impl Generation {
    pub fn prefill_tokens_per_sec(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_secs.max(1e-9)
    }

    pub fn decode_tokens_per_sec(&self) -> f64 {
        self.decode_tokens as f64 / self.decode_secs.max(1e-9)
    }
}

/// Generates continuations of `prompts` together. `on_token(i, token)` is called as soon as
/// sequence `i` produces `token` (for streaming).
///
/// Each sequence has its own sampler seeded with `seed + i`, so a prompt's output does not
/// depend on the other prompts of the batch.
pub fn generate(
    model: &Llama,
    prompts: &[Vec<u32>],
    opts: &GenerateOptions,
    mut on_token: impl FnMut(usize, u32) -> Result<()>,
) -> Result<Generation> {
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        bail!("generate: every prompt needs at least one token")
    }
    let batch = prompts.len();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    // The cache holds exactly what this call can produce: no more memory, and (for bf16 on the
    // CPU, where the op converts the keys it reads) no more work per step.
    let max_seq = longest + opts.max_tokens;
    let context = model.config().max_position_embeddings;
    if longest + opts.max_tokens > context {
        bail!(
            "generate: {longest} prompt tokens + {} new tokens exceed the model's context of {context}",
            opts.max_tokens
        )
    }
    let mut cache = model.new_cache(batch, max_seq)?;
    let mut samplers: Vec<Sampler> = (0..batch)
        .map(|i| {
            let mut params = opts.sampling.clone();
            params.seed = params.seed.wrapping_add(i as u64);
            Sampler::new(params)
        })
        .collect();
    // Sampling history (for the repeat penalty): prompt and generated tokens.
    let mut history: Vec<Vec<u32>> = prompts.to_vec();
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); batch];
    let mut done = vec![opts.max_tokens == 0; batch];

    let start = Instant::now();
    let mut inputs = prompts.to_vec();
    let mut prefill_secs = None;
    let mut decode_tokens = 0;
    while done.iter().any(|d| !d) {
        // One copy of the whole (batch, vocab) block to the host per step, rather than one
        // per sequence inside the sampler.
        let logits = model.step(&inputs, &mut cache)?.to_device(&Device::Cpu)?;
        for i in 0..batch {
            if done[i] {
                inputs[i].clear();
                continue;
            }
            let token = samplers[i].sample(&logits.get(i)?, &history[i])?;
            history[i].push(token);
            out[i].push(token);
            on_token(i, token)?;
            if prefill_secs.is_some() {
                decode_tokens += 1;
            }
            done[i] = opts.stop_tokens.contains(&token) || out[i].len() >= opts.max_tokens;
            inputs[i] = if done[i] { Vec::new() } else { vec![token] };
        }
        if prefill_secs.is_none() {
            prefill_secs = Some(start.elapsed().as_secs_f64());
        }
    }
    let prefill_secs = prefill_secs.unwrap_or(0.0);
    Ok(Generation {
        tokens: out,
        prompt_tokens: prompts.iter().map(Vec::len).sum(),
        prefill_secs,
        decode_tokens,
        decode_secs: start.elapsed().as_secs_f64() - prefill_secs,
    })
}
