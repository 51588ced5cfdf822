//! The decoder: embeddings, `num_hidden_layers` pre-norm blocks (attention + SwiGLU MLP), a
//! final norm and the output head. Every attention call goes through flash-attn3.
//!
//! Tokens always travel *packed*: a forward call sees a (tokens, hidden) matrix holding the new
//! tokens of every sequence one after the other, plus each sequence's lengths. The projections
//! and the MLP are then single matmuls whatever the mix of lengths, and attention is a varlen
//! call. See [`KvCache`] (module `kv_cache`) for how cached keys are addressed.

use candle_core::{bail, DType, Device, Module, Result, Tensor, D};
use candle_nn::{Embedding, Linear, VarBuilder};
use flash_attn3::fp8::{quantize, Granularity};
use flash_attn3::{FlashAttn, SeqOffsets};

use crate::config::Config;
use crate::fused::{rope_store, silu_mul, CacheStore};
use crate::kv_cache::{write_rows, CacheGroup, E4m3Scales, LayerKv};
pub use crate::kv_cache::{KvCache, E4M3_HEADROOM};
use crate::nn::{apply_rope, rope_angles, rope_angles_per_head, rope_per_head, Kernels, RmsNorm};
use crate::parallel::context::{ring_attention, RingAttention};
use crate::parallel::tensor::{shard_config, sharded_var_builder};
use crate::parallel::Group;

/// Where the keys of one forward call come from; shared by all layers of the call.
enum KeySource {
    /// Attend to the new tokens only: a prefill into an empty cache, or no cache at all.
    /// Queries and keys have the same offsets.
    Fresh { cu: SeqOffsets, max_len: usize },
    /// Attend to the whole cache, gaps included (see [`KvCache`]), after the new tokens were
    /// written into it.
    Cached {
        cu_q: SeqOffsets,
        cu_k: SeqOffsets,
        max_q: usize,
        max_k: usize,
    },
    /// Attend to an fp8 or paged cache (see [`KvCache`]), after the new tokens were written into
    /// it: one `flash_attn_with_kvcache` call per group of sequences with the same number of new
    /// tokens (fp8), or one call with varlen queries (paged 16-bit caches).
    KvCacheCalls {
        groups: Vec<CacheGroup>,
        /// With several groups: the packed row of each output row once the groups' outputs
        /// are concatenated, (tokens,) u32.
        unpermute: Option<Tensor>,
        /// The first two dims of the caches' 4-D view: (batch, max_seq), or (pages, page_size).
        view: (usize, usize),
    },
    /// `batch` sequences of `seq` fresh tokens each, through the textbook attention composite
    /// instead of flash-attn3 ([`Llama::forward_reference`]).
    Reference { batch: usize, seq: usize },
    /// `batch` sequences whose `chunk` tokens here are this rank's consecutive slice of longer
    /// ones, through ring attention over `group` ([`Llama::forward_context_parallel`]).
    Ring { batch: usize, chunk: usize, group: Group },
}

/// The rotary angles of one call, in the run dtype.
enum RopeTables {
    /// (tokens, head_dim / 2): every head of a token turns by the same angles.
    PerToken { cos: Tensor, sin: Tensor },
    /// (tokens, q heads + 2 kv heads, head_dim / 2), the value heads at angle 0: one fused
    /// launch rotates the q and k heads of a fused q/k/v projection and leaves v as it is.
    PerHead { cos: Tensor, sin: Tensor },
    /// A device decode step over a 16-bit cache ([`Llama::decode_on_device`]): where the
    /// attention call does its append inside its kernel (flash-attn3's single-query decode
    /// kernel: one launch turns q and the new key, stores the key and value and attends), it gets
    /// `cos` / `sin` (positions, head_dim / 2) f32 ([`KvCache`]'s tables) and the key counts
    /// before the step, `lens`; elsewhere (more sequences or longer caches than that kernel
    /// takes) the layer runs as with [`RopeTables::PerHead`] over `head_cos` / `head_sin`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    InAttention {
        cos: Tensor,
        sin: Tensor,
        lens: Tensor,
        head_cos: Tensor,
        head_sin: Tensor,
    },
}

/// Where a device-side decode step ([`Llama::decode_on_device`]) stores each sequence's new key
/// and, for a paged cache, which pages the attention reads: device tensors at fixed addresses,
/// so that a CUDA graph of the step serves every later step.
#[cfg(feature = "cuda")]
pub(crate) enum DecodeRows {
    /// A contiguous cache: (rows,) u32, `i × max_seq`, sequence i's first cache row (the key's
    /// row is that plus its position, computed on the device).
    Slots { slot_starts: Tensor },
    /// A paged cache: (rows,) u32, each new key's cache row, and the (rows, max_pages) u32 page
    /// table, both written by the host before each step ([`KvCache::paged_decode_inputs`]).
    Pages { cache_rows: Tensor, page_table: Tensor },
}

/// Per-call state that every layer reads: the rotary angles of each token, where the keys
/// come from and where the new keys go in the cache.
struct Plan {
    rope: RopeTables,
    keys: KeySource,
    /// Runs of new tokens to store: (first packed row, how many, destination cache row).
    writes: Vec<(usize, usize, usize)>,
    /// The same as one cache row per new token, (tokens,) u32 on the device, for the fused GPU
    /// RoPE + KV store ([`crate::fused::rope_store`]); `None` where that kernel is not used.
    cache_rows: Option<Tensor>,
}

/// Cumulative offsets known on the host, uploaded once per call and shared by every layer
/// (the op validates them on the host: no device-to-host copy).
fn cumulative(lens: impl IntoIterator<Item = usize>, device: &Device) -> Result<SeqOffsets> {
    SeqOffsets::from_lengths(lens, device)
}

/// The q, k and v projections: three matmuls (the trainable form, one weight per HF tensor) or,
/// for inference, one matmul over the three weights concatenated at load.
enum QkvProj {
    Separate { q: Linear, k: Linear, v: Linear },
    Fused(Linear),
}

/// Head-dim-64 decode steps whose caches hold at most this many keys a sequence, and at most
/// [`DECODE_KERNEL_MAX_BATCH_KEYS`] over the batch, run their attention on flash-attn3's CUDA-core
/// decode kernel at every batch, instead of that library's own choice (which stops at one CTA per
/// SM: batch 8 for the 1B shape). The call then appends the new key inside its kernel, in place
/// of the model's RoPE + KV store launch, q's copy and the forward kernel. The 1B shape's graph
/// decode (H200, session 48, docs/kernels/model-fused.md), against the forward kernel's path:
/// 640-key caches at batch 16 / 32 / 64 +9.2 / +12.1 / +6.2%; 1,024-key caches at batch 16 / 32 /
/// 64 +5.4 / +8.6 / +2.1%, but batch 128 −5.6% (+1.9% over 640 keys).
const DECODE_KERNEL_MAX_KEYS: usize = 1024;
/// The batch's keys (sequences × cache capacity) past which the forward kernel keeps a step's
/// attention ([`DECODE_KERNEL_MAX_KEYS`]): batch 128 over 1,024 keys (131,072) measured slower.
const DECODE_KERNEL_MAX_BATCH_KEYS: usize = 65_536;

