//! Attention of a few new queries against a KV cache that the same call extends: FA3's
//! `flash_attn_with_kvcache`, the decode step of every serving engine.
//!
//! The cache is either contiguous, k (batch_cache, seqlen_cache, kv_heads, head_dim), or paged
//! (vLLM's layout), k (num_pages, page_size, kv_heads, head_dim) with a `page_table`
//! (batch, max_pages) of u32 page indices: sequence b's key j lives in page
//! `page_table[b][j / page_size]` at row `j % page_size`. Pages may come in any order and be
//! shared between sequences (a common prompt prefix). v has the same layout with head_dim_v.
//!
//! `cache_seqlens` (batch,) u32 counts the keys each sequence already holds. With
//! [`KvCacheAttn::append`], the call first writes k_new / v_new (batch, seqlen_new, kv_heads, d)
//! into the cache at positions `cache_seqlens[b]..` (in place: the cache tensors are modified),
//! then every query attends to keys `0 .. cache_seqlens[b] + seqlen_new`; causal and window
//! masks align bottom-right over those keys (query i's diagonal is key
//! `cache_seqlens[b] + seqlen_new - seqlen_q + i`). `cache_seqlens` itself is not advanced:
//! the caller adds seqlen_new for the next step, as with FA3.
//!
//! With [`KvCacheAttn::rotary`], q and k_new are rotated first (rotary embedding at their
//! positions, from cos / sin tables of (positions, rotary_dim / 2)): k_new at `cache_seqlens[b] +
//! i`, q at the same positions when the call is causal or windowed, and all at
//! `cache_seqlens[b]` otherwise (FA3's rule: a non-causal step's queries share one position).
//! The first rotary_dim dims turn, pairs (x_i, x_{i + rotary_dim / 2}), or (x_2i, x_2i+1) if
//! interleaved; the rest pass unchanged.
//!
//! `cache_batch_idx` (batch,) u32 picks the cache row of each batch entry (contiguous caches
//! only; a page table already maps sequences to pages).
//!
//! With [`KvCacheAttn::varlen_q`] (FA3's `cu_seqlens_q`) each sequence brings its own number of
//! queries, packed: q (total_q, heads, d) with [`SeqOffsets`] of batch + 1 offsets, so a serving
//! step's prefill chunks and single decode tokens attend in one call. The output is then
//! (total_q, heads, head_dim_v) and the LSE (heads, total_q), as in the varlen forward. Such a
//! call reads the cache as it stands: keys already stored, no append or rotary (16-bit and f32
//! caches).
//!
//! A 16-bit (or f32) cache, contiguous or paged, may be a strided view whose head dim is
//! contiguous: k and v heads interleaved in one buffer (flash-llama's caches, which its
//! CUDA-graph decode appends to and reads this way) are written and read in place, without a
//! copy. FP8 caches must be dense.
//!
//! The CPU path computes every option exactly (in f32, the cache gathered per sequence and run
//! through the CPU attention) and reports bad indices (a page past the pool, keys past the
//! cache) as errors. The GPU path (bf16 / f16 / e4m3) never reads the index tensors on the host: a
//! small kernel appends, turns and checks each sequence before the attention
//! (kernels/kvcache/append.cu), or, for a call that the single-query decode kernel takes with at
//! most one new key per sequence, that kernel does all of it in the same launch
//! ([`KvCacheAttn::appends_in_kernel`]); a sequence with a bad index reads as empty (output 0, LSE
//! -inf) with an error bit in the caller's [`KvCacheAttn::status`] word (the `STATUS_*`
//! constants). A GPU call that neither appends, turns nor asks for the status skips those checks:
//! it clamps each sequence to the cache and reads pages past the pool as zeros.
//!
//! FP8 caches: q, the caches and k_new / v_new all `F8E4M3`, with the builder's
//! [`FlashAttn::descale`] (q per (batch, kv head) or (batch, head), k and v per (batch, kv head);
//! batch may be 1) and a bf16 (or `.out_dtype(F16)`) output, half the cache bytes of bf16. The
//! append copies the e4m3 bytes; rotary is refused (turn q and k before quantizing them). The
//! CPU path dequantises exactly and runs the f32 attention; the GPU kernel transposes V tiles
//! in shared memory (kernels/flash_fwd/transpose_v.cuh) instead of the fp8 forward's pre-pass
//! over all of V. On an H100 a d128 decode step over fp8 caches measured 0.66-0.77x the bf16
//! time at batch >= 8 and 2.1x it at batch 1 (docs/kernels/kvcache.md).
//!
//! The attention reads whole key blocks of the cache and masks the keys past each sequence's
//! count, so unused cache memory must hold finite values (0 · NaN is NaN in a tensor core):
//! make caches with zeros, as `Tensor::zeros` does.

