//! Continuous batching: sequences join a running batch between steps and leave it as soon as
//! they finish, so that one model step serves every request in flight (what a server needs;
//! [`crate::generate()`] runs one fixed batch to its end instead).
//!
//! A [`Batcher`] owns a [`KvCache`] of `slots` sequences of at most `max_seq` tokens each. A
//! request [`Batcher::join`]s a free slot; each [`Batcher::step`] is one [`Llama::step`] over
//! every occupied slot: a newcomer's prompt (its prefill, whole or, with
//! [`Batcher::prefill_chunk`], at most that many tokens a step, so that a long prompt does not
//! stall the others' next tokens), one token for the others, in the same call (the step packs
//! them; attention is one varlen call, or one kvcache call per token count for an fp8 cache). Each sequence samples with its own [`Sampler`] on the host, so
//! its tokens do not depend on what else is in the batch.

use candle_core::{bail, DType, Device, Result};

use crate::model::{KvCache, Llama};
use crate::sampling::{sample_rows, RowSampling, Sampler, SamplingParams};

/// What one sequence asks for.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (a stop token included).
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Tokens that end the sequence (EOS, end of turn); the one that does is emitted.
    pub stop_tokens: Vec<u32>,
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// It produced a stop token.
    Stop,
    /// It produced `max_tokens` tokens.
    Length,
}

/// A token produced by a step: whose, which, and whether it was the sequence's last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Emitted {
    pub id: u64,
    pub token: u32,
    pub finish: Option<Finish>,
}

/// A sequence in a slot.
#[derive(Debug)]
/// A step's tokens: chosen on the device, one per slot row, or the logits for the host's
/// samplers.
enum Picked {
    Tokens(Vec<u32>),
    Logits(candle_core::Tensor),
}

struct Sequence {
    id: u64,
    sampler: Sampler,
    /// Prompt and generated tokens (the repeat penalty's window).
    history: Vec<u32>,
    /// Prompt tokens not yet fed (chunked prefill).
    pending: Vec<u32>,
    /// Its input of the next step once the prompt is in: the last token.
    next: Vec<u32>,
    generated: usize,
    max_tokens: usize,
    stop_tokens: Vec<u32>,
}

/// Where a new request's shared prefix comes from (paged caches): a running sequence's slot, or
/// a finished sequence's retired prefix (`KvCache::retire_sequence`).
#[derive(Debug, Clone, Copy)]
enum PrefixSource {
    Running(usize),
    Retired(usize),
}

/// The running batch (module docs).
pub struct Batcher<'m> {
    model: &'m Llama,
    cache: KvCache,
    slots: Vec<Option<Sequence>>,
    /// Prompt tokens a sequence feeds per step at most (0: the whole prompt at once).
    prefill_chunk: usize,
    /// Decode steps through CUDA graphs where they apply ([`Batcher::cuda_graphs`]).
    cuda_graphs: bool,
    /// The captured decode steps, by rows (a power of two, or all slots).
    #[cfg(feature = "cuda")]
    graphs: std::collections::BTreeMap<usize, crate::decode_graph::DecodeGraph>,
}

impl<'m> Batcher<'m> {
    /// Room for `slots` sequences of at most `max_seq` tokens (prompt and generated), keys and
    /// values held in `kv_cache_dtype` (the model's or `F8E4M3`).
    pub fn new(model: &'m Llama, slots: usize, max_seq: usize, kv_cache_dtype: DType) -> Result<Self> {
        Self::with_cache(model, model.new_cache_of(slots, max_seq, kv_cache_dtype)?)
    }

    /// A batch over `cache` (one slot per sequence of it, emptied first), e.g. a paged one
    /// ([`Llama::new_paged_cache`]): a request then joins only when the pool has pages for all
    /// its tokens (prompt and max_tokens, taken at once so that a running request never meets
    /// an exhausted pool), and gives them back when it ends.
    pub fn with_cache(model: &'m Llama, mut cache: KvCache) -> Result<Self> {
        cache.reset();
        let slots = cache.batch();
        Ok(Self {
            model,
            cache,
            slots: (0..slots).map(|_| None).collect(),
            prefill_chunk: 0,
            cuda_graphs: false,
            #[cfg(feature = "cuda")]
            graphs: Default::default(),
        })
    }