struct Attention {
    qkv: QkvProj,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    attn: FlashAttn,
    /// `attn` asking for flash-attn3's CUDA-core decode kernel wherever it applies
    /// (`Tuning::decode_kernel`), for the decode steps of [`DECODE_KERNEL_MAX_KEYS`].
    decode_attn: FlashAttn,
    /// What `attn` was built with, kept for the reference composite.
    scale: f64,
    window_left: Option<usize>,
    rope_interleaved: bool,
    kernels: Kernels,
}

fn linear(vb: &VarBuilder, in_dim: usize, out_dim: usize, bias: bool, name: &str) -> Result<Linear> {
    let vb = vb.pp(name);
    let weight = vb.get((out_dim, in_dim), "weight")?;
    let bias = if bias { Some(vb.get(out_dim, "bias")?) } else { None };
    Ok(Linear::new(weight, bias))
}

/// One linear layer computing `parts` side by side: their weights (and biases) concatenated
/// along the output axis, once, at load.
fn concat_linear(parts: &[&Linear]) -> Result<Linear> {
    let weights: Vec<&Tensor> = parts.iter().map(|l| l.weight()).collect();
    let weight = Tensor::cat(&weights, 0)?;
    let bias = match parts.iter().map(|l| l.bias()).collect::<Option<Vec<&Tensor>>>() {
        Some(biases) => Some(Tensor::cat(&biases, 0)?),
        None if parts.iter().all(|l| l.bias().is_none()) => None,
        None => bail!("internal error: fusing linear layers of which only some have a bias"),
    };
    Ok(Linear::new(weight, bias))
}

fn rms_norm(vb: &VarBuilder, dim: usize, eps: f64, kernels: Kernels, name: &str) -> Result<RmsNorm> {
    Ok(RmsNorm::new(vb.pp(name).get(dim, "weight")?, eps, kernels))
}

impl Attention {
    fn load(vb: &VarBuilder, cfg: &Config, kernels: Kernels) -> Result<Self> {
        let (h, hk, d) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        let bias = cfg.attention_bias;
        let (q_norm, k_norm) = if cfg.qk_norm {
            (
                Some(rms_norm(vb, d, cfg.rms_norm_eps, kernels, "q_norm")?),
                Some(rms_norm(vb, d, cfg.rms_norm_eps, kernels, "k_norm")?),
            )
        } else {
            (None, None)
        };
        // Causal; a sliding window of w lets each token see itself and the w - 1 keys before it
        // (HF Mistral's mask).
        let scale = 1.0 / (d as f32).sqrt();
        let window_left = cfg.sliding_window.map(|w| w.saturating_sub(1));
        let mut attn = FlashAttn::new(scale).causal(true);
        if window_left.is_some() {
            attn = attn.window(window_left, Some(0));
        }
        let q = linear(vb, cfg.hidden_size, h * d, bias, "q_proj")?;
        let k = linear(vb, cfg.hidden_size, hk * d, bias, "k_proj")?;
        let v = linear(vb, cfg.hidden_size, hk * d, bias, "v_proj")?;
        let qkv = match kernels {
            Kernels::Composed | Kernels::Trainable => QkvProj::Separate { q, k, v },
            Kernels::Fused => QkvProj::Fused(concat_linear(&[&q, &k, &v])?),
        };
        Ok(Self {
            qkv,
            o_proj: linear(vb, h * d, cfg.hidden_size, false, "o_proj")?,
            q_norm,
            k_norm,
            heads: h,
            kv_heads: hk,
            head_dim: d,
            decode_attn: attn.clone().tuning(flash_attn3::Tuning {
                decode_kernel: Some(true),
                ..Default::default()
            }),
            attn,
            scale: scale as f64,
            window_left,
            rope_interleaved: cfg.rope_interleaved,
            kernels,
        })
    }

    /// The attention sub-block over `input.norm(norm)` (tokens, hidden): returns the residual
    /// stream before it and the attention's output (tokens, hidden). `cache` is this layer's keys
    /// and values, if any: the new keys and values are stored there before attending.
    fn forward(
        &self,
        input: &Residual,
        norm: &RmsNorm,
        plan: &Plan,
        cache: Option<&LayerKv>,
    ) -> Result<(Tensor, Tensor)> {
        let tokens = input.x.dim(0)?;
        let (h, hk, d) = (self.heads, self.kv_heads, self.head_dim);
        let residual;
        // q (tokens, h, d), k and v (tokens, hk, d); possibly strided views of one fused output.
        let (q, k, v) = match &self.qkv {
            QkvProj::Separate { q, k, v } => {
                let x;
                (residual, x) = input.normed(norm)?;
                (
                    q.forward(&x)?.reshape((tokens, h, d))?,
                    k.forward(&x)?.reshape((tokens, hk, d))?,
                    v.forward(&x)?.reshape((tokens, hk, d))?,
                )
            }
            QkvProj::Fused(qkv) => {
                let y;
                (residual, y) = input.project(norm, qkv, self.kernels)?;
                let y = y.reshape((tokens, h + 2 * hk, d))?;
                if let Some(out) = self.attend_appending(&y, plan, cache)? {
                    let out = project(&self.o_proj, &out.reshape((tokens, h * d))?, self.kernels)?;
                    return Ok((residual, out));
                }
                if let RopeTables::PerHead { cos, sin }
                | RopeTables::InAttention {
                    head_cos: cos,
                    head_sin: sin,
                    ..
                } = &plan.rope
                {
                    let y = if y.device().is_cuda() {
                        // One kernel where the store fuses into the rotation (q and k rotated in
                        // place, v unchanged, k and v stored); otherwise the rotation, then the
                        // layer's own store: an fp8 cache's first write (its scales come from the
                        // rotated values).
                        let rows = || {
                            plan.cache_rows.as_ref().ok_or_else(|| {
                                candle_core::Error::Msg("internal error: a GPU cache write without its rows".into())
                            })
                        };
                        let fused = match cache {
                            Some(LayerKv::Rows(kv)) => Some(CacheStore::Rows { kv, rows: rows()? }),
                            Some(LayerKv::E4m3 { kv, scales }) => match scales.get() {
                                Some(s) => Some(CacheStore::E4m3 {
                                    kv,
                                    rows: rows()?,
                                    quant: &s.quant,
                                }),
                                None => None,
                            },
                            _ => None,
                        };
                        let store_after = fused.is_none();
                        rope_store(&y, cos, sin, self.rope_interleaved, fused)?;
                        if let (true, Some(layer)) = (store_after, cache) {
                            layer.store(&y.narrow(1, h, 2 * hk)?, &plan.writes, plan.cache_rows.as_ref())?;
                        }
                        y
                    } else {
                        // q and k rotated, v passed through, in one launch.
                        let y = rope_per_head(&y, cos, sin, self.rope_interleaved)?;
                        // k and v are adjacent in each row: one store for both.
                        if let Some(layer) = cache {
                            layer.store(&y.narrow(1, h, 2 * hk)?, &plan.writes, None)?;
                        }
                        y
                    };
                    let (q, k, v) = (y.narrow(1, 0, h)?, y.narrow(1, h, hk)?, y.narrow(1, h + hk, hk)?);
                    return Ok((residual, self.attend(q, k, v, tokens, plan, cache)?));
                }
                (y.narrow(1, 0, h)?, y.narrow(1, h, hk)?, y.narrow(1, h + hk, hk)?)
            }
        };
        let (mut q, mut k) = (q, k);
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        let RopeTables::PerToken { cos, sin } = &plan.rope else {
            bail!("internal error: per-head or in-attention rotary tables for separate q/k/v projections")
        };
        let q = apply_rope(&q, cos, sin, self.rope_interleaved, self.kernels)?;
        let k = apply_rope(&k, cos, sin, self.rope_interleaved, self.kernels)?;
        match cache {
            // Two strided copies, without joining k and v first.
            Some(LayerKv::Rows(kv)) => {
                write_rows(kv, &k, 0, &plan.writes)?;
                write_rows(kv, &v, hk, &plan.writes)?;
            }
            Some(layer) => layer.store(&Tensor::cat(&[&k, &v], 1)?, &plan.writes, plan.cache_rows.as_ref())?,
            None => {}
        }
        Ok((residual, self.attend(q, k, v, tokens, plan, cache)?))
    }

