//! The generation loop: one prefill step for all prompts, then one decode step per token for
//! the sequences that have not finished.

use std::time::Instant;

use candle_core::{bail, DType, Device, Result};

use crate::model::{KvCache, Llama};
#[cfg(feature = "cuda")]
use crate::sampling::{sample_rows, RowSampling};
use crate::sampling::{Sampler, SamplingParams};

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// Tokens to generate per sequence at most (the stop token included).
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Tokens that end a sequence (EOS, end of turn).
    pub stop_tokens: Vec<u32>,
    /// The KV cache's dtype: `None` for the model's own, or `Some(F8E4M3)` for an fp8 cache
    /// (half the bytes of bf16; see [`KvCache`]).
    pub kv_cache_dtype: Option<DType>,
    /// Decoding on the GPU without a repeat penalty: capture the decode step once into a CUDA
    /// graph and replay it for every later token (one launch per step instead of hundreds; see
    /// `crate::decode_graph` for when it applies: fused kernels, bf16/f16, a contiguous cache of
    /// the model's dtype or of e4m3, cudarc's event tracking off;
    /// [`Llama::decodes_through_cuda_graphs`]). Ignored elsewhere.
    pub cuda_graphs: bool,
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
    /// The part of `decode_secs` the host spent waiting for the device's results (each step's
    /// logits or chosen tokens); the rest is the host's own work (queuing the steps, sampling).
    /// On a GPU, near zero means the host is the bottleneck. On the CPU the work is done
    /// inside the host's calls: there is nothing to wait for.
    pub decode_wait_secs: f64,
    /// When each step's tokens reached the caller, in seconds from the start (the first entry
    /// ends the prefill): the gaps between them are the inter-token latencies.
    pub step_ends_secs: Vec<f64>,
}

impl Generation {
    pub fn prefill_tokens_per_sec(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_secs.max(1e-9)
    }

    pub fn decode_tokens_per_sec(&self) -> f64 {
        self.decode_tokens as f64 / self.decode_secs.max(1e-9)
    }

    /// The inter-token latency at quantile `q` in [0, 1] (nearest rank) over the decode steps, in
    /// seconds; `None` without decode steps.
    pub fn inter_token_latency(&self, q: f64) -> Option<f64> {
        let mut gaps: Vec<f64> = self.step_ends_secs.windows(2).map(|w| w[1] - w[0]).collect();
        if gaps.is_empty() {
            return None;
        }
        gaps.sort_by(f64::total_cmp);
        let rank = (q.clamp(0.0, 1.0) * gaps.len() as f64).ceil().max(1.0) as usize;
        Some(gaps[rank - 1])
    }
}
/// What the token callback of [`generate`] wants for the sequence that produced the token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Go on until a stop token or `max_tokens`.
    Continue,
    /// End the sequence here (a stop string was seen, the client went away); the others go on.
    Stop,
}

/// Generates continuations of `prompts` together. `on_token(i, token)` is called as soon as
/// sequence `i` produces `token` (for streaming); it may end that sequence ([`Flow::Stop`]).
///
/// Each sequence has its own sampler seeded with `seed + i`, so a prompt's output does not
/// depend on the other prompts of the batch.
///
/// On the GPU, decoding without a repeat penalty chooses the tokens there (greedy with the same
/// rules as [`crate::sampling::argmax`], so the same tokens; sampled with
/// [`crate::sampling::sample_rows`]) and overlaps the host's work on each step with the device's
/// work on the step before; a repeat penalty, and the CPU, sample on the host from each step's
/// logits. Where it applies (`opts.cuda_graphs`, the fused kernels in bf16/f16, a cache of the
/// model's dtype, cudarc's event tracking off), the decode steps replay one CUDA graph of the
/// step instead of launching its kernels each time (`crate::decode_graph`; a sampled step's
/// draw follows each replay).
pub fn generate(
    model: &Llama,
    prompts: &[Vec<u32>],
    opts: &GenerateOptions,
    on_token: impl FnMut(usize, u32) -> Result<Flow>,
) -> Result<Generation> {
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        bail!("generate: every prompt needs at least one token")
    }
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
    let mut cache = model.new_cache_of(prompts.len(), max_seq, opts.kv_cache_dtype.unwrap_or(model.dtype()))?;
    #[cfg(feature = "cuda")]
    if let (Some(_), Device::Cuda(dev)) = (RowSampling::new(&opts.sampling, 0), model.device()) {
        // Allocated, like the cache, before the clock starts: page-locked memory takes a system
        // call (up to a millisecond), which is set-up, not prefill.
        let readback = crate::fused::cuda::TokenReadback::new(dev, prompts.len())?;
        let mut run = Progress::new(prompts, opts, on_token);
        choose_on_device(model, readback, prompts, &mut cache, &mut run)?;
        return Ok(run.finish(prompts));
    }
    let mut run = Progress::new(prompts, opts, on_token);
    sample_each_step(model, prompts, &mut cache, &mut run)?;
    Ok(run.finish(prompts))
}