use candle_core::{bail, CpuStorage, DType, Device, InplaceOp2, Layout, Result, Tensor};

use crate::params::Dims;
use crate::{FlashAttn, SeqOffsets};

/// Page sizes the paged cache takes (tokens per page): the powers of two from vLLM's default 16
/// to 256.
pub const PAGE_SIZES: [usize; 5] = [16, 32, 64, 128, 256];

/// Status bit (GPU calls, [`KvCacheAttn::status`]): a sequence's keys, `cache_seqlens[b]` +
/// seqlen_new, do not fit its cache.
pub const STATUS_KEYS_PAST_CACHE: u32 = 1;
/// Status bit: a page that a sequence uses is past the page pool.
pub const STATUS_PAGE_PAST_POOL: u32 = 2;
/// Status bit: a cache_batch_idx entry is past the cache's rows.
pub const STATUS_BATCH_IDX_PAST_CACHE: u32 = 4;
/// Status bit: a position past the rotary tables (the value is left unturned).
pub const STATUS_PAST_ROTARY: u32 = 8;

/// A [`FlashAttn`] call against a KV cache; made by [`FlashAttn::kv_cache`].
#[derive(Debug, Clone)]
pub struct KvCacheAttn<'a> {
    attn: FlashAttn,
    k_cache: &'a Tensor,
    v_cache: &'a Tensor,
    cache_seqlens: &'a Tensor,
    new: Option<(&'a Tensor, &'a Tensor)>,
    page_table: Option<&'a Tensor>,
    cache_batch_idx: Option<&'a Tensor>,
    rotary: Option<Rotary<'a>>,
    status: Option<&'a Tensor>,
    varlen_q: Option<&'a SeqOffsets>,
}

#[derive(Debug, Clone, Copy)]
struct Rotary<'a> {
    cos: &'a Tensor,
    sin: &'a Tensor,
    interleaved: bool,
}

impl FlashAttn {
    /// This call's options against a KV cache (module [`crate::kvcache`]): `k_cache` / `v_cache`
    /// contiguous (batch_cache, seqlen_cache, kv_heads, d) or, with
    /// [`KvCacheAttn::page_table`], paged (num_pages, page_size, kv_heads, d); `cache_seqlens`
    /// (batch,) u32, the keys each sequence holds.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use flash_attn3::FlashAttn;
    /// # fn main() -> candle_core::Result<()> {
    /// let dev = Device::Cpu;
    /// let q = Tensor::randn(0f32, 1., (2, 1, 8, 64), &dev)?; // one new token per sequence
    /// let k_new = Tensor::randn(0f32, 1., (2, 1, 2, 64), &dev)?; // its key and value
    /// let v_new = Tensor::randn(0f32, 1., (2, 1, 2, 64), &dev)?;
    /// // A pool of 64 pages of 16 tokens, 2 kv heads; zeros: unused rows must hold finite values.
    /// let k_cache = Tensor::zeros((64, 16, 2, 64), DType::F32, &dev)?;
    /// let v_cache = Tensor::zeros((64, 16, 2, 64), DType::F32, &dev)?;
    /// let page_table = Tensor::new(&[[0u32, 1, 2, 3], [4, 5, 6, 7]], &dev)?; // (batch, max_pages)
    /// let cache_seqlens = Tensor::new(&[17u32, 3], &dev)?; // keys already held
    /// let out = FlashAttn::new(0.125)
    ///     .causal(true)
    ///     .kv_cache(&k_cache, &v_cache, &cache_seqlens)
    ///     .page_table(&page_table)
    ///     .append(&k_new, &v_new) // written at cache_seqlens
    ///     .forward(&q)?;
    /// assert_eq!(out.dims(), &[2, 1, 8, 64]);
    /// // Sequence 0's new key landed in page 1 (position 17 = page 1, row 1).
    /// let row = k_cache.get(1)?.get(1)?;
    /// assert_eq!(row.to_vec2::<f32>()?, k_new.get(0)?.get(0)?.to_vec2::<f32>()?);
    /// # Ok(()) }
    /// ```
    pub fn kv_cache<'a>(&self, k_cache: &'a Tensor, v_cache: &'a Tensor, cache_seqlens: &'a Tensor) -> KvCacheAttn<'a> {
        KvCacheAttn {
            attn: self.clone(),
            k_cache,
            v_cache,
            cache_seqlens,
            new: None,
            page_table: None,
            cache_batch_idx: None,
            rotary: None,
            status: None,
            varlen_q: None,
        }
    }
}