    /// Attends (over the fresh k and v, or over `cache`, where they were stored) and projects
    /// the output back.
    fn attend(
        &self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        tokens: usize,
        plan: &Plan,
        cache: Option<&LayerKv>,
    ) -> Result<Tensor> {
        // GQA is the op's business: k/v keep their kv_heads, no repeat. q, k and v may be
        // strided views (rows of a fused projection): the op reads any row stride.
        let out = match (&plan.keys, cache) {
            (KeySource::Fresh { cu, max_len }, _) => self
                .attn
                .forward_varlen_offsets(&q, &k, &v, cu, cu, *max_len, *max_len)?,
            (
                KeySource::Cached {
                    cu_q,
                    cu_k,
                    max_q,
                    max_k,
                },
                Some(LayerKv::Rows(kv)),
            ) => {
                let hk = self.kv_heads;
                let (ck, cv) = (kv.narrow(1, 0, hk)?, kv.narrow(1, hk, hk)?);
                self.attn
                    .forward_varlen_offsets(&q, &ck, &cv, cu_q, cu_k, *max_q, *max_k)?
            }
            (
                KeySource::KvCacheCalls {
                    groups,
                    unpermute,
                    view,
                },
                Some(layer),
            ) => {
                let scales = match layer {
                    LayerKv::E4m3 { scales, .. } => match scales.get() {
                        Some(s) => Some(s),
                        None => bail!("internal error: reading an fp8 cache layer that was never written"),
                    },
                    _ => None,
                };
                let caches = layer.cache_views(*view, self.kv_heads, self.head_dim)?;
                self.attend_cache(&q, &caches, scales, groups, unpermute.as_ref())?
            }
            (KeySource::Cached { .. } | KeySource::KvCacheCalls { .. }, _) => {
                bail!("internal error: a cached plan without its kind of cache")
            }
            (KeySource::Reference { batch, seq }, _) => self.reference_attention(&q, &k, &v, *batch, *seq)?,
            (KeySource::Ring { batch, chunk, group }, _) => {
                let (b, c) = (*batch, *chunk);
                let q = q.reshape((b, c, self.heads, self.head_dim))?;
                let k = k.reshape((b, c, self.kv_heads, self.head_dim))?;
                let v = v.reshape((b, c, self.kv_heads, self.head_dim))?;
                let ring = RingAttention::new(self.scale as f32).causal(true);
                ring_attention(ring, group, &q, &k, &v)?.reshape((b * c, self.heads, self.head_dim))?
            }
        };
        project(
            &self.o_proj,
            &out.reshape((tokens, self.heads * self.head_dim))?,
            self.kernels,
        )
    }

    /// The attention of a device decode step ([`RopeTables::InAttention`]) over the fused
    /// projection's rows `y` (batch, heads + 2 kv heads, d), unturned, as one
    /// `flash_attn_with_kvcache` call that appends each sequence's new key and value into this
    /// layer's 16-bit cache and turns q and the key, where that call does its append inside its
    /// kernel: the output (batch, heads, d). None where it does not (the layer then turns and
    /// stores with its own kernel) or the plan is another.
    fn attend_appending(&self, y: &Tensor, plan: &Plan, cache: Option<&LayerKv>) -> Result<Option<Tensor>> {
        let (
            RopeTables::InAttention { cos, sin, lens, .. },
            KeySource::KvCacheCalls { groups, view, .. },
            Some(layer @ LayerKv::Rows(_)),
        ) = (&plan.rope, &plan.keys, cache)
        else {
            return Ok(None);
        };
        let [g] = groups.as_slice() else {
            bail!("internal error: an appending cache call over {} groups", groups.len())
        };
        if g.new != 1 || g.rows.is_some() || g.cu_q.is_some() || g.cache_idx.is_some() {
            bail!("internal error: an appending cache call takes one token per sequence")
        }
        let (h, hk) = (self.heads, self.kv_heads);
        let (k_cache, v_cache) = layer.cache_views(*view, hk, self.head_dim)?;
        // (batch, 1, heads, d) views of the fused projection's rows: no copy.
        let (q, k_new, v_new) = (
            y.narrow(1, 0, h)?.unsqueeze(1)?,
            y.narrow(1, h, hk)?.unsqueeze(1)?,
            y.narrow(1, h + hk, hk)?.unsqueeze(1)?,
        );
        // Short caches at head dim 64: flash-attn3's decode kernel at every batch, so that the
        // call appends inside its kernel (DECODE_KERNEL_MAX_KEYS).
        let capacity = match &g.page_table {
            Some(table) => table.dim(1)? * k_cache.dim(1)?,
            None => k_cache.dim(1)?,
        };
        let short = capacity <= DECODE_KERNEL_MAX_KEYS && g.batch * capacity <= DECODE_KERNEL_MAX_BATCH_KEYS;
        let attn = match self.head_dim == 64 && short {
            true => &self.decode_attn,
            false => &self.attn,
        };
        let mut call =
            attn.kv_cache(&k_cache, &v_cache, lens)
                .append(&k_new, &v_new)
                .rotary(cos, sin, self.rope_interleaved);
        if let Some(table) = &g.page_table {
            call = call.page_table(table);
        }
        if !call.appends_in_kernel(&q)? {
            return Ok(None);
        }
        Ok(Some(call.forward(&q)?.reshape((g.batch, h, self.head_dim))?))
    }

