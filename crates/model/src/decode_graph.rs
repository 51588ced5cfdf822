//! CUDA-graph decode: a decode step captured once into a CUDA graph (cudarc's stream capture on
//! candle's stream) and replayed for every later token, so that a step costs the host one graph
//! launch instead of a few hundred kernel launches.
//!
//! What a step reads and writes lives at fixed device addresses, which is what lets one graph
//! serve every step ([`Llama::decode_on_device`]): the last tokens and the cache lengths are two
//! small buffers, and the positions, the cache rows and the attention's key counts are computed
//! from them on the device. The tensors a step allocates are taken and freed inside the graph
//! (stream-ordered allocation is captured as graph memory nodes).
//!
//! A graph decodes the first `rows` sequences of a cache and advances the length buffer. Over a
//! paged cache the host writes each step's cache rows and page table into the graph's buffers
//! before the replay ([`DecodeGraph::set_inputs`], so only [`crate::Batcher`], which feeds every
//! step from the host, decodes a paged cache through graphs); an empty slot among the rows writes
//! its dummy token into the cache's scratch page ([`KvCache::scratch_page`]). Two ways to use it:
//! - [`Sampling::Greedy`] ([`crate::generate()`]'s greedy decoding): the step ends with the
//!   argmax of each row, written over the token buffer and into host memory that the device
//!   writes directly ([`crate::fused::MappedTokens`]), so replays follow each other with nothing
//!   from the host and no copy between them;
//! - [`Sampling::Logits`]: the step ends with the logits, in an f32 buffer, from which the caller
//!   draws the next tokens after each replay, on the device ([`crate::sampling::sample_rows`],
//!   whose per-row parameters and token counter change every step, so it stays outside the
//!   graph) or on the host. [`crate::generate()`]'s sampled decoding writes the device's draw
//!   into the token buffer ([`DecodeGraph::set_tokens`]); [`crate::Batcher`] writes the next
//!   tokens and lengths from the host ([`DecodeGraph::set_inputs`]), so that sequences may join
//!   and leave between steps.
//!
//! Requirements ([`DecodeGraph::fits`]): [`Llama::decodes_on_device`] (fused kernels, bf16 or f16,
//! a cache of the model's dtype, or of e4m3 once the prefill fixed its scales), a contiguous
//! cache unless every step's inputs come from the host ([`DecodeGraph::fits_fed`]), and cudarc's
//! per-tensor event tracking off on the model's device (its event waits cannot be captured; the
//! examples turn it off, see `examples/common`).

use candle_core::cuda_backend::cudarc::driver::{sys, CudaGraph};
use candle_core::{bail, DType, Device, Result, Tensor};

use crate::model::{DecodeRows, KvCache, Llama};

/// Where a step's tokens are chosen (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sampling {
    Greedy,
    Logits,
}

/// One captured decode step of the first `rows` sequences of a cache.
pub(crate) struct DecodeGraph {
    graph: CudaGraph,
    /// (rows,) u32: each sequence's last token; with [`Sampling::Greedy`], after a step, the
    /// step's output.
    ids: Tensor,
    /// (rows,) u32: the keys each sequence holds before the next step.
    lens: Tensor,
    /// Where the new keys go (read by the graph, so kept alive with it; a paged cache's are
    /// rewritten before each step).
    rows_in: DecodeRows,
    /// [`Sampling::Logits`] (`None`: [`Sampling::Greedy`]): (rows, vocab) f32, the last step's
    /// logits.
    logits: Option<Tensor>,
    /// [`Sampling::Greedy`]: each step's tokens, also written straight to the host by the
    /// step's argmax ([`DecodeGraph::wait_tokens`]).
    mapped: Option<crate::fused::MappedTokens>,
}

impl DecodeGraph {
    /// Whether `model` can decode over `cache` through a graph that replays without the host
    /// (a contiguous cache).
    pub(crate) fn fits(model: &Llama, cache: &KvCache) -> bool {
        cache.paging.is_none() && Self::fits_fed(model, cache)
    }

    /// Whether `model` can decode over `cache` through a graph whose every step's inputs come
    /// from the host ([`DecodeGraph::set_inputs`]): a contiguous or a paged cache.
    pub(crate) fn fits_fed(model: &Llama, cache: &KvCache) -> bool {
        match model.device() {
            Device::Cuda(dev) => model.decodes_on_device(cache) && !dev.cuda_stream().context().is_event_tracking(),
            _ => false,
        }
    }