/// [`FlashAttn::kv_cache`] in one call, FA3's argument order: append `k` / `v` (if given) at
/// `cache_seqlens`, then attend.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_with_kvcache(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    k: Option<&Tensor>,
    v: Option<&Tensor>,
    cache_seqlens: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let attn = FlashAttn::new(softmax_scale).causal(causal);
    let call = attn.kv_cache(k_cache, v_cache, cache_seqlens);
    match (k, v) {
        (Some(k), Some(v)) => call.append(k, v).forward(q),
        (None, None) => call.forward(q),
        _ => bail!("flash-attn3: kvcache: k and v are appended together: pass both or neither"),
    }
}

impl<'a> KvCacheAttn<'a> {
    /// Writes `k` / `v` (batch, seqlen_new, kv_heads, d) into the cache at `cache_seqlens[b]..`
    /// before attending; the queries then see them as their last keys.
    pub fn append(mut self, k: &'a Tensor, v: &'a Tensor) -> Self {
        self.new = Some((k, v));
        self
    }

    /// Makes the cache paged: `page_table` (batch, max_pages) u32 page indices into the caches'
    /// first axis, whose second is the page size (one of [`PAGE_SIZES`]).
    pub fn page_table(mut self, page_table: &'a Tensor) -> Self {
        self.page_table = Some(page_table);
        self
    }

    /// The cache row of each batch entry, (batch,) u32 (contiguous caches only).
    pub fn cache_batch_idx(mut self, idx: &'a Tensor) -> Self {
        self.cache_batch_idx = Some(idx);
        self
    }

    /// Rotary embedding of q and k_new inside the call (module docs for the positions):
    /// `cos` / `sin` (positions, rotary_dim / 2) in q's dtype or f32.
    pub fn rotary(mut self, cos: &'a Tensor, sin: &'a Tensor, interleaved: bool) -> Self {
        self.rotary = Some(Rotary { cos, sin, interleaved });
        self
    }

    /// GPU calls: a u32 tensor of shape (1,) on q's device into which the call ORs the
    /// `STATUS_*` bits of every sequence with a bad index (such a sequence reads as empty).
    /// Read it when convenient (it costs a device sync); zero it to start afresh. CPU calls
    /// return those cases as errors and leave it alone.
    pub fn status(mut self, status: &'a Tensor) -> Self {
        self.status = Some(status);
        self
    }

    /// Queries of different lengths per sequence, packed: q (total_q, heads, head_dim) and
    /// `cu_seqlens_q` its batch + 1 offsets (module docs). The output is (total_q, heads,
    /// head_dim_v) and the LSE (heads, total_q). Not with [`KvCacheAttn::append`] or
    /// [`KvCacheAttn::rotary`] (store the keys first), nor with fp8 caches.
    pub fn varlen_q(mut self, cu_seqlens_q: &'a SeqOffsets) -> Self {
        self.varlen_q = Some(cu_seqlens_q);
        self
    }

    /// Whether this call with `q` does its append inside the attention kernel, as one launch:
    /// on the GPU, a call with at most one new key per sequence that the single-query decode
    /// kernel takes (short 16-bit caches; docs/kernels/kvcache.md). Elsewhere an appending GPU
    /// call runs the append as a kernel of its own before the attention, and a caller that has
    /// its own fused rotation and store (flash-llama's) may prefer those. False on the CPU;
    /// checks the call as [`KvCacheAttn::forward`] does, without running anything.
    pub fn appends_in_kernel(&self, q: &Tensor) -> Result<bool> {
        #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
        let shape = self.check(q)?;
        match q.device() {
            #[cfg(feature = "cuda")]
            Device::Cuda(dev) => crate::cuda::kvcache::appends_in_kernel(
                &shape,
                &self.attn.params()?,
                q.dtype(),
                (self.k_cache, self.v_cache),
                dev,
            ),
            _ => Ok(false),
        }
    }