    /// On the GPU, runs a step in which every running sequence decodes one token as the replay
    /// of a CUDA graph of that step (one launch instead of a few hundred; `crate::decode_graph`
    /// says where it applies: fused kernels, bf16/f16, a contiguous or paged cache of the model's
    /// dtype, cudarc's event tracking off). A graph decodes the first rows of the cache, a power
    /// of two that covers the last occupied slot (empty slots among them decode a dummy token
    /// into their own, empty, slot, or over a paged cache into a scratch page the cache then
    /// holds for good: one page less for sequences); the first step of each size runs eagerly
    /// and is captured. Steps with a prompt going in run eagerly. Off by default; no effect on
    /// the CPU.
    pub fn cuda_graphs(mut self, on: bool) -> Self {
        self.cuda_graphs = on;
        self
    }

    /// Feeds prompts `tokens` at a time at most (0, the default: whole): a step's cost then
    /// stays bounded while a long prompt comes in, so the other sequences' tokens keep flowing
    /// (chunked prefill). The sequence samples its first token after its last chunk.
    pub fn prefill_chunk(mut self, tokens: usize) -> Self {
        self.prefill_chunk = tokens;
        self
    }

    /// Tokens one sequence may hold (prompt and generated).
    pub fn max_seq(&self) -> usize {
        self.cache.max_seq()
    }

    /// A paged cache's free pages (`None` for one slot per sequence).
    pub fn free_pages(&self) -> Option<usize> {
        self.cache.free_pages()
    }

    /// Pages of a paged cache that hold finished requests' keys for later prompts that start the
    /// same way (`None` for one slot per sequence); counted in [`Batcher::free_pages`], since the
    /// pool takes them back when it needs them.
    pub fn prefix_cache_pages(&self) -> Option<usize> {
        self.cache.prefix_cache_pages()
    }

    /// Slots a new request could join now.
    pub fn free_slots(&self) -> usize {
        self.slots.iter().filter(|s| s.is_none()).count()
    }

    /// Whether a request of `tokens` tokens (prompt and max_tokens) could join now: a free slot,
    /// and for a paged cache enough free pages.
    pub fn fits(&self, tokens: usize) -> bool {
        let pages = match (self.cache.page_size(), self.cache.free_pages()) {
            (Some(size), Some(free)) => tokens.div_ceil(size) <= free,
            _ => true,
        };
        self.free_slots() > 0 && tokens <= self.cache.max_seq() && pages
    }

    /// Whether a request of `tokens` tokens could ever join (once the batch is empty).
    pub fn could_fit(&self, tokens: usize) -> bool {
        let pages = match (self.cache.page_size(), self.cache.pool_pages()) {
            (Some(size), Some(all)) => tokens.div_ceil(size) <= all,
            _ => true,
        };
        tokens <= self.cache.max_seq() && pages
    }

    /// The batch sizes (rows) whose decode step has been captured into a CUDA graph so far
    /// ([`Batcher::cuda_graphs`]), in increasing order; empty without graphs.
    pub fn cuda_graph_rows(&self) -> Vec<usize> {
        #[cfg(feature = "cuda")]
        {
            self.graphs.keys().copied().collect()
        }
        #[cfg(not(feature = "cuda"))]
        {
            Vec::new()
        }
    }

    /// Sequences in the batch.
    pub fn running(&self) -> usize {
        self.slots.len() - self.free_slots()
    }

    /// Adds a sequence, `id` chosen by the caller (unique among the running ones); it runs from
    /// the next step. Errors: no free slot, an empty prompt, `max_tokens` 0, or more tokens than
    /// a slot holds.
    pub fn join(&mut self, id: u64, request: Request) -> Result<()> {
        let max_seq = self.cache.max_seq();
        if request.prompt.is_empty() || request.max_tokens == 0 {
            bail!("batch: a request needs a prompt and max_tokens >= 1")
        }
        if request.prompt.len() + request.max_tokens > max_seq {
            bail!(
                "batch: {} prompt tokens + max_tokens {} exceed the {max_seq} tokens of a slot",
                request.prompt.len(),
                request.max_tokens
            )
        }
        if self.slots.iter().flatten().any(|s| s.id == id) {
            bail!("batch: sequence {id} is already running")
        }
        let Some(slot) = self.slots.iter().position(Option::is_none) else {
            bail!("batch: no free slot (all {} are running)", self.slots.len())
        };
        self.cache.clear_sequence(slot)?;
        // A paged cache: the whole pages of the longest prefix a running sequence holds already
        // are shared, not recomputed (at least one prompt token is left to feed, for the
        // logits); then every page the request may need, now (an error if the pool lacks them,
        // and the slot is left empty).
        let shared = self.shareable_prefix(&request.prompt);
        match shared {
            Some((PrefixSource::Running(from), tokens)) => self.cache.share_prefix(from, slot, tokens)?,
            Some((PrefixSource::Retired(entry), tokens)) => self.cache.share_retired(entry, slot, tokens)?,
            None => {}
        }
        if let Err(e) = self.cache.reserve(slot, request.prompt.len() + request.max_tokens) {
            self.cache.clear_sequence(slot)?;
            return Err(e);
        }
        let fed = shared.map_or(0, |(_, tokens)| tokens);
        self.slots[slot] = Some(Sequence {
            id,
            sampler: Sampler::new(request.sampling),
            history: request.prompt.clone(),
            pending: request.prompt[fed..].to_vec(),
            next: Vec::new(),
            generated: 0,
            max_tokens: request.max_tokens,
            stop_tokens: request.stop_tokens,
        });
        Ok(())
    }