    /// Runs a decode step of the first `rows` sequences of `cache` from `tokens` (each one's
    /// last token) and `lens` (the keys each holds) eagerly, which also loads every kernel and
    /// warms the allocator, then captures the same step for the steps after it. On return the
    /// step's result is in [`DecodeGraph::tokens`] or [`DecodeGraph::logits`] and the cache
    /// holds each sequence's new key (`cache.lens`, the host's count, is the caller's to
    /// advance).
    /// A paged cache needs [`Sampling::Logits`] and its `scratch` page ([`KvCache::scratch_page`]).
    pub(crate) fn start(
        model: &Llama,
        cache: &KvCache,
        sampling: Sampling,
        tokens: &Tensor,
        lens: &[usize],
        scratch: Option<u32>,
    ) -> Result<Self> {
        match Self::start_then(model, cache, sampling, tokens, lens, scratch, &mut || Ok(true))? {
            Some(graph) => Ok(graph),
            None => bail!("internal error: a decode graph's capture called off"),
        }
    }

    /// [`DecodeGraph::start`], calling `between` once the eager step is queued and before the
    /// capture: the host's time between the two (the capture and instantiation, ~2 ms at the 1B
    /// shape) is the caller's to use first, for work queued before the step (the prefill's
    /// tokens). `between` returning false calls the capture off (`None`; the eager step still
    /// runs).
    pub(crate) fn start_then(
        model: &Llama,
        cache: &KvCache,
        sampling: Sampling,
        tokens: &Tensor,
        lens: &[usize],
        scratch: Option<u32>,
        between: &mut dyn FnMut() -> Result<bool>,
    ) -> Result<Option<Self>> {
        let paged = cache.paging.is_some();
        if !Self::fits_fed(model, cache) || (paged && (sampling != Sampling::Logits || scratch.is_none())) {
            bail!("internal error: a decode graph for a model or cache it does not fit")
        }
        let rows = lens.len();
        if rows == 0 || rows > cache.batch() || tokens.dims() != [rows] || tokens.dtype() != DType::U32 {
            bail!(
                "internal error: decode graph of {rows} rows over a cache of {}, tokens {:?} {:?}",
                cache.batch(),
                tokens.shape(),
                tokens.dtype()
            )
        }
        check_room(cache, lens)?;
        let dev = model.device();
        let rows_in = match scratch.filter(|_| paged) {
            Some(scratch) => {
                let (cache_rows, table) = cache.paged_decode_inputs(lens, scratch)?;
                let width = table.len() / rows;
                DecodeRows::Pages {
                    cache_rows: Tensor::new(cache_rows, dev)?,
                    page_table: Tensor::from_vec(table, (rows, width), dev)?,
                }
            }
            None => {
                let slot_starts: Vec<u32> = (0..rows).map(|i| (i * cache.max_seq()) as u32).collect();
                DecodeRows::Slots {
                    slot_starts: Tensor::new(slot_starts, dev)?,
                }
            }
        };
        let ids = tokens.copy()?;
        let lens = Tensor::new(lens.iter().map(|&l| l as u32).collect::<Vec<u32>>(), dev)?;
        let (logits, mapped) = match sampling {
            Sampling::Greedy => (
                None,
                Some(crate::fused::MappedTokens::new(dev.as_cuda_device()?, rows)?),
            ),
            Sampling::Logits => (
                Some(Tensor::zeros((rows, model.config().vocab_size), DType::F32, dev)?),
                None,
            ),
        };
        let body = || -> Result<()> {
            let step = model.decode_on_device(&ids, &lens, &rows_in, cache)?;
            match &logits {
                // The token over the last one, the key counts advanced, by the argmax itself,
                // which also sends the tokens to the host.
                None => crate::fused::argmax_rows_into(&step, &ids, Some(&lens), mapped.as_ref()),
                Some(buf) => {
                    buf.slice_set(&step.to_dtype(DType::F32)?, 0, 0)?;
                    lens.slice_set(&lens.affine(1.0, 1.0)?, 0, 0)
                }
            }
        };
        // candle uploads the dims and strides of strided ops from host memory; a graph replaying
        // such a copy would read host memory long freed. With this cache on (this thread, until
        // the guard drops), the eager step uploads each such vector once into a device buffer
        // that lives on, and the capture reuses it (a vector the eager step did not upload is an
        // error during the capture, never a stale read).
        let _param_cache = dev.as_cuda_device()?.enable_cuda_graph_htod_cache();
        body()?;
        if !between()? {
            return Ok(None);
        }

        let stream = dev.as_cuda_device()?.cuda_stream();
        let driver = |what: &str, e| candle_core::Error::Msg(format!("flash-llama: decode graph: {what}: {e:?}"));
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| driver("begin capture", e))?;
        // The capture must end whatever the step did, or the stream stays in capture mode.
        let captured = body();
        let ended = stream.end_capture(sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
        captured.map_err(|e| {
            candle_core::Error::Msg(format!(
                "flash-llama: decode graph: a step's launches could not be captured ({e}); decode without graphs (--no-cuda-graphs)"
            ))
        })?;
        let graph = match ended.map_err(|e| driver("end capture", e))? {
            Some(g) => g,
            None => bail!("flash-llama: decode graph: the capture recorded nothing"),
        };
        graph.upload().map_err(|e| driver("upload", e))?;
        Ok(Some(Self {
            graph,
            ids,
            lens,
            rows_in,
            logits,
            mapped,
        }))
    }