    /// The attention output, (batch, seqlen_q, heads, head_dim_v), or (total_q, heads,
    /// head_dim_v) with [`KvCacheAttn::varlen_q`].
    pub fn forward(&self, q: &Tensor) -> Result<Tensor> {
        Ok(self.forward_with_lse(q)?.0)
    }

    /// The output and the f32 log-sum-exp of each query row, (batch, heads, seqlen_q), or
    /// (heads, total_q) with [`KvCacheAttn::varlen_q`].
    pub fn forward_with_lse(&self, q: &Tensor) -> Result<(Tensor, Tensor)> {
        let shape = self.check(q)?;
        // FP8 caches: the builder's descales, one per (batch, kv head) (or per (batch, head) for
        // q), checked against this call's shapes.
        let fp8 = self.attn.fp8_call(q, &shape.dims(), true)?;
        match q.device() {
            // (The CPU path's varlen call dequantises with the descales checked above.)
            Device::Cpu => self.forward_cpu(q, &shape, fp8.map_or(q.dtype(), |f| f.out_dtype)),
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => crate::cuda::kvcache::forward(&crate::cuda::kvcache::GpuCall {
                // (kvcache calls are inference: the sinks take no gradient here)
                params: self.attn.params()?,
                shape: &shape,
                q,
                k_cache: self.k_cache,
                v_cache: self.v_cache,
                cache_seqlens: self.cache_seqlens,
                new: self.new,
                page_table: self.page_table,
                cache_batch_idx: self.cache_batch_idx,
                rotary: self.rotary.map(|r| (r.cos, r.sin, r.interleaved)),
                status: self.status,
                varlen_q: self.varlen_q,
                sinks: self.attn.sinks_f32(q, shape.heads)?.as_ref(),
                fp8: fp8.as_ref(),
            }),
            d => bail!(
                "flash-attn3: kvcache: no kernels for {:?}: run on the CPU or an NVIDIA Hopper GPU (the `cuda` feature)",
                d.location()
            ),
        }
    }