    /// Attention of `q` (tokens, heads, d) over a cache layer's k and v, (slots or pages, rows,
    /// kv_heads, d) each ([`LayerKv::cache_views`]), holding the keys of this step already: one
    /// `flash_attn_with_kvcache` call per group. An e4m3 layer (`scales`) gets q quantized for the
    /// call. Output in q's dtype, (tokens, heads, d), rows in packed order.
    fn attend_cache(
        &self,
        q: &Tensor,
        (k_cache, v_cache): &(Tensor, Tensor),
        scales: Option<&E4m3Scales>,
        groups: &[CacheGroup],
        unpermute: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (h, hk, d) = (self.heads, self.kv_heads, self.head_dim);
        // The fp8 call's output is bf16 or f16: f16 models keep f16, the rest go through bf16.
        let out_dtype = match q.dtype() {
            DType::F16 => DType::F16,
            _ => DType::BF16,
        };
        let mut outs = Vec::with_capacity(groups.len());
        for g in groups {
            if let Some(cu_q) = &g.cu_q {
                // Varlen queries: q packed as it is, the output likewise (tokens, heads, d).
                let mut call = self.attn.kv_cache(k_cache, v_cache, &g.seqlens).varlen_q(cu_q);
                if let Some(table) = &g.page_table {
                    call = call.page_table(table);
                }
                outs.push(call.forward(q)?);
                continue;
            }
            let qg = match &g.rows {
                None => q.clone(),
                Some(rows) => q.contiguous()?.index_select(rows, 0)?,
            };
            let (qg, attn) = match scales {
                None => (qg.reshape((g.batch, g.new, h, d))?, self.attn.clone()),
                Some(scales) => {
                    let (q8, q_descale) = if g.new == 1 {
                        // One scale per (sequence, kv head): a token's heads of one GQA group
                        // are adjacent rows, so q viewed as (batch × kv_heads, group, 1, d)
                        // makes each group one "head" of the quantizer. A q descale shared by
                        // the group lets the kernel pack the group's heads into one tile
                        // (pack-GQA), reading K and V once per kv head instead of once per q
                        // head.
                        let grouped = quantize(&qg.reshape((g.batch * hk, h / hk, 1, d))?, Granularity::Head)?;
                        (
                            grouped.data.reshape((g.batch, 1, h, d))?,
                            grouped.descale.reshape((g.batch, hk))?,
                        )
                    } else {
                        let per_head = quantize(&qg.reshape((g.batch, g.new, h, d))?, Granularity::Head)?;
                        (per_head.data, per_head.descale)
                    };
                    let attn = self
                        .attn
                        .clone()
                        .descale(Some(&q_descale), Some(&scales.k_descale), Some(&scales.v_descale))
                        .out_dtype(out_dtype);
                    (q8, attn)
                }
            };
            let mut call = attn.kv_cache(k_cache, v_cache, &g.seqlens);
            if let Some(idx) = &g.cache_idx {
                call = call.cache_batch_idx(idx);
            }
            if let Some(table) = &g.page_table {
                call = call.page_table(table);
            }
            outs.push(call.forward(&qg)?.reshape((g.batch * g.new, h, d))?);
        }
        let out = match unpermute {
            None if outs.len() == 1 => outs.pop().expect("one group"),
            Some(order) => Tensor::cat(&outs, 0)?.index_select(order, 0)?,
            None => bail!("internal error: {} cache groups without their order", outs.len()),
        };
        out.to_dtype(q.dtype())
    }