    /// Sequences the graph decodes (the first ones of the cache).
    pub(crate) fn rows(&self) -> usize {
        self.lens.dims()[0]
    }

    /// [`Sampling::Logits`]: the next step's inputs from the host, each sequence's last token and
    /// the keys it holds, and over a paged cache their cache rows and page table from `cache`'s
    /// page lists (uploaded here, outside the graph).
    pub(crate) fn set_inputs(
        &self,
        tokens: &[u32],
        lens: &[usize],
        cache: &KvCache,
        scratch: Option<u32>,
    ) -> Result<()> {
        if self.logits.is_none() || tokens.len() != self.rows() || lens.len() != self.rows() {
            bail!("internal error: decode graph inputs for {} rows", self.rows())
        }
        let dev = self.ids.device();
        if let DecodeRows::Pages { cache_rows, page_table } = &self.rows_in {
            let Some(scratch) = scratch else {
                bail!("internal error: a paged decode graph's inputs without a scratch page")
            };
            let (rows, table) = cache.paged_decode_inputs(lens, scratch)?;
            cache_rows.slice_set(&Tensor::new(rows, dev)?, 0, 0)?;
            page_table.slice_set(&Tensor::from_vec(table, page_table.dims(), dev)?, 0, 0)?;
        }
        self.ids.slice_set(&Tensor::new(tokens, dev)?, 0, 0)?;
        let lens: Vec<u32> = lens.iter().map(|&l| l as u32).collect();
        self.lens.slice_set(&Tensor::new(lens, dev)?, 0, 0)
    }

    /// [`Sampling::Logits`]: the next step's tokens from the device, (rows,) u32 (a copy queued
    /// on the stream; the lengths are the graph's own, advanced by every step).
    pub(crate) fn set_tokens(&self, tokens: &Tensor) -> Result<()> {
        if self.logits.is_none() || tokens.dims() != [self.rows()] || tokens.dtype() != DType::U32 {
            bail!(
                "internal error: decode graph tokens {:?} {:?} for {} rows",
                tokens.shape(),
                tokens.dtype(),
                self.rows()
            )
        }
        self.ids.slice_set(tokens, 0, 0)
    }

    /// Queues one more step. `lens` are the keys each sequence holds before it (the host's copy
    /// of what the device holds), checked against the cache's room.
    pub(crate) fn launch(&self, cache: &KvCache, lens: &[usize]) -> Result<()> {
        if lens.len() != self.rows() {
            bail!(
                "internal error: decode graph launch with {} lengths for {} rows",
                lens.len(),
                self.rows()
            )
        }
        check_room(cache, lens)?;
        self.graph
            .launch()
            .map_err(|e| candle_core::Error::Msg(format!("flash-llama: decode graph: launch: {e:?}")))
    }

    /// [`Sampling::Greedy`]: each sequence's newest token, (rows,) u32, as of the last step.
    pub(crate) fn tokens(&self) -> &Tensor {
        &self.ids
    }

    /// [`Sampling::Greedy`]: the tokens of the step that left each sequence holding `lens[r]`
    /// keys (the host's count after that step), once the device has written them to the host: no
    /// copy is queued, so the step after it, if queued already, runs right behind it.
    pub(crate) fn wait_tokens(&self, lens: &[usize]) -> Result<Vec<u32>> {
        let Some(mapped) = &self.mapped else {
            bail!("internal error: the host-mapped tokens of a sampled decode graph")
        };
        let counts: Vec<u32> = lens.iter().map(|&l| l as u32).collect();
        mapped.wait(&counts)
    }

    /// [`Sampling::Logits`]: the last step's logits, (rows, vocab) f32.
    pub(crate) fn logits(&self) -> Result<&Tensor> {
        match &self.logits {
            Some(l) => Ok(l),
            None => bail!("internal error: the logits of a greedy decode graph"),
        }
    }
}

fn check_room(cache: &KvCache, lens: &[usize]) -> Result<()> {
    let max_seq = cache.max_seq();
    if let Some(i) = lens.iter().position(|&l| l >= max_seq) {
        bail!("decode step: sequence {i} already holds the cache's max_seq {max_seq} tokens")
    }
    Ok(())
}