    /// Shapes, dtypes and devices: everything the host can check without reading a tensor.
    fn check(&self, q: &Tensor) -> Result<CacheShape> {
        const E: &str = "flash-attn3: kvcache";
        let dtype = q.dtype();
        let (batch, seqlen_q, total_q, heads, head_dim) = match (self.varlen_q, q.dims()) {
            (None, &[b, s, h, d]) => (b, s, b * s, h, d),
            (None, _) => bail!("{E}: q must be (batch, seqlen_q, heads, head_dim), got {:?}", q.dims()),
            (Some(cu), &[t, h, d]) => {
                if self.new.is_some() || self.rotary.is_some() {
                    bail!("{E}: varlen queries (cu_seqlens_q) read the cache as it stands: store the new keys first, without append or rotary")
                }
                if dtype == DType::F8E4M3 {
                    bail!("{E}: varlen queries (cu_seqlens_q) are not supported with fp8 caches; call once per query count")
                }
                if cu.total() != t {
                    bail!("{E}: cu_seqlens_q ends at {} but q holds {t} tokens", cu.total())
                }
                (cu.batch(), cu.max_len(), t, h, d)
            }
            (Some(_), _) => bail!(
                "{E}: with cu_seqlens_q, q must be (total_q, heads, head_dim), got {:?}",
                q.dims()
            ),
        };
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16 | DType::F8E4M3) {
            bail!("{E}: q must be f32, f16, bf16 or f8e4m3, got {dtype:?}")
        }
        let same_device = |t: &Tensor| t.device().same_device(q.device());
        let (k, v) = (self.k_cache, self.v_cache);
        for (name, t) in [("k_cache", k), ("v_cache", v)] {
            if t.rank() != 4 {
                bail!("{E}: {name} must have rank 4, got shape {:?}", t.dims())
            }
            if t.dtype() != dtype || !same_device(t) {
                bail!(
                    "{E}: {name} must be {dtype:?} on q's device, got {:?} on {:?}",
                    t.dtype(),
                    t.device().location()
                )
            }
            // An fp8 cache must be dense; a 16-bit (or f32) cache, contiguous or paged, may be
            // any view whose head dim is contiguous (k and v heads interleaved in one buffer, as
            // flash-llama's caches hold them), read and appended to in place.
            if !t.is_contiguous() {
                if dtype == DType::F8E4M3 {
                    bail!("{E}: an fp8 {name} must be contiguous (strided views are read and written for 16-bit and f32 caches)")
                }
                if t.stride().last() != Some(&1) {
                    bail!(
                        "{E}: {name}'s head dim must be contiguous, got strides {:?}",
                        t.stride()
                    )
                }
            }
        }
        let (k_dims, v_dims) = (k.dims(), v.dims());
        let (slots, rows, kv_heads) = (k_dims[0], k_dims[1], k_dims[2]);
        if k_dims[3] != head_dim || v_dims[..3] != k_dims[..3] {
            bail!(
                "{E}: k_cache {k_dims:?} and v_cache {v_dims:?} must share their first three dims, and k_cache's head dim must be q's ({head_dim})"
            )
        }
        let head_dim_v = v_dims[3];
        if batch == 0
            || seqlen_q == 0
            || heads == 0
            || head_dim == 0
            || head_dim_v == 0
            || slots == 0
            || rows == 0
            || kv_heads == 0
        {
            bail!(
                "{E}: empty tensors: q {:?}, k_cache {k_dims:?}, v_cache {v_dims:?}",
                q.dims()
            )
        }
        if head_dim > crate::params::MAX_HEAD_DIM || head_dim_v > crate::params::MAX_HEAD_DIM {
            bail!(
                "{E}: head dims up to {} are supported, got {head_dim} / {head_dim_v}",
                crate::params::MAX_HEAD_DIM
            )
        }
        if heads % kv_heads != 0 {
            bail!("{E}: q's {heads} heads are not a multiple of the cache's {kv_heads} kv heads")
        }
        check_u32(self.cache_seqlens, "cache_seqlens", &[batch], q)?;
        let seqlen_new = match self.new {
            None => 0,
            Some((kn, vn)) => {
                let sn = kn.dims().get(1).copied().unwrap_or(0);
                let want_k = [batch, sn, kv_heads, head_dim];
                let want_v = [batch, sn, kv_heads, head_dim_v];
                if kn.dims() != want_k || vn.dims() != want_v {
                    bail!(
                        "{E}: k_new / v_new must be {want_k:?} / {want_v:?} (batch, seqlen_new, kv_heads, d), got {:?} / {:?}",
                        kn.dims(),
                        vn.dims()
                    )
                }
                for (name, t) in [("k_new", kn), ("v_new", vn)] {
                    if t.dtype() != dtype || !same_device(t) {
                        bail!("{E}: {name} must be {dtype:?} on q's device, got {:?}", t.dtype())
                    }
                }
                sn
            }
        };
        let paged = match self.page_table {
            None => None,
            Some(pt) => {
                if self.cache_batch_idx.is_some() {
                    bail!("{E}: cache_batch_idx applies to contiguous caches; a paged cache maps sequences through its page table")
                }
                if !PAGE_SIZES.contains(&rows) {
                    bail!("{E}: the page size (k_cache's second dim) must be one of {PAGE_SIZES:?}, got {rows}")
                }
                let max_pages = pt.dims().get(1).copied().unwrap_or(0);
                check_u32(pt, "page_table", &[batch, max_pages], q)?;
                if max_pages == 0 {
                    bail!("{E}: the page table has no columns")
                }
                Some(max_pages)
            }
        };
        if let Some(idx) = self.cache_batch_idx {
            check_u32(idx, "cache_batch_idx", &[batch], q)?;
        }
        if let Some(status) = self.status {
            check_u32(status, "status", &[1], q)?;
        }
        let rotary_dim = match self.rotary {
            None => 0,
            Some(_) if dtype == DType::F8E4M3 => {
                bail!("{E}: rotary with an fp8 (f8e4m3) cache: turn q and k_new before quantizing them")
            }
            Some(r) => {
                let (positions, half) = match *r.cos.dims() {
                    [p, h] => (p, h),
                    _ => bail!(
                        "{E}: rotary cos must be (positions, rotary_dim / 2), got {:?}",
                        r.cos.dims()
                    ),
                };
                if r.sin.dims() != r.cos.dims() || half == 0 || 2 * half > head_dim || positions == 0 {
                    bail!(
                        "{E}: rotary cos / sin must be (positions, rotary_dim / 2) with 0 < rotary_dim <= head_dim ({head_dim}), got {:?} / {:?}",
                        r.cos.dims(),
                        r.sin.dims()
                    )
                }
                for (name, t) in [("cos", r.cos), ("sin", r.sin)] {
                    if !(t.dtype() == dtype || t.dtype() == DType::F32) || !same_device(t) {
                        bail!(
                            "{E}: rotary {name} must be {dtype:?} or f32 on q's device, got {:?}",
                            t.dtype()
                        )
                    }
                }
                2 * half
            }
        };
        Ok(CacheShape {
            batch,
            seqlen_q,
            total_q,
            varlen_q: self.varlen_q.is_some(),
            seqlen_new,
            heads,
            kv_heads,
            head_dim,
            head_dim_v,
            slots,
            rows,
            paged,
            rotary_dim,
        })
    }

    /// The CPU path: read the small index tensors, check them, rotate, append in place, gather
    /// each sequence's keys and run one varlen call of the CPU attention.
    fn forward_cpu(&self, q: &Tensor, s: &CacheShape, out_dtype: DType) -> Result<(Tensor, Tensor)> {
        const E: &str = "flash-attn3: kvcache";
        let lens = self.cache_seqlens.to_vec1::<u32>()?;
        let idx = match self.cache_batch_idx {
            Some(t) => t.to_vec1::<u32>()?,
            None => (0..s.batch as u32).collect(),
        };
        let pages = match self.page_table {
            Some(t) => t.flatten_all()?.to_vec1::<u32>()?,
            None => Vec::new(),
        };
        // Cache row (token slot, in units of kv_heads × d) of key j of sequence b.
        let capacity = s.capacity();
        let slot_of = |b: usize, j: usize| -> usize {
            match s.paged {
                Some(max_pages) => pages[b * max_pages + j / s.rows] as usize * s.rows + j % s.rows,
                None => idx[b] as usize * s.rows + j,
            }
        };
        let mut keys = Vec::with_capacity(s.batch);
        for b in 0..s.batch {
            let n = lens[b] as usize + s.seqlen_new;
            if n > capacity {
                bail!(
                    "{E}: sequence {b} needs {n} keys (cache_seqlens {} + {} new), its cache holds {capacity}",
                    lens[b],
                    s.seqlen_new
                )
            }
            if s.paged.is_none() && idx[b] as usize >= s.slots {
                bail!(
                    "{E}: cache_batch_idx[{b}] = {} is past the cache's {} rows",
                    idx[b],
                    s.slots
                )
            }
            if let Some(max_pages) = s.paged {
                for (i, &p) in pages[b * max_pages..][..n.div_ceil(s.rows)].iter().enumerate() {
                    if p as usize >= s.slots {
                        bail!("{E}: page_table[{b}][{i}] = {p} is past the cache's {} pages", s.slots)
                    }
                }
            }
            keys.push(n);
        }
        let max_k = keys.iter().copied().max().unwrap_or(0);
        if max_k == 0 {
            // No sequence holds a key (nothing to append either): every row reads as empty, as on
            // the GPU: output 0, LSE -inf, or with sinks the head's sink logit alone.
            return self.empty_rows(q, s, out_dtype);
        }
        let rotary = match self.rotary {
            Some(r) => {
                let positions = r.cos.dim(0)?;
                if max_k > positions {
                    bail!("{E}: the rotary tables cover {positions} positions, the call needs {max_k}")
                }
                Some(RotaryTables {
                    cos: r.cos.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
                    sin: r.sin.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
                    half: s.rotary_dim / 2,
                    interleaved: r.interleaved,
                })
            }
            None => None,
        };
        // q at cache_seqlens + i when causal or windowed, else all at cache_seqlens (FA3).
        let params = self.attn.params()?;
        let per_token = params.is_masked();
        let q = match &rotary {
            Some(rot) => rot.apply(q, |b, i| lens[b] as usize + if per_token { i } else { 0 })?,
            None => q.clone(),
        };
        if let Some((kn, vn)) = self.new {
            let kn = match &rotary {
                Some(rot) => rot.apply(kn, |b, i| lens[b] as usize + i)?,
                None => kn.clone(),
            };
            let slots: Vec<usize> = (0..s.batch)
                .flat_map(|b| (0..s.seqlen_new).map(move |i| (b, i)))
                .map(|(b, i)| slot_of(b, lens[b] as usize + i))
                .collect();
            write_slots(self.k_cache, &kn, &slots)?;
            write_slots(self.v_cache, vn, &slots)?;
        }
        // Each sequence's keys in order, gathered into one packed (sum of keys, kv_heads, d).
        let gather: Vec<u32> = (0..s.batch)
            .flat_map(|b| (0..keys[b]).map(move |j| (b, j)))
            .map(|(b, j)| slot_of(b, j) as u32)
            .collect();
        let gather = Tensor::new(gather.as_slice(), &Device::Cpu)?;
        let flat = |t: &Tensor, d: usize| t.reshape((s.slots * s.rows, s.kv_heads, d));
        let k = flat(self.k_cache, s.head_dim)?.index_select(&gather, 0)?;
        let v = flat(self.v_cache, s.head_dim_v)?.index_select(&gather, 0)?;
        let cu_q = match self.varlen_q {
            Some(cu) => SeqOffsets::new(cu.as_slice(), &Device::Cpu)?,
            None => SeqOffsets::from_lengths(std::iter::repeat_n(s.seqlen_q, s.batch), &Device::Cpu)?,
        };
        let cu_k = SeqOffsets::from_lengths(keys.iter().copied(), &Device::Cpu)?;
        let q = q.reshape((s.total_q, s.heads, s.head_dim))?;
        let (out, lse) = self
            .attn
            .forward_varlen_offsets_with_lse(&q, &k, &v, &cu_q, &cu_k, s.seqlen_q, max_k)?;
        if s.varlen_q {
            return Ok((out, lse));
        }
        let out = out.reshape((s.batch, s.seqlen_q, s.heads, s.head_dim_v))?;
        // (heads, batch × seqlen_q) → (batch, heads, seqlen_q).
        let lse = lse
            .reshape((s.heads, s.batch, s.seqlen_q))?
            .transpose(0, 1)?
            .contiguous()?;
        Ok((out, lse))
    }
}