/// The bookkeeping both loops share: tokens so far, which sequences are done, the clocks.
struct Progress<'a, F> {
    opts: &'a GenerateOptions,
    on_token: F,
    out: Vec<Vec<u32>>,
    done: Vec<bool>,
    start: Instant,
    prefill_secs: Option<f64>,
    decode_tokens: usize,
    decode_wait_secs: f64,
    step_ends_secs: Vec<f64>,
}

impl<'a, F: FnMut(usize, u32) -> Result<Flow>> Progress<'a, F> {
    fn new(prompts: &[Vec<u32>], opts: &'a GenerateOptions, on_token: F) -> Self {
        Self {
            opts,
            on_token,
            out: vec![Vec::new(); prompts.len()],
            done: vec![opts.max_tokens == 0; prompts.len()],
            start: Instant::now(),
            prefill_secs: None,
            decode_tokens: 0,
            decode_wait_secs: 0.0,
            step_ends_secs: Vec::new(),
        }
    }

    /// Sequence `i` produced `token`: streams it and ends the sequence on a stop token or at
    /// `max_tokens`.
    fn accept(&mut self, i: usize, token: u32) -> Result<()> {
        self.out[i].push(token);
        let flow = (self.on_token)(i, token)?;
        if self.prefill_secs.is_some() {
            self.decode_tokens += 1;
        }
        self.done[i] =
            flow == Flow::Stop || self.opts.stop_tokens.contains(&token) || self.out[i].len() >= self.opts.max_tokens;
        Ok(())
    }

    /// Called once each step's tokens are accepted: the first call ends the prefill.
    fn end_step(&mut self) {
        let now = self.start.elapsed().as_secs_f64();
        self.step_ends_secs.push(now);
        if self.prefill_secs.is_none() {
            self.prefill_secs = Some(now);
        }
    }

    fn all_done(&self) -> bool {
        self.done.iter().all(|&d| d)
    }

    /// Counts `secs` spent waiting for the device, during decode steps only.
    fn waited(&mut self, secs: f64) {
        if self.prefill_secs.is_some() {
            self.decode_wait_secs += secs;
        }
    }

    fn finish(self, prompts: &[Vec<u32>]) -> Generation {
        let prefill_secs = self.prefill_secs.unwrap_or(0.0);
        Generation {
            tokens: self.out,
            prompt_tokens: prompts.iter().map(Vec::len).sum(),
            prefill_secs,
            decode_tokens: self.decode_tokens,
            decode_secs: self.start.elapsed().as_secs_f64() - prefill_secs,
            decode_wait_secs: self.decode_wait_secs,
            step_ends_secs: self.step_ends_secs,
        }
    }
}

/// One step at a time: the logits come to the host, each sequence's sampler picks its token
/// (the CPU, and a repeat penalty, which needs each sequence's history).
fn sample_each_step<F: FnMut(usize, u32) -> Result<Flow>>(
    model: &Llama,
    prompts: &[Vec<u32>],
    cache: &mut KvCache,
    run: &mut Progress<F>,
) -> Result<()> {
    let batch = prompts.len();
    let mut samplers: Vec<Sampler> = (0..batch)
        .map(|i| {
            let mut params = run.opts.sampling.clone();
            params.seed = params.seed.wrapping_add(i as u64);
            Sampler::new(params)
        })
        .collect();
    // Sampling history (for the repeat penalty): prompt and generated tokens.
    let mut history: Vec<Vec<u32>> = prompts.to_vec();
    let mut inputs = prompts.to_vec();
    while !run.all_done() {
        let logits = model.step(&inputs, cache)?;
        // One copy of the whole (batch, vocab) block to the host per step, rather than one
        // per sequence inside the sampler; it waits for the step to finish.
        let wait = Instant::now();
        let logits = logits.to_device(&Device::Cpu)?;
        run.waited(wait.elapsed().as_secs_f64());
        for i in 0..batch {
            if run.done[i] {
                inputs[i].clear();
                continue;
            }
            let token = samplers[i].sample(&logits.get(i)?, &history[i])?;
            history[i].push(token);
            run.accept(i, token)?;
            inputs[i] = if run.done[i] { Vec::new() } else { vec![token] };
        }
        run.end_step();
    }
    Ok(())
}