    /// softmax(q·kᵀ·scale + mask)·v over `batch` sequences of `seq` tokens, written with plain
    /// candle ops (k/v repeated over each GQA group, the full seq × seq score matrix). The
    /// reference that flash-attn3 must match, gradients included; q, k, v are (tokens, heads, d).
    fn reference_attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, batch: usize, seq: usize) -> Result<Tensor> {
        let (h, hk, d) = (self.heads, self.kv_heads, self.head_dim);
        // (tokens, heads, d) → (batch, heads, seq, d); kv head j serves q heads j·g .. (j+1)·g.
        let per_head = |x: &Tensor, heads: usize| x.reshape((batch, seq, heads, d))?.transpose(1, 2);
        let repeat = |x: Tensor| -> Result<Tensor> {
            let group = h / hk;
            x.unsqueeze(2)?
                .broadcast_as((batch, hk, group, seq, d))?
                .reshape((batch, h, seq, d))
        };
        let q = per_head(q, h)?.contiguous()?;
        let k = repeat(per_head(k, hk)?)?;
        let v = repeat(per_head(v, hk)?)?;
        // Query i sees key j when j <= i (and i - j <= left with a sliding window).
        let mask: Vec<f32> = (0..seq)
            .flat_map(|i| {
                (0..seq).map(move |j| {
                    let visible = j <= i && self.window_left.is_none_or(|left| i - j <= left);
                    if visible {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (seq, seq), q.device())?.to_dtype(q.dtype())?;
        let scores = (q.matmul(&k.t()?)? * self.scale)?.broadcast_add(&mask)?;
        // Softmax from basic ops; the row maximum only keeps exp in range, so it needs no gradient.
        let max = scores.max_keepdim(D::Minus1)?.detach();
        let p = scores.broadcast_sub(&max)?.exp()?;
        let p = p.broadcast_div(&p.sum_keepdim(D::Minus1)?)?;
        p.matmul(&v)?.transpose(1, 2)?.reshape((batch * seq, h, d))
    }
}

/// The residual stream between two sub-blocks: `x`, and the output `h` of the sub-block before,
/// not yet added to it (`None` before the first block). The next sub-block reads
/// `norm(x + h)`, and `x + h` becomes the stream after it. The add and the norm are left to the
/// sub-block's first projection: at one token on the GPU they run inside its matrix-vector launch
/// ([`crate::fused::linear_vector_add_norm`]); otherwise one [`RmsNorm::add_forward`] first.
struct Residual {
    x: Tensor,
    h: Option<Tensor>,
    /// Before the first block only (`h` None): `norm(x)` by the first block's input norm, where
    /// it was computed with the embedding lookup ([`crate::fused::decode_prologue`]).
    first_normed: Option<Tensor>,
}

impl Residual {
    /// The stream after a sub-block: `x`, and `h` not yet added to it.
    fn after(x: Tensor, h: Tensor) -> Self {
        Self {
            x,
            h: Some(h),
            first_normed: None,
        }
    }

    /// `(x + h, norm(x + h))`.
    fn normed(&self, norm: &RmsNorm) -> Result<(Tensor, Tensor)> {
        match (&self.h, &self.first_normed) {
            (None, Some(normed)) => Ok((self.x.clone(), normed.clone())),
            (None, None) => Ok((self.x.clone(), norm.forward(&self.x)?)),
            (Some(h), _) => norm.add_forward(&self.x, h),
        }
    }

    /// `(x + h, linear(norm(x + h)))`.
    fn project(&self, norm: &RmsNorm, linear: &Linear, kernels: Kernels) -> Result<(Tensor, Tensor)> {
        if let (Some(h), Kernels::Fused) = (&self.h, kernels) {
            let w = linear.weight();
            if crate::fused::linear_vector_add_norm_fits(&self.x, h, norm.weight(), w) {
                return crate::fused::linear_vector_add_norm(&self.x, h, norm.weight(), norm.eps(), w, linear.bias());
            }
        }
        let (sum, normed) = self.normed(norm)?;
        Ok((sum, project(linear, &normed, kernels)?))
    }
}

/// Up to this many rows (tokens) a projection with fused kernels on the GPU goes through
/// [`crate::fused::linear_rows`] rather than cuBLAS. H200, the 1B shape's graph decode against
/// cuBLAS at every batch (docs/kernels/model-fused.md, "linear_rows"): batch 2 / 8 / 16 +9.3 /
/// +5.2 / +3.1%, batch 32 −0.2%, batch 64 −8.4% (the kernel's share of the wgmma work per weight
/// byte grows with the tokens; cuBLAS's tiles keep up there).
const LINEAR_ROWS_MODEL_MAX_TOKENS: usize = 16;

/// `linear.forward(x)`; with fused kernels on the GPU, the one row of a batch-1 decode step goes
/// through [`crate::fused::linear_vector`] and the 2-16 rows of a batched one through
/// [`crate::fused::linear_rows`] (one launch each, whose first weight loads overlap the kernel
/// before) where their shape rules hold.
fn project(linear: &Linear, x: &Tensor, kernels: Kernels) -> Result<Tensor> {
    if kernels == Kernels::Fused {
        if crate::fused::linear_vector_fits(x, linear.weight()) {
            return crate::fused::linear_vector(x, linear.weight(), linear.bias());
        }
        if x.dim(0)? <= LINEAR_ROWS_MODEL_MAX_TOKENS && crate::fused::linear_rows_fits(x, linear.weight()) {
            return crate::fused::linear_rows(x, linear.weight(), linear.bias());
        }
    }
    linear.forward(x)
}

/// On the CPU, up to this many tokens per call (decode steps), the MLP runs the fused gate/up
/// matmul and SiLU and the product on its two strided halves (fewest launches); above it
/// (prefill), two matmuls over the halves of the fused weight give contiguous outputs for the
/// elementwise ops. The GPU always runs the fused matmul and [`silu_mul`].
const FUSED_MLP_MAX_TOKENS: usize = 64;

/// The gate and up projections: two matmuls (trainable form) or one over both weights
/// concatenated at load (inference).
enum GateUp {
    Separate { gate: Linear, up: Linear },
    Fused(Linear),
}

struct Mlp {
    gate_up: GateUp,
    down_proj: Linear,
    intermediate: usize,
    kernels: Kernels,
}

impl Mlp {
    fn load(vb: &VarBuilder, cfg: &Config, kernels: Kernels) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let gate = linear(vb, h, i, false, "gate_proj")?;
        let up = linear(vb, h, i, false, "up_proj")?;
        let gate_up = match kernels {
            Kernels::Composed | Kernels::Trainable => GateUp::Separate { gate, up },
            Kernels::Fused => GateUp::Fused(concat_linear(&[&gate, &up])?),
        };
        Ok(Self {
            gate_up,
            down_proj: linear(vb, i, h, false, "down_proj")?,
            intermediate: i,
            kernels,
        })
    }

    /// The MLP sub-block over `input.norm(norm)` (tokens, hidden): returns the residual stream
    /// before it and the MLP's output (tokens, hidden).
    fn forward(&self, input: &Residual, norm: &RmsNorm) -> Result<(Tensor, Tensor)> {
        if let GateUp::Fused(gate_up) = &self.gate_up {
            if input.x.device().is_cuda() {
                // At one token, the gate/up launch writes silu(gate) · up itself.
                if let (Some(h), Kernels::Fused) = (&input.h, self.kernels) {
                    let w = gate_up.weight();
                    if gate_up.bias().is_none()
                        && crate::fused::linear_vector_add_norm_swiglu_fits(&input.x, h, norm.weight(), w)
                    {
                        let (residual, act) =
                            crate::fused::linear_vector_add_norm_swiglu(&input.x, h, norm.weight(), norm.eps(), w)?;
                        return Ok((residual, project(&self.down_proj, &act, self.kernels)?));
                    }
                }
                // Otherwise `silu_mul` reads both halves of the fused output, whatever the tokens.
                let (residual, y) = input.project(norm, gate_up, self.kernels)?;
                let out = project(&self.down_proj, &silu_mul(&y)?, self.kernels)?;
                return Ok((residual, out));
            }
        }
        let (residual, x) = input.normed(norm)?;
        Ok((residual, self.forward_normed(&x)?))
    }

    /// The MLP of a normed input x, on the CPU or with separate gate and up weights.
    fn forward_normed(&self, x: &Tensor) -> Result<Tensor> {
        let (gate, up) = match &self.gate_up {
            GateUp::Separate { gate, up } => (gate.forward(x)?, up.forward(x)?),
            GateUp::Fused(gate_up) if x.dim(0)? <= FUSED_MLP_MAX_TOKENS => {
                let y = gate_up.forward(x)?;
                let i = self.intermediate;
                (y.narrow(D::Minus1, 0, i)?, y.narrow(D::Minus1, i, i)?)
            }
            GateUp::Fused(gate_up) => {
                // Many tokens (prefill): launches do not matter, but SiLU and the product on
                // strided halves of one wide output are slower than on two contiguous outputs;
                // the two halves of the fused weight are contiguous row blocks, used as they are.
                let (w, i) = (gate_up.weight(), self.intermediate);
                (x.matmul(&w.narrow(0, 0, i)?.t()?)?, x.matmul(&w.narrow(0, i, i)?.t()?)?)
            }
        };
        let act = match self.kernels {
            Kernels::Trainable => crate::train_ops::swiglu(&gate, &up)?,
            _ => (gate.silu()? * up)?,
        };
        self.down_proj.forward(&act)
    }
}

struct Block {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

/// A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3; see [`Config`]).
pub struct Llama {
    cfg: Config,
    embed_tokens: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Linear,
    inv_freq: Tensor,
    /// With fused kernels and no q/k norm: the per-head inverse frequencies (q and k heads:
    /// `inv_freq`, v heads: 0) of [`RopeTables::PerHead`]; otherwise `None`.
    inv_freq_heads: Option<Tensor>,
    dtype: DType,
    device: Device,
    kernels: Kernels,
    /// Tensor parallelism: this model is one rank's shard, and each sub-block's output is
    /// summed over the group ([`crate::parallel::tensor`]).
    tensor_parallel: Option<Group>,
}

impl Llama {
    /// Builds the model from HF tensor names (`model.layers.0.self_attn.q_proj.weight`, ...).
    /// Missing or mis-shaped tensors are errors naming the tensor.
    pub fn load(vb: VarBuilder, cfg: &Config, kernels: Kernels) -> Result<Self> {
        cfg.validate().map_err(candle_core::Error::wrap)?;
        let m = vb.pp("model");
        let embed = m.get((cfg.vocab_size, cfg.hidden_size), "embed_tokens.weight")?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let l = m.pp(format!("layers.{i}"));
            let eps = cfg.rms_norm_eps;
            layers.push(Block {
                input_layernorm: rms_norm(&l, cfg.hidden_size, eps, kernels, "input_layernorm")?,
                self_attn: Attention::load(&l.pp("self_attn"), cfg, kernels)?,
                post_attention_layernorm: rms_norm(&l, cfg.hidden_size, eps, kernels, "post_attention_layernorm")?,
                mlp: Mlp::load(&l.pp("mlp"), cfg, kernels)?,
            });
        }
        let norm = rms_norm(&m, cfg.hidden_size, cfg.rms_norm_eps, kernels, "norm")?;
        // Tied models reuse the embedding matrix as the output head (same storage, no copy).
        let head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            vb.get((cfg.vocab_size, cfg.hidden_size), "lm_head.weight")?
        };
        let device = vb.device().clone();
        let inv_freq = cfg.rope_inv_freq();
        let inv_freq_heads = match (kernels, cfg.qk_norm) {
            (Kernels::Fused, false) => {
                let (h, hk) = (cfg.num_attention_heads, cfg.num_key_value_heads);
                let zeros = vec![0.0; inv_freq.len()];
                let table: Vec<_> = (0..h + 2 * hk)
                    .flat_map(|head| if head < h + hk { inv_freq.clone() } else { zeros.clone() })
                    .collect();
                Some(Tensor::from_vec(table, (h + 2 * hk, inv_freq.len()), &device)?)
            }
            _ => None,
        };
        Ok(Self {
            inv_freq: Tensor::new(inv_freq, &device)?,
            inv_freq_heads,
            embed_tokens: Embedding::new(embed, cfg.hidden_size),
            layers,
            norm,
            lm_head: Linear::new(head, None),
            cfg: cfg.clone(),
            dtype: vb.dtype(),
            device,
            kernels,
            tensor_parallel: None,
        })
    }

    /// This rank's shard, on `device`, of the model whose full tensors `vb` reads (on the CPU
    /// is best: only the slices are copied) and whose full shape `cfg` describes, for
    /// tensor-parallel inference over `group` ([`crate::parallel::tensor`]). Its
    /// [`Llama::config`] is the shard's (heads and MLP width divided by the ranks). Every rank
    /// must make the same calls; each returns the full model's logits.
    pub fn load_tensor_parallel(
        vb: VarBuilder,
        cfg: &Config,
        kernels: Kernels,
        group: Group,
        device: &Device,
    ) -> Result<Self> {
        if kernels == Kernels::Trainable {
            bail!("tensor parallelism is for inference: load with fused or composed kernels")
        }
        let (rank, world) = (group.rank(), group.world_size());
        let shard = shard_config(cfg, world)?;
        let mut model = Self::load(sharded_var_builder(vb, rank, world, device), &shard, kernels)?;
        model.tensor_parallel = Some(group);
        Ok(model)
    }

    /// The tensor-parallel group this model is a shard of, if any.
    pub fn tensor_parallel(&self) -> Option<&Group> {
        self.tensor_parallel.as_ref()
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// An empty cache in this model's dtype and device.
    pub fn new_cache(&self, batch: usize, max_seq: usize) -> Result<KvCache> {
        KvCache::new(&self.cfg, batch, max_seq, self.dtype, &self.device)
    }

    /// Whether [`crate::generate()`] and [`crate::Batcher`] (with CUDA graphs on) decode over
    /// `cache` by replaying one captured CUDA graph per step: fused kernels on a GPU whose
    /// cudarc event tracking is off, bf16 or f16, and a contiguous cache of the model's dtype, or
    /// of e4m3 once its first write (the prefill) fixed its scales. Otherwise each step launches
    /// its kernels. ([`crate::Batcher`] decodes a paged cache through graphs as well, under the
    /// same conditions; [`crate::Batcher::cuda_graph_rows`] says which it captured.)
    pub fn decodes_through_cuda_graphs(&self, cache: &KvCache) -> bool {
        #[cfg(feature = "cuda")]
        {
            crate::decode_graph::DecodeGraph::fits(self, cache)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = cache; // no graphs without the `cuda` feature
            false
        }
    }

    /// An empty cache on this model's device holding keys and values in `dtype`: the model's
    /// own, or `F8E4M3` (half the bytes of bf16; see [`KvCache`]).
    pub fn new_cache_of(&self, batch: usize, max_seq: usize, dtype: DType) -> Result<KvCache> {
        self.check_cache_dtype(dtype)?;
        KvCache::new(&self.cfg, batch, max_seq, dtype, &self.device)
    }

    /// An empty paged cache on this model's device: `pages` pages of `page_size` tokens shared
    /// by `batch` sequences of at most `max_seq` tokens each, in `dtype` (the model's or
    /// `F8E4M3`); see [`KvCache::new_paged`].
    pub fn new_paged_cache(
        &self,
        batch: usize,
        pages: usize,
        page_size: usize,
        max_seq: usize,
        dtype: DType,
    ) -> Result<KvCache> {
        self.check_cache_dtype(dtype)?;
        KvCache::new_paged(&self.cfg, batch, pages, page_size, max_seq, dtype, &self.device)
    }

    fn check_cache_dtype(&self, dtype: DType) -> Result<()> {
        if dtype != self.dtype && dtype != DType::F8E4M3 {
            bail!(
                "a KV cache holds the model's dtype ({:?}) or f8e4m3, not {dtype:?}",
                self.dtype
            )
        }
        if dtype == DType::F8E4M3 && self.cfg.head_dim % 16 != 0 {
            bail!(
                "an fp8 KV cache needs a head dim that is a multiple of 16 (fp8 attention's tile), this model's is {}",
                self.cfg.head_dim
            )
        }
        Ok(())
    }

    /// Full causal forward without a cache: input_ids (batch, seq) u32 → logits (batch, seq, vocab)
    /// in f32. This is the training path; with [`Kernels::Trainable`] or [`Kernels::Composed`] it
    /// is differentiable end to end, attention's backward being flash-attn3's.
    pub fn forward(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (b, s) = input_ids.dims2()?;
        let keys = KeySource::Fresh {
            cu: cumulative(std::iter::repeat_n(s, b), &self.device)?,
            max_len: s,
        };
        self.forward_full(input_ids, keys)
    }

    /// [`Llama::forward`] with the textbook attention composite (matmul, masked softmax, matmul)
    /// in place of flash-attn3: the reference for checking the op inside a whole model, gradients
    /// included. Memory grows with seq²; not for real runs.
    pub fn forward_reference(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (batch, seq) = input_ids.dims2()?;
        self.forward_full(input_ids, KeySource::Reference { batch, seq })
    }

    /// Context parallelism: the logits of this rank's chunk of `batch` sequences split into
    /// equal consecutive chunks over the ranks of `group` (rank r holds positions r·chunk ..),
    /// `input_ids` (batch, chunk). Attention runs as ring attention
    /// ([`crate::parallel::context`]); everything else is per token. Differentiable like
    /// [`Llama::forward`]; every rank must make the same calls (forward and backward).
    pub fn forward_context_parallel(&self, input_ids: &Tensor, group: &Group) -> Result<Tensor> {
        if self.cfg.sliding_window.is_some() {
            bail!("context parallelism: sliding-window attention is not supported")
        }
        if self.tensor_parallel.is_some() {
            bail!("context parallelism of a tensor-parallel shard is not supported")
        }
        let (batch, chunk) = input_ids.dims2()?;
        let keys = KeySource::Ring {
            batch,
            chunk,
            group: group.clone(),
        };
        self.forward_full_from(input_ids, keys, group.rank() * chunk)
    }

    fn forward_full(&self, input_ids: &Tensor, keys: KeySource) -> Result<Tensor> {
        self.forward_full_from(input_ids, keys, 0)
    }

    /// The full forward of sequences whose first token is at position `first_position`.
    fn forward_full_from(&self, input_ids: &Tensor, keys: KeySource, first_position: usize) -> Result<Tensor> {
        let (b, s) = input_ids.dims2()?;
        let ids = input_ids.flatten_all()?;
        self.check_ids(&ids.to_vec1::<u32>()?)?;
        let first = first_position as u32;
        let positions = Tensor::arange(first, first + s as u32, &self.device)?.repeat(b)?;
        let plan = Plan {
            rope: self.rope_tables(&positions)?,
            keys,
            writes: Vec::new(),
            cache_rows: None,
        };
        let (_, hidden) = self.run_layers(&ids, &plan, None)?.normed(&self.norm)?;
        let logits = self.lm_head.forward(&hidden)?;
        logits.to_dtype(DType::F32)?.reshape((b, s, self.cfg.vocab_size))
    }

    /// Appends `inputs[i]` to sequence `i` of `cache` and returns the logits that follow each
    /// sequence's last new token, (batch, vocab) in f32.
    ///
    /// A prefill is a step with whole prompts (different lengths are fine: one varlen call);
    /// decoding is a step with one token per sequence. A sequence given no tokens is left as it
    /// is and its logits row is zero (finished sequences of a batch).
    pub fn step(&self, inputs: &[Vec<u32>], cache: &mut KvCache) -> Result<Tensor> {
        let (ids, new) = self.upload_ids(inputs)?;
        let logits = self.step_logits(&ids, &new, cache)?.to_dtype(DType::F32)?;
        if new.iter().all(|&n| n > 0) {
            return Ok(logits);
        }
        let rows: Vec<u32> = (0..).zip(&new).filter(|(_, &n)| n > 0).map(|(i, _)| i).collect();
        Tensor::zeros((inputs.len(), self.cfg.vocab_size), DType::F32, &self.device)?.index_add(
            &Tensor::new(rows, &self.device)?,
            &logits,
            0,
        )
    }

    /// The tokens of `inputs` packed one sequence after the other, checked against the vocabulary
    /// and uploaded, with each sequence's count: the input of [`Llama::step_logits`].
    pub(crate) fn upload_ids(&self, inputs: &[Vec<u32>]) -> Result<(Tensor, Vec<usize>)> {
        let flat: Vec<u32> = inputs.iter().flatten().copied().collect();
        self.check_ids(&flat)?;
        Ok((Tensor::new(flat, &self.device)?, inputs.iter().map(Vec::len).collect()))
    }

    /// Whether [`Llama::decode_on_device`] can run over `cache`: a GPU model with the fused
    /// kernels and per-head rotary tables (no q/k norm), in bf16 or f16, over a cache of the
    /// model's dtype (contiguous or paged: the fused RoPE + KV store writes its rows), or of e4m3
    /// once its first write fixed its scales.
    #[cfg(feature = "cuda")]
    pub(crate) fn decodes_on_device(&self, cache: &KvCache) -> bool {
        self.device.is_cuda()
            && self.kernels == Kernels::Fused
            && self.inv_freq_heads.is_some()
            && matches!(self.dtype, DType::BF16 | DType::F16)
            && (cache.dtype == self.dtype || cache.dtype == DType::F8E4M3)
            // An fp8 layer once its first write fixed its scales: the fused RoPE + e4m3 store
            // then takes each new key, and the attention quantizes q on the device.
            && cache.layers.iter().all(|l| match l {
                LayerKv::Rows(_) => true,
                LayerKv::E4m3 { scales, .. } => scales.get().is_some(),
            })
    }

    /// A decode step of the first `rows` sequences of `cache` in which nothing comes from the
    /// host, so that the same launches serve every step ([`crate::decode_graph`] captures them
    /// into a CUDA graph): `ids` (rows,) u32 holds each sequence's last token and `lens` (rows,)
    /// u32 the keys its cache holds before the step (the token's position); `rows` where each
    /// new key goes and, for a paged cache, the page table ([`DecodeRows`]). The new keys go into the
    /// cache through the fused RoPE + KV store; the attention is one `flash_attn_with_kvcache`
    /// call per layer over the cache's strided k and v views, reading `lens + 1` on the device.
    /// Returns the logits (rows, vocab) in the run dtype. Neither `lens` nor the host's
    /// `cache.lens` is advanced here, and each sequence must have a free row (the caller's
    /// checks). Needs [`Llama::decodes_on_device`].
    ///
    /// Captured into a graph, each layer's attention splits its keys over about one wave of CTAs
    /// even for short caches (flash-attn3 does so for captured calls): at batch 1 it is otherwise
    /// `kv_heads` CTAs, each walking every key block one after the other.
    #[cfg(feature = "cuda")]
    pub(crate) fn decode_on_device(
        &self,
        ids: &Tensor,
        lens: &Tensor,
        rows: &DecodeRows,
        cache: &KvCache,
    ) -> Result<Tensor> {
        let batch = ids.dim(0)?;
        let (Some(inv_freq), Some(first)) = (&self.inv_freq_heads, self.layers.first()) else {
            bail!("internal error: a decode step on the device without per-head rotary tables or layers")
        };
        // The key counts + 1, the cache rows, the rotary tables, the embedding and the first
        // norm in one launch.
        let prologue = crate::fused::decode_prologue(&crate::fused::PrologueInputs {
            ids,
            lens,
            slot_starts: match rows {
                DecodeRows::Slots { slot_starts } => Some(slot_starts),
                DecodeRows::Pages { .. } => None,
            },
            inv_freq,
            embed: self.embed_tokens.embeddings(),
            norm_weight: first.input_layernorm.weight(),
            eps: first.input_layernorm.eps(),
        })?;
        // A 16-bit cache: where the attention call does its append inside its kernel, it turns q
        // and the new key and stores the key and value itself (the cache's per-position tables,
        // the key counts before the step); elsewhere, and for an fp8 cache, the fused RoPE + KV
        // store first, then the attention over lens + 1 keys.
        let seqlens = prologue.seqlens;
        let rope = match &cache.rotary {
            Some((cos, sin)) if cache.dtype == self.dtype => RopeTables::InAttention {
                cos: cos.clone(),
                sin: sin.clone(),
                lens: lens.clone(),
                head_cos: prologue.cos,
                head_sin: prologue.sin,
            },
            _ => RopeTables::PerHead {
                cos: prologue.cos,
                sin: prologue.sin,
            },
        };
        let (group, cache_rows) = match (rows, prologue.cache_rows) {
            (DecodeRows::Slots { .. }, Some(cache_rows)) => (CacheGroup::one_token_each(batch, seqlens), cache_rows),
            (DecodeRows::Pages { cache_rows, page_table }, _) => (
                CacheGroup::one_token_each_paged(batch, seqlens, page_table.clone()),
                cache_rows.clone(),
            ),
            (DecodeRows::Slots { .. }, None) => bail!("internal error: the decode prologue left out the cache rows"),
        };
        let plan = Plan {
            rope,
            keys: KeySource::KvCacheCalls {
                groups: vec![group],
                unpermute: None,
                view: cache.view_dims(),
            },
            // The fused store writes each token at its cache row; nothing goes through `writes`.
            writes: Vec::new(),
            cache_rows: Some(cache_rows),
        };
        let stream = Residual {
            x: prologue.x,
            h: None,
            first_normed: Some(prologue.normed),
        };
        let stream = self.run_layers_from(stream, &plan, Some(cache))?;
        Ok(stream.project(&self.norm, &self.lm_head, self.kernels)?.1)
    }

    /// [`Llama::step`] with the tokens already on the device: appends `new[i]` tokens of the
    /// packed `ids` to sequence `i` of `cache` and returns the logits after each sequence's last
    /// new token, one row per sequence with `new[i] > 0`, in the run dtype, where the model runs
    /// (for a token chosen there, which can be the next step's `ids`). `ids` must lie inside the
    /// vocabulary: they come from [`Llama::upload_ids`] or from a choice over earlier logits
    /// (not checked here, which would cost a copy to the host).
    pub(crate) fn step_logits(&self, ids: &Tensor, new: &[usize], cache: &mut KvCache) -> Result<Tensor> {
        if new.len() != cache.batch() {
            bail!(
                "step: {} input sequences for a cache of batch {}",
                new.len(),
                cache.batch()
            )
        }
        if new.iter().all(|&n| n == 0) {
            bail!("step: no input tokens")
        }
        if ids.dims() != [new.iter().sum::<usize>()] {
            bail!("internal error: {:?} token ids for {new:?} new tokens", ids.shape())
        }
        let max_seq = cache.max_seq;
        for (i, (&len, &n)) in cache.lens.iter().zip(new).enumerate() {
            if len + n > max_seq {
                bail!(
                    "step: sequence {i} would hold {} tokens, more than the cache's max_seq {max_seq}",
                    len + n
                )
            }
        }
        // A paged cache's sequences take the pages this step's tokens need (all or none).
        let tokens_after: Vec<usize> = cache.lens.iter().zip(new).map(|(&len, &n)| len + n).collect();
        cache.reserve_all(&tokens_after)?;
        let dev = &self.device;

        // Each token's position continues its own sequence.
        let lens = &cache.lens;
        let positions: Vec<u32> = lens
            .iter()
            .zip(new)
            .flat_map(|(&len, &n)| (len..len + n).map(|p| p as u32))
            .collect();
        let rope = self.rope_tables(&Tensor::new(positions, dev)?)?;
        let max_new = new.iter().copied().max().unwrap_or(0);
        let keys = if lens.iter().all(|&l| l == 0) {
            // Empty cache: the prompts only see themselves, so attend to the fresh keys (cheaper
            // than reading the whole cache); they are stored for the next steps all the same.
            KeySource::Fresh {
                cu: cumulative(new.iter().copied(), dev)?,
                max_len: max_new,
            }
        } else if cache.dtype == DType::F8E4M3 || cache.paging.is_some() {
            // A paged 16-bit cache: one call, each sequence with its own query count; an fp8
            // cache: a call per count (its q is quantized per group).
            let (groups, unpermute) = match &cache.paging {
                Some(paging) if cache.dtype != DType::F8E4M3 => {
                    (vec![CacheGroup::varlen(lens, new, paging, dev)?], None)
                }
                paging => CacheGroup::plan(lens, new, paging.as_ref(), dev)?,
            };
            KeySource::KvCacheCalls {
                groups,
                unpermute,
                view: cache.view_dims(),
            }
        } else {
            // Each sequence is followed by a gap sequence without queries (see KvCache).
            let k_lens = lens.iter().zip(new).flat_map(|(&l, &n)| [l + n, max_seq - l - n]);
            KeySource::Cached {
                cu_q: cumulative(new.iter().flat_map(|&n| [n, 0]), dev)?,
                cu_k: cumulative(k_lens, dev)?,
                max_q: max_new,
                max_k: max_seq,
            }
        };
        // Runs of new tokens whose cache rows follow each other (a page boundary of a paged
        // cache starts a new run).
        let mut writes: Vec<(usize, usize, usize)> = Vec::new();
        let mut packed = 0;
        for (i, (&len, &n)) in lens.iter().zip(new).enumerate() {
            for pos in len..len + n {
                let row = cache.row(i, pos);
                match writes.last_mut() {
                    Some((from, count, to)) if *from + *count == packed && *to + *count == row => *count += 1,
                    _ => writes.push((packed, 1, row)),
                }
                packed += 1;
            }
        }
        // The fused GPU RoPE + KV store takes the cache row of every new token.
        // (and so does an e4m3 cache's store on the GPU).
        let cache_rows = match dev.is_cuda() && (self.inv_freq_heads.is_some() || cache.dtype == DType::F8E4M3) {
            true => {
                let rows = writes.iter().flat_map(|&(_, n, dst)| (dst..dst + n).map(|r| r as u32));
                Some(Tensor::new(rows.collect::<Vec<u32>>(), dev)?)
            }
            false => None,
        };
        let plan = Plan {
            rope,
            keys,
            writes,
            cache_rows,
        };
        let stream = self.run_layers(ids, &plan, Some(cache))?;
        for (len, n) in cache.lens.iter_mut().zip(new) {
            *len += n;
        }

        // Only the last new token of each sequence needs the (vocab-wide) output head. At most
        // one new token per sequence (decode): every packed row is a last token.
        if new.iter().all(|&n| n <= 1) {
            return Ok(stream.project(&self.norm, &self.lm_head, self.kernels)?.1);
        }
        let (_, hidden) = stream.normed(&self.norm)?;
        let ends = new.iter().scan(0, |end, &n| {
            *end += n;
            Some((*end, n))
        });
        let last: Vec<u32> = ends.filter(|&(_, n)| n > 0).map(|(end, _)| (end - 1) as u32).collect();
        let hidden = hidden.index_select(&Tensor::new(last, dev)?, 0)?;
        project(&self.lm_head, &hidden, self.kernels)
    }

    /// cos/sin of every token's angles, computed in f32 and cast once per call to the run dtype
    /// (rather than once per layer and per q/k inside `apply_rope`).
    fn rope_tables(&self, positions: &Tensor) -> Result<RopeTables> {
        Ok(match &self.inv_freq_heads {
            // On the GPU one launch (a decode step's tables were six small kernels): cos and sin
            // of the same f32 angles, in f32, then cast.
            #[cfg(feature = "cuda")]
            Some(heads) if positions.device().is_cuda() => {
                let (cos, sin) = crate::fused::rope_angles(positions, heads, self.dtype)?;
                RopeTables::PerHead { cos, sin }
            }
            Some(heads) => {
                let (cos, sin) = rope_angles_per_head(positions, heads)?;
                RopeTables::PerHead {
                    cos: cos.to_dtype(self.dtype)?,
                    sin: sin.to_dtype(self.dtype)?,
                }
            }
            None => {
                let (cos, sin) = rope_angles(positions, &self.inv_freq)?;
                RopeTables::PerToken {
                    cos: cos.to_dtype(self.dtype)?,
                    sin: sin.to_dtype(self.dtype)?,
                }
            }
        })
    }

    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            bail!(
                "token id {bad} is outside the vocabulary (size {})",
                self.cfg.vocab_size
            )
        }
        Ok(())
    }

    /// Embeds `ids` (tokens,) and runs every block, storing the new keys in `cache` if given;
    /// returns the residual stream with the last block's output not yet added (the caller applies
    /// the final norm: [`Residual::normed`], or [`Residual::project`] into the output head). Each
    /// residual add and the norm after it are one [`RmsNorm::add_forward`] (one kernel with
    /// fused kernels on the GPU), or part of the projection that reads the norm
    /// ([`Residual::project`]).
    /// A sub-block's output summed over the tensor-parallel ranks (each holds a partial sum over
    /// its heads or MLP columns); unchanged without tensor parallelism.
    fn sum_over_shards(&self, h: Tensor) -> Result<Tensor> {
        match &self.tensor_parallel {
            Some(group) => group.all_reduce_sum(&h),
            None => Ok(h),
        }
    }

    fn run_layers(&self, ids: &Tensor, plan: &Plan, cache: Option<&KvCache>) -> Result<Residual> {
        let x = match self.kernels {
            // Our lookup, whose backward is not candle's (slow) index_add.
            Kernels::Trainable => crate::train_ops::embedding(self.embed_tokens.embeddings(), &ids.to_vec1::<u32>()?)?,
            _ => self.embed_tokens.forward(ids)?,
        };
        self.run_layers_from(
            Residual {
                x,
                h: None,
                first_normed: None,
            },
            plan,
            cache,
        )
    }

    /// [`Llama::run_layers`] from the embedded tokens (`stream`: `h` None).
    fn run_layers_from(&self, mut stream: Residual, plan: &Plan, cache: Option<&KvCache>) -> Result<Residual> {
        for (i, block) in self.layers.iter().enumerate() {
            let layer_cache = cache.map(|c| &c.layers[i]);
            let (x, h) = block
                .self_attn
                .forward(&stream, &block.input_layernorm, plan, layer_cache)?;
            let h = self.sum_over_shards(h)?;
            let (x, h) = block
                .mlp
                .forward(&Residual::after(x, h), &block.post_attention_layernorm)?;
            stream = Residual::after(x, self.sum_over_shards(h)?);
        }
        Ok(stream)
    }
}