impl KvCacheAttn<'_> {
    /// The result of a call in which no sequence sees a key.
    fn empty_rows(&self, q: &Tensor, s: &CacheShape, out_dtype: DType) -> Result<(Tensor, Tensor)> {
        // Fixed length: out (batch, seqlen_q, heads, dv), LSE (batch, heads, seqlen_q); varlen
        // queries: out (total_q, heads, dv), LSE (heads, total_q).
        let (out_shape, lse_shape, sink_shape) = match s.varlen_q {
            false => (
                vec![s.batch, s.seqlen_q, s.heads, s.head_dim_v],
                vec![s.batch, s.heads, s.seqlen_q],
                vec![1, s.heads, 1],
            ),
            true => (
                vec![s.total_q, s.heads, s.head_dim_v],
                vec![s.heads, s.total_q],
                vec![s.heads, 1],
            ),
        };
        let out = Tensor::zeros(out_shape, out_dtype, q.device())?;
        let lse = match self.attn.sinks_f32(q, s.heads)? {
            Some(sinks) => sinks.reshape(sink_shape)?.broadcast_as(lse_shape)?.contiguous()?,
            None => Tensor::full(f32::NEG_INFINITY, lse_shape, q.device())?,
        };
        Ok((out, lse))
    }
}

/// The sizes of one kvcache call.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct CacheShape {
    pub batch: usize,
    /// Queries per sequence, or with varlen queries the longest sequence's.
    pub seqlen_q: usize,
    /// Packed query rows: batch × seqlen_q, or the varlen offsets' total.
    pub total_q: usize,
    /// The queries are packed per [`KvCacheAttn::varlen_q`].
    pub varlen_q: bool,
    pub seqlen_new: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub head_dim_v: usize,
    /// The caches' first dim: sequences (contiguous) or pages (paged).
    pub slots: usize,
    /// The caches' second dim: keys per sequence (contiguous) or per page (paged).
    pub rows: usize,
    /// Paged: the page table's columns.
    pub paged: Option<usize>,
    pub rotary_dim: usize,
}