/// [`choose_on_device`]'s choice of the next tokens: (logits, the sequences of their rows, the
/// token number they draw) to (rows,) u32 on the device.
#[cfg(feature = "cuda")]
type ChooseTokens<'a> = dyn Fn(candle_core::Tensor, &[usize], usize) -> Result<candle_core::Tensor> + 'a;

/// Decoding on the GPU with each token chosen there: greedy ([`crate::fused::argmax_rows`]) or
/// sampled ([`sample_rows`], no repeat penalty). A step's chosen tokens stay on the device as
/// the next step's input, and that next step is queued *before* the host waits for its copy of
/// them: the host prepares step t + 1 (a few hundred launches) while the device runs step t,
/// instead of the two taking turns. The queued step guesses that no sequence stops at step t;
/// the rows of one that does are dropped (its cache gets one key it never reads). Eagerly,
/// nothing is queued behind the prefill, so that its time is the prompt's alone. The decode
/// steps replay a CUDA graph where it applies ([`graph_decode`]), which is made while the
/// prefill runs.
#[cfg(feature = "cuda")]
fn choose_on_device<F: FnMut(usize, u32) -> Result<Flow>>(
    model: &Llama,
    mut readback: crate::fused::cuda::TokenReadback,
    prompts: &[Vec<u32>],
    cache: &mut KvCache,
    run: &mut Progress<F>,
) -> Result<()> {
    use candle_core::Tensor;
    let batch = prompts.len();
    // Sequences that have a row in `chosen`, in order.
    let mut running: Vec<usize> = (0..batch).filter(|&i| !run.done[i]).collect();
    if running.is_empty() {
        return Ok(());
    }
    let sampling = &run.opts.sampling;
    let greedy = sampling.is_greedy();
    // Sequence i samples with seed + i (as on the host), drawing token number `counter`.
    let rows: Vec<RowSampling> = (0..batch)
        .map(|i| {
            let params = SamplingParams {
                seed: sampling.seed.wrapping_add(i as u64),
                ..sampling.clone()
            };
            RowSampling::new(&params, 0)
        })
        .collect::<Option<_>>()
        .ok_or_else(|| candle_core::Error::Msg("generate: a repeat penalty cannot be sampled on the device".into()))?;
    let choose = |logits: Tensor, running: &[usize], counter: usize| -> Result<Tensor> {
        if greedy {
            return crate::fused::argmax_rows(&logits);
        }
        let of_running: Vec<RowSampling> = running
            .iter()
            .map(|&i| RowSampling {
                counter: counter as u64,
                ..rows[i]
            })
            .collect();
        sample_rows(&logits, &of_running)
    };
    let (ids, new) = model.upload_ids(prompts)?;
    let mut chosen = choose(model.step_logits(&ids, &new, cache)?, &running, 0)?;
    if run.opts.cuda_graphs && crate::decode_graph::DecodeGraph::fits(model, cache) {
        let draw: &ChooseTokens<'_> = &choose;
        return graph_decode(model, readback, chosen, cache, run, (!greedy).then_some(draw));
    }
    let one_each = |running: &[usize]| -> Vec<usize> { (0..batch).map(|i| running.contains(&i) as usize).collect() };
    loop {
        readback.start(&chosen)?;
        // Every running sequence has produced as many tokens as the others; queue the next step
        // if, with these, they may produce another.
        let produced = run.out[running[0]].len() + 1;
        let next = match run.prefill_secs.is_some() && produced < run.opts.max_tokens {
            true => Some(choose(
                model.step_logits(&chosen, &one_each(&running), cache)?,
                &running,
                produced,
            )?),
            false => None,
        };
        let wait = Instant::now();
        let tokens = readback.wait()?;
        run.waited(wait.elapsed().as_secs_f64());
        for (&i, &token) in running.iter().zip(&tokens) {
            run.accept(i, token)?;
        }
        run.end_step();
        // The rows of the sequences that go on.
        let keep: Vec<u32> = (0..)
            .zip(&running)
            .filter(|(_, &i)| !run.done[i])
            .map(|(r, _)| r)
            .collect();
        if keep.is_empty() {
            return Ok(());
        }
        let kept: Vec<usize> = keep.iter().map(|&r| running[r as usize]).collect();
        let rows = |t: Tensor| match keep.len() == running.len() {
            true => Ok(t),
            false => t.index_select(&Tensor::new(keep.as_slice(), t.device())?, 0),
        };
        chosen = match next {
            Some(next) => rows(next)?,
            // After the prefill: the step for these tokens is queued only now.
            None => choose(
                model.step_logits(&rows(chosen)?, &one_each(&kept), cache)?,
                &kept,
                run.out[kept[0]].len(),
            )?,
        };
        running = kept;
    }
}