    /// For a paged cache: the running sequence (slot) or the retired prefix of a finished one
    /// whose cached keys share the longest prefix with `prompt`, in whole pages, leaving at
    /// least one prompt token, and that many tokens; `None` if no page's worth is shared.
    fn shareable_prefix(&self, prompt: &[u32]) -> Option<(PrefixSource, usize)> {
        let page = self.cache.page_size()?;
        let mut best: Option<(PrefixSource, usize)> = self
            .cache
            .retired_match(prompt)
            .map(|(entry, tokens)| (PrefixSource::Retired(entry), tokens));
        for (i, slot) in self.slots.iter().enumerate() {
            let Some(seq) = slot else { continue };
            // The keys it holds: its history, less what it has not fed yet.
            let held = &seq.history[..self.cache.lens()[i]];
            let tokens = crate::kv_cache::shareable_tokens(held, prompt, page);
            if tokens > 0 && best.is_none_or(|(_, t)| tokens > t) {
                best = Some((PrefixSource::Running(i), tokens));
            }
        }
        best
    }

    /// Drops a sequence (its client went away); its slot is free at once. Unknown ids are
    /// ignored.
    pub fn cancel(&mut self, id: u64) {
        for i in 0..self.slots.len() {
            if let Some(seq) = self.slots[i].take_if(|s| s.id == id) {
                let _ = self.cache.retire_sequence(i, &seq.history);
            }
        }
    }

    /// One model step over every running sequence: one token each, in slot order (none for a
    /// sequence still feeding its prompt in chunks). A sequence whose token ends it leaves the
    /// batch (its `finish` is set). On an error every sequence
    /// is dropped (the cache may hold part of the step).
    pub fn step(&mut self) -> Result<Vec<Emitted>> {
        if self.running() == 0 {
            return Ok(Vec::new());
        }
        #[cfg(feature = "cuda")]
        match self.graph_step() {
            Ok(Some(out)) => return Ok(out),
            Ok(None) => {}
            Err(e) => {
                self.slots.iter_mut().for_each(|s| *s = None);
                self.cache.reset();
                self.graphs.clear();
                return Err(e);
            }
        }
        let chunk = self.prefill_chunk;
        let inputs: Vec<Vec<u32>> = self
            .slots
            .iter_mut()
            .map(|slot| match slot {
                None => Vec::new(),
                Some(s) if s.pending.is_empty() => s.next.clone(),
                Some(s) => {
                    let n = if chunk == 0 {
                        s.pending.len()
                    } else {
                        chunk.min(s.pending.len())
                    };
                    s.pending.drain(..n).collect()
                }
            })
            .collect();
        let picked = match self.model.step(&inputs, &mut self.cache).and_then(|l| self.pick(&l)) {
            Ok(p) => p,
            Err(e) => {
                self.slots.iter_mut().for_each(|s| *s = None);
                self.cache.reset();
                return Err(e);
            }
        };
        self.take_tokens(&picked)
    }