impl CacheShape {
    /// Keys one sequence can hold: a contiguous cache's rows, or the page table's pages.
    pub fn capacity(&self) -> usize {
        self.paged.map_or(self.rows, |max_pages| max_pages * self.rows)
    }

    /// The attention's sizes over the cache: each sequence's keys read as `capacity` rows.
    pub fn dims(&self) -> Dims {
        Dims {
            batch: self.batch,
            seqlen_q: self.seqlen_q,
            seqlen_k: self.capacity(),
            total_q: self.total_q,
            total_k: self.batch * self.capacity(),
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            head_dim_v: self.head_dim_v,
        }
    }
}

fn check_u32(t: &Tensor, name: &str, dims: &[usize], q: &Tensor) -> Result<()> {
    if t.dims() != dims || t.dtype() != DType::U32 || !t.device().same_device(q.device()) {
        bail!(
            "flash-attn3: kvcache: {name} must be a u32 tensor of shape {dims:?} on q's device, got {:?} {:?}",
            t.dtype(),
            t.dims()
        )
    }
    Ok(())
}

/// cos / sin as f32 on the host.
struct RotaryTables {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
    interleaved: bool,
}

impl RotaryTables {
    /// x (batch, seqlen, heads, d) with token (b, i) turned to position `pos(b, i)`, in f32,
    /// rounded once to x's dtype.
    fn apply(&self, x: &Tensor, pos: impl Fn(usize, usize) -> usize) -> Result<Tensor> {
        let (batch, seqlen, heads, d) = x.dims4()?;
        let mut values = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let half = self.half;
        for b in 0..batch {
            for i in 0..seqlen {
                let p = pos(b, i);
                let (cos, sin) = (&self.cos[p * half..][..half], &self.sin[p * half..][..half]);
                for h in 0..heads {
                    let row = &mut values[((b * seqlen + i) * heads + h) * d..][..d];
                    for r in 0..half {
                        let (a, c) = if self.interleaved {
                            (2 * r, 2 * r + 1)
                        } else {
                            (r, r + half)
                        };
                        let (x0, x1) = (row[a], row[c]);
                        row[a] = x0 * cos[r] - x1 * sin[r];
                        row[c] = x0 * sin[r] + x1 * cos[r];
                    }
                }
            }
        }
        Tensor::from_vec(values, (batch, seqlen, heads, d), &Device::Cpu)?.to_dtype(x.dtype())
    }
}