/// [`choose_on_device`]'s decode steps as replays of one CUDA graph ([`crate::decode_graph`]):
/// `first` holds the prefill's tokens, one per sequence. Greedy (`sampled` None), the graph
/// ends with each row's argmax; sampled, with the logits, and each replay is followed by
/// `sampled(logits, sequences, token number)` (the eager steps' own choice, [`sample_rows`] with
/// each sequence's parameters) over every sequence, whose draw is copied into the graph's token
/// buffer, and a copy of the draw to the host follows; greedy, the argmax writes the tokens
/// into host memory itself ([`crate::fused::MappedTokens`]), so no copy stands between two
/// replays. As there, step t + 1 is queued before the host waits for step t's tokens. Every sequence stays
/// in the graph's batch to the end (its slot has room: no sequence runs more than max_tokens - 1
/// decode steps); the tokens of one that has finished are dropped.
#[cfg(feature = "cuda")]
fn graph_decode<F: FnMut(usize, u32) -> Result<Flow>>(
    model: &Llama,
    mut readback: crate::fused::cuda::TokenReadback,
    first: candle_core::Tensor,
    cache: &mut KvCache,
    run: &mut Progress<F>,
    sampled: Option<&ChooseTokens<'_>>,
) -> Result<()> {
    use crate::decode_graph::{DecodeGraph, Sampling};
    // Sampled: draws token number `counter` of every sequence from the step's logits into the
    // graph's token buffer, queued right behind the step.
    let every: Vec<usize> = (0..run.done.len()).collect();
    let draw = |graph: &DecodeGraph, counter: usize| -> Result<()> {
        match sampled {
            Some(choose) => graph.set_tokens(&choose(graph.logits()?.clone(), &every, counter)?),
            None => Ok(()),
        }
    };
    // Waits for a step's tokens (`wait_for`, timed as the decode's wait) and takes them.
    let accept_all = |run: &mut Progress<F>, wait_for: &dyn Fn() -> Result<Vec<u32>>| -> Result<()> {
        let wait = Instant::now();
        let tokens = wait_for()?;
        run.waited(wait.elapsed().as_secs_f64());
        for (i, &token) in tokens.iter().enumerate() {
            if !run.done[i] {
                run.accept(i, token)?;
            }
        }
        run.end_step();
        Ok(())
    };
    // The prefill's tokens are copied out first. The graph's eager first step is queued behind
    // them, and the host waits for them (streams them) before it captures and instantiates the
    // graph: the eager step's launches (~1.5 ms of host work at the 1B shape) overlap the
    // prefill, the time to the first token stays the prefill's, and the device runs the first
    // decode step during the capture. If the prefill's tokens end every sequence, the capture is
    // called off (the eager step's key in each cache is never read).
    readback.start(&first)?;
    let mode = match sampled {
        None => Sampling::Greedy,
        Some(_) => Sampling::Logits,
    };
    let graph = match run.opts.max_tokens > 1 {
        true => DecodeGraph::start_then(model, cache, mode, &first, cache.lens(), None, &mut || {
            accept_all(run, &|| readback.wait())?;
            Ok(!run.all_done())
        })?,
        false => {
            accept_all(run, &|| readback.wait())?;
            None
        }
    };
    let Some(graph) = graph else {
        return Ok(());
    };
    draw(&graph, 1)?;
    cache.advance_all();
    loop {
        // Greedy, the step's argmax writes its tokens to the host itself
        // ([`DecodeGraph::wait_tokens`], by the counts the step leaves: the host's now); sampled,
        // a copy of the draw is queued behind it.
        let counts = cache.lens().to_vec();
        if sampled.is_some() {
            readback.start(graph.tokens())?;
        }
        // Running sequences have all produced the same number of tokens; with these, they may
        // produce another.
        let produced = (0..run.done.len())
            .filter(|&i| !run.done[i])
            .map(|i| run.out[i].len() + 1)
            .max()
            .unwrap_or(0);
        if produced < run.opts.max_tokens {
            graph.launch(cache, cache.lens())?;
            draw(&graph, produced)?;
            cache.advance_all();
        }
        accept_all(run, &|| match sampled {
            Some(_) => readback.wait(),
            None => graph.wait_tokens(&counts),
        })?;
        if run.all_done() {
            return Ok(());
        }
        if produced >= run.opts.max_tokens {
            candle_core::bail!("internal error: decode graph: sequences still running after max_tokens")
        }
    }
}