    /// The step's tokens from its `logits` (a row per slot): chosen on the GPU
    /// ([`sample_rows`]: one u32 per row comes to the host) when every decoding sequence's
    /// sampling allows it (no repeat penalty), otherwise the logits to the host for each
    /// sequence's [`Sampler`].
    fn pick(&self, logits: &candle_core::Tensor) -> Result<Picked> {
        if logits.device().is_cuda() {
            let rows: Option<Vec<RowSampling>> = self
                .slots
                .iter()
                .take(logits.dim(0)?)
                .map(|slot| match slot {
                    Some(seq) if seq.pending.is_empty() => RowSampling::new(seq.sampler.params(), seq.generated as u64),
                    _ => Some(RowSampling::greedy()),
                })
                .collect();
            if let Some(rows) = rows {
                return Ok(Picked::Tokens(sample_rows(logits, &rows)?.to_vec1::<u32>()?));
            }
        }
        Ok(Picked::Logits(logits.to_device(&Device::Cpu)?))
    }

    /// Takes each decoding sequence's token ([`Batcher::pick`]) and retires the sequences it
    /// ends.
    fn take_tokens(&mut self, picked: &Picked) -> Result<Vec<Emitted>> {
        let mut out = Vec::with_capacity(self.running());
        let mut finished = Vec::new();
        for (i, slot) in self.slots.iter_mut().enumerate() {
            let Some(seq) = slot else { continue };
            if !seq.pending.is_empty() {
                // A chunk of its prompt went in; the rest comes next step.
                continue;
            }
            let token = match picked {
                Picked::Tokens(tokens) => tokens[i],
                Picked::Logits(logits) => seq.sampler.sample(&logits.get(i)?, &seq.history)?,
            };
            seq.history.push(token);
            seq.generated += 1;
            let finish = if seq.stop_tokens.contains(&token) {
                Some(Finish::Stop)
            } else if seq.generated >= seq.max_tokens {
                Some(Finish::Length)
            } else {
                None
            };
            out.push(Emitted {
                id: seq.id,
                token,
                finish,
            });
            match finish {
                Some(_) => {
                    if let Some(seq) = slot.take() {
                        finished.push((i, seq.history));
                    }
                }
                None => seq.next = vec![token],
            }
        }
        // A paged cache keeps their whole pages of keys for later prompts that start the same
        // way; the rest goes back to the pool.
        for (i, history) in finished {
            self.cache.retire_sequence(i, &history)?;
        }
        Ok(out)
    }

    /// A step as the replay of a captured decode step ([`Batcher::cuda_graphs`]), if it applies:
    /// every running sequence decodes (none is feeding its prompt). `None`: run the step eagerly.
    #[cfg(feature = "cuda")]
    fn graph_step(&mut self) -> Result<Option<Vec<Emitted>>> {
        use crate::decode_graph::{DecodeGraph, Sampling};
        use std::collections::btree_map::Entry;
        if !self.cuda_graphs || !DecodeGraph::fits_fed(self.model, &self.cache) {
            return Ok(None);
        }
        if self
            .slots
            .iter()
            .flatten()
            .any(|s| !s.pending.is_empty() || s.next.len() != 1)
        {
            return Ok(None);
        }
        let Some(last) = self.slots.iter().rposition(Option::is_some) else {
            return Ok(None);
        };
        let rows = (last + 1).next_power_of_two().min(self.slots.len());
        let tokens: Vec<u32> = self.slots[..rows]
            .iter()
            .map(|s| s.as_ref().map_or(0, |s| s.next[0]))
            .collect();
        // Empty slots hold no keys (cleared when their sequence ended). Over a paged cache they
        // write their dummy token into its scratch page; without one (no free page for it) the
        // step runs eagerly.
        let lens: Vec<usize> = self.cache.lens()[..rows].to_vec();
        let scratch = match self.cache.page_size() {
            Some(_) => match self.cache.scratch_page() {
                Some(page) => Some(page),
                None => return Ok(None),
            },
            None => None,
        };
        let graph = match self.graphs.entry(rows) {
            Entry::Occupied(e) => {
                let graph = e.into_mut();
                graph.set_inputs(&tokens, &lens, &self.cache, scratch)?;
                graph.launch(&self.cache, &lens)?;
                graph
            }
            Entry::Vacant(e) => {
                let tokens = candle_core::Tensor::new(tokens, self.model.device())?;
                e.insert(DecodeGraph::start(
                    self.model,
                    &self.cache,
                    Sampling::Logits,
                    &tokens,
                    &lens,
                    scratch,
                )?)
            }
        };
        let logits = graph.logits()?.clone();
        let picked = self.pick(&logits)?;
        for (i, slot) in self.slots[..rows].iter().enumerate() {
            if slot.is_some() {
                self.cache.lens[i] += 1;
            }
        }
        self.take_tokens(&picked).map(Some)
    }
}