/// Writes the rows of `src` (batch, seqlen_new, kv_heads, d), in (batch, token) order, into the
/// cache slots `slots` (one per row: a flat index slot · rows + row over the cache's first two
/// dims), in place; the cache may be a strided view whose head dim is contiguous.
fn write_slots(cache: &Tensor, src: &Tensor, slots: &[usize]) -> Result<()> {
    let src = src.contiguous()?;
    cache.inplace_op2(
        &src,
        &WriteSlots {
            slots: slots.to_vec(),
            rows: cache.dim(1)?,
            heads: src.dim(2)?,
            d: src.dim(3)?,
        },
    )
}

/// The in-place CPU write of [`write_slots`].
struct WriteSlots {
    slots: Vec<usize>,
    /// The cache's second dim (keys per sequence or page).
    rows: usize,
    heads: usize,
    d: usize,
}

impl InplaceOp2 for WriteSlots {
    fn name(&self) -> &'static str {
        "flash-attn3-kvcache-append"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dst_l: &Layout, src: &CpuStorage, src_l: &Layout) -> Result<()> {
        fn copy<T: Copy>(dst: &mut [T], dst_l: &Layout, src: &[T], src_l: &Layout, op: &WriteSlots) {
            let (dst, src) = (&mut dst[dst_l.start_offset()..], &src[src_l.start_offset()..]);
            let st = dst_l.stride();
            for (i, &slot) in op.slots.iter().enumerate() {
                let at = slot / op.rows * st[0] + slot % op.rows * st[1];
                for h in 0..op.heads {
                    let from = (i * op.heads + h) * op.d;
                    dst[at + h * st[2]..][..op.d].copy_from_slice(&src[from..][..op.d]);
                }
            }
        }
        match (dst, src) {
            (CpuStorage::F32(d), CpuStorage::F32(s)) => copy(d, dst_l, s, src_l, self),
            (CpuStorage::F16(d), CpuStorage::F16(s)) => copy(d, dst_l, s, src_l, self),
            (CpuStorage::BF16(d), CpuStorage::BF16(s)) => copy(d, dst_l, s, src_l, self),
            (CpuStorage::F8E4M3(d), CpuStorage::F8E4M3(s)) => copy(d, dst_l, s, src_l, self),
            _ => bail!(
                "flash-attn3: kvcache append: the cache and the new rows must be f32, f16, bf16 or f8e4m3 of one dtype"
            ),
        }
        Ok(())
    }
}
