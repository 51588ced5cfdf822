//! What an attention call computes (scale, mask, softcap) and the shape checks every
//! device path relies on. All validation happens here, before any storage is touched,
//! so the CPU and CUDA paths can assume well-formed inputs.

use candle_core::{bail, DType, Layout, Result, Tensor};

/// The largest head dimension any path supports (FA3's limit).
pub const MAX_HEAD_DIM: usize = 256;

/// How the GPU forward schedules a call ([`crate::FlashAttn::tuning`]): for benchmarks and
/// comparisons, never for the result, which is the same up to rounding (the CPU path ignores
/// it). `Tuning::default()` chooses per call what measured fastest (docs/kernels/forward-sm90.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tuning {
    /// Whether the q heads of a GQA group share one tile: `None` packs decode-like calls (at most
    /// 64 queries per sequence), `Some(true)` every GQA call, `Some(false)` none.
    pub pack_gqa: Option<bool>,
    /// Query rows per tile for head dims up to 64, 128 or 192: `None` takes 192 except for
    /// masked or varlen calls under 4096 queries (2048 for fp8 inputs).
    pub d64_tile_rows: Option<usize>,
    /// Store O straight from registers instead of through shared memory and a TMA store.
    pub direct_store: bool,
    /// Masked or varlen calls: one CTA per tile instead of the persistent grid claiming tiles
    /// through an atomic counter.
    pub per_tile: bool,
    /// How the persistent grid hands out tiles: `Some(true)` through an atomic counter, each CTA
    /// claiming its next tile as it nears the end of the one before; `Some(false)` statically
    /// strided (CTA c takes tiles c, c + grid, ...); `None` the counter where tiles differ in work
    /// (masked or varlen calls, and calls whose last query tile leaves a consumer warpgroup
    /// without rows), strided for the others.
    pub dynamic_tiles: Option<bool>,
    /// (batch, head) pairs per section of the tile order: `None` sizes sections to the L2 for
    /// masked or varlen calls (one pair for the others).
    pub l2_section: Option<usize>,
    /// Keys per pipeline stage of the fp8 kernel for head dims 65..=128: 128, or 256 (a consumer
    /// loop without intra-warpgroup overlap, cuDNN's shape); `None` takes 256 from 512 keys (the
    /// longest key sequence of the call), from 2,048 for causal, windowed or varlen calls. KV cache
    /// calls always run on 128.
    pub fp8_d128_block_n: Option<usize>,
    /// Who writes V^T, the keys-contiguous copy of V that the fp8 kernels' P·V reads (outside KV
    /// caches): `Some(true)` (and `None`) the forward kernel itself, two of its producer warps
    /// under the attention (every head dim); `Some(false)` a pre-pass kernel before it
    /// (docs/kernels/forward-fp8.md, "V^T in the kernel").
    pub fp8_vt_in_kernel: Option<bool>,
    /// Split-KV calls merge their key shares in the combine kernel even where the forward launch
    /// would merge them itself, each tile's shares as one thread-block cluster
    /// (kernels/flash_fwd/cluster_combine.cuh: single-query decode over short caches).
    pub global_combine: bool,
    /// KV-cache calls whose query rows per sequence fit one warpgroup's 64 (decode) on the
    /// forward kernel: the two-warpgroup kernel, one CTA per SM, instead of the one-warpgroup
    /// kernel at two CTAs per SM (two chains of key blocks per SM). The default takes that one for
    /// fp8 caches at head dims up to 64 always (docs/kernels/kvcache.md, session 38), and for
    /// 16-bit caches where it measured faster (session 52): head dim 64 with enough (sequence, kv
    /// head) tiles for both CTA slots of most SMs over caches of up to 2,048 keys or pages under 64
    /// keys, or over pages under 64 keys from 2,048; head dim 128 over pages under 64 keys and up
    /// to 2,048 keys with that many tiles.
    pub decode_one_cta_per_sm: bool,
    /// Single-query calls over a 16-bit KV cache (`flash_attn_with_kvcache`, one query per
    /// sequence, head dim 64 or 128, at most 16 q heads per kv head, `num_splits` 0): `None` runs
    /// them on the CUDA-core decode kernel (kernels/kvcache/decode.cu) where it measured faster
    /// (head dim 64, at most 2,048 keys a sequence, at most one CTA per SM: batch-1 and -2
    /// decode steps of the 1B shape; batch 4 and 8 on fewer key shares, up to 1,024 keys;
    /// docs/kernels/kvcache.md, sessions 39 and 44), `Some(true)` wherever it applies,
    /// `Some(false)` never (the forward kernel).
    pub decode_kernel: Option<bool>,
}

impl Tuning {
    pub(crate) fn validate(&self) -> Result<()> {
        if let Some(rows) = self.d64_tile_rows {
            if rows != 128 && rows != 192 {
                bail!("flash-attn3: Tuning::d64_tile_rows must be 128 or 192, got {rows}")
            }
        }
        if let Some(keys) = self.fp8_d128_block_n {
            if keys != 128 && keys != 256 {
                bail!("flash-attn3: Tuning::fp8_d128_block_n must be 128 or 256, got {keys}")
            }
        }
        if self.l2_section == Some(0) {
            bail!("flash-attn3: Tuning::l2_section must be at least 1 (None: chosen per call)")
        }
        Ok(())
    }
}

/// The options of one attention call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct AttnParams {
    /// Multiplies q·k before the softcap and the softmax.
    pub softmax_scale: f32,
    /// Keys more than this many positions left of the query's diagonal are masked (None: unbounded).
    pub window_left: Option<usize>,
    /// Keys more than this many positions right of the query's diagonal are masked (None: unbounded).
    /// Causal attention is `Some(0)`.
    pub window_right: Option<usize>,
    /// When set, a scaled score s becomes `cap * tanh(s / cap)` before the softmax.
    pub softcap: Option<f32>,
    /// GPU forward: split-KV shares per query tile (0: chosen per call; 1: no split). The
    /// result is the same up to rounding; the CPU path ignores it.
    pub num_splits: usize,
    /// GPU forward scheduling choices; the CPU path ignores them.
    pub tuning: Tuning,
}

impl AttnParams {
    /// Causal or windowed: a query sees only part of the keys (the tiles' work differs, and a
    /// kvcache call's rotary turns each query to its own position).
    pub fn is_masked(&self) -> bool {
        self.window_left.is_some() || self.window_right.is_some()
    }

    pub fn validate(&self) -> Result<()> {
        self.tuning.validate()?;
        if !self.softmax_scale.is_finite() {
            bail!("flash-attn3: softmax_scale must be finite, got {}", self.softmax_scale)
        }
        if let Some(cap) = self.softcap {
            if !(cap.is_finite() && cap > 0.0) {
                bail!("flash-attn3: softcap must be finite and > 0, got {cap}")
            }
        }
        Ok(())
    }

    /// The key range `[lo, hi)` that query `i` of a sequence may see. Causal and window
    /// masks are aligned bottom-right: the diagonal of query `i` is key `i + seqlen_k - seqlen_q`.
    pub fn key_range(&self, i: usize, seqlen_q: usize, seqlen_k: usize) -> (usize, usize) {
        let diagonal = i as i64 + seqlen_k as i64 - seqlen_q as i64;
        let lo = match self.window_left {
            Some(left) => (diagonal - left as i64).max(0),
            None => 0,
        };
        let hi = match self.window_right {
            Some(right) => (diagonal + right as i64 + 1).min(seqlen_k as i64),
            None => seqlen_k as i64,
        };
        let lo = lo.min(seqlen_k as i64) as usize;
        (lo, (hi.max(lo as i64)) as usize)
    }
}

/// The sizes of one attention problem. For varlen calls `batch` is the number of
/// sequences, `seqlen_q`/`seqlen_k` are the declared maxima and `total_*` the packed lengths;
/// for fixed-length calls `total_q = batch * seqlen_q`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Dims {
    pub batch: usize,
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    pub total_q: usize,
    pub total_k: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub head_dim_v: usize,
}

impl Dims {
    /// Query heads that share one key/value head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
}

/// Sequence boundaries of a varlen call, read from the cumulative `seqlens` tensors.
/// The CPU path reads the host copies; the CUDA path passes the device tensors to its kernels.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct Varlen {
    pub seqlens_q: Tensor,
    pub seqlens_k: Tensor,
    pub cu_q: Vec<usize>,
    pub cu_k: Vec<usize>,
}

fn check_dtypes(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
    let dtype = q.dtype();
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16 | DType::F8E4M3) {
        bail!("flash-attn3: unsupported dtype {dtype:?}: q, k and v must be f32, f16, bf16 or f8e4m3 (forward only)")
    }
    if k.dtype() != dtype || v.dtype() != dtype {
        bail!(
            "flash-attn3: q, k and v must share one dtype, got q {:?}, k {:?}, v {:?}",
            dtype,
            k.dtype(),
            v.dtype()
        )
    }
    if !q.device().same_device(k.device()) || !q.device().same_device(v.device()) {
        let other = if q.device().same_device(k.device()) { v } else { k };
        bail!(
            "flash-attn3: q, k and v must be on one device, got q {:?}, k {:?}, v {:?}{}",
            q.device().location(),
            k.device().location(),
            v.device().location(),
            same_gpu_note(q.device(), other.device())
        )
    }
    Ok(())
}

/// The kernels read rows of head_dim elements: the last dimension must be contiguous.
pub(crate) fn check_last_dim_contiguous(name: &str, layout: &Layout) -> Result<()> {
    let dims = layout.dims();
    let last = dims.len() - 1;
    if dims[last] > 1 && layout.stride()[last] != 1 {
        bail!(
            "flash-attn3: the last dimension of {name} must be contiguous (stride 1), got strides {:?}; call .contiguous() first",
            layout.stride()
        )
    }
    Ok(())
}

fn check_head_dims(head_dim: usize, head_dim_v: usize) -> Result<()> {
    for (name, d) in [("q/k", head_dim), ("v", head_dim_v)] {
        if d == 0 || d > MAX_HEAD_DIM {
            bail!("flash-attn3: {name} head dim must be in 1..={MAX_HEAD_DIM}, got {d}")
        }
    }
    Ok(())
}

fn check_heads(heads: usize, kv_heads: usize) -> Result<()> {
    if kv_heads == 0 || heads == 0 {
        bail!("flash-attn3: empty input: q has {heads} heads and k/v have {kv_heads}")
    }
    if heads % kv_heads != 0 {
        bail!("flash-attn3: the number of q heads ({heads}) must be a multiple of the number of k/v heads ({kv_heads})")
    }
    Ok(())
}

fn check_common(q: &Tensor, k: &Tensor, v: &Tensor, rank: usize) -> Result<()> {
    check_dtypes(q, k, v)?;
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.rank() != rank {
            bail!(
                "flash-attn3: {name} must have rank {rank} ({}), got shape {:?}",
                if rank == 4 {
                    "batch, seqlen, heads, head_dim"
                } else {
                    "total_tokens, heads, head_dim"
                },
                t.dims()
            )
        }
        check_last_dim_contiguous(name, t.layout())?;
    }
    Ok(())
}

/// Checks q (b, sq, h, d), k (b, sk, hk, d), v (b, sk, hk, dv).
pub(crate) fn check_fixed(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Dims> {
    check_common(q, k, v, 4)?;
    let (batch, seqlen_q, heads, head_dim) = q.dims4()?;
    let (kb, seqlen_k, kv_heads, kd) = k.dims4()?;
    let (vb, vs, vh, head_dim_v) = v.dims4()?;
    if kb != batch || vb != batch || vs != seqlen_k || vh != kv_heads || kd != head_dim {
        bail!(
            "flash-attn3: shapes do not match: q {:?} (batch, seqlen_q, heads, d), k {:?} and v {:?} must be (batch, seqlen_k, kv_heads, d) and (batch, seqlen_k, kv_heads, d_v)",
            q.dims(),
            k.dims(),
            v.dims()
        )
    }
    if batch == 0 || seqlen_q == 0 || seqlen_k == 0 {
        bail!("flash-attn3: empty input: q {:?}, k {:?}", q.dims(), k.dims())
    }
    check_heads(heads, kv_heads)?;
    check_head_dims(head_dim, head_dim_v)?;
    Ok(Dims {
        batch,
        seqlen_q,
        seqlen_k,
        total_q: batch * seqlen_q,
        total_k: batch * seqlen_k,
        heads,
        kv_heads,
        head_dim,
        head_dim_v,
    })
}

/// The offsets a [`crate::SeqOffsets`] may hold: at least two, starting at 0, non-decreasing.
pub(crate) fn check_offsets_shape(name: &str, cu: &[u32]) -> Result<()> {
    if cu.len() < 2 {
        bail!("flash-attn3: {name} must hold batch + 1 >= 2 offsets, got {}", cu.len())
    }
    if cu[0] != 0 {
        bail!("flash-attn3: {name} must start at 0, got {}", cu[0])
    }
    if let Some(w) = cu.windows(2).find(|w| w[1] < w[0]) {
        bail!(
            "flash-attn3: {name} must be non-decreasing, got {} after {} in {:?}",
            w[1],
            w[0],
            cu
        )
    }
    Ok(())
}

/// Validates host-side cumulative offsets against a call: the shape rules above, every
/// sequence within `max_seqlen`, the last offset equal to the packed length.
fn check_cumulative(name: &str, cu: &[u32], total: usize, max_seqlen: usize) -> Result<Vec<usize>> {
    check_offsets_shape(name, cu)?;
    let cu: Vec<usize> = cu.iter().map(|&x| x as usize).collect();
    for w in cu.windows(2) {
        if w[1] - w[0] > max_seqlen {
            bail!(
                "flash-attn3: {name} holds a sequence of length {} longer than the declared maximum {max_seqlen}",
                w[1] - w[0]
            )
        }
    }
    if *cu.last().unwrap() != total {
        bail!(
            "flash-attn3: {name} must end at the number of packed tokens ({total}), got {}",
            cu.last().unwrap()
        )
    }
    Ok(cu)
}

fn check_offsets_tensor(name: &str, seqlens: &Tensor) -> Result<()> {
    if seqlens.dtype() != DType::U32 || seqlens.rank() != 1 {
        bail!(
            "flash-attn3: {name} must be a rank-1 u32 tensor of cumulative lengths, got {:?} of shape {:?}",
            seqlens.dtype(),
            seqlens.dims()
        )
    }
    Ok(())
}

/// Reads a device tensor of offsets back to the host (a blocking copy on the GPU) and validates it.
fn read_cumulative(name: &str, seqlens: &Tensor, total: usize, max_seqlen: usize) -> Result<Vec<usize>> {
    check_offsets_tensor(name, seqlens)?;
    check_cumulative(name, &seqlens.to_vec1::<u32>()?, total, max_seqlen)
}

/// The offsets of one side of a varlen call: a tensor on the device of q (what the kernels
/// read), and, when the caller knows them, the same offsets on the host (validated without
/// reading the tensor back).
pub(crate) enum Offsets<'a> {
    Device(&'a Tensor),
    Host(&'a crate::SeqOffsets),
}

impl Offsets<'_> {
    fn tensor(&self) -> &Tensor {
        match self {
            Offsets::Device(t) => t,
            Offsets::Host(o) => o.tensor(),
        }
    }

    fn validate(&self, name: &str, total: usize, max_seqlen: usize) -> Result<Vec<usize>> {
        match self {
            Offsets::Device(t) => read_cumulative(name, t, total, max_seqlen),
            Offsets::Host(o) => check_cumulative(name, o.as_slice(), total, max_seqlen),
        }
    }
}

/// Checks packed q (total_q, h, d), k (total_k, hk, d), v (total_k, hk, dv) and the
/// cumulative u32 sequence lengths (batch + 1 entries each).
pub(crate) fn check_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: Offsets,
    seqlens_k: Offsets,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
) -> Result<(Dims, Varlen)> {
    check_common(q, k, v, 3)?;
    let (total_q, heads, head_dim) = q.dims3()?;
    let (total_k, kv_heads, kd) = k.dims3()?;
    let (vt, vh, head_dim_v) = v.dims3()?;
    if vt != total_k || vh != kv_heads || kd != head_dim {
        bail!(
            "flash-attn3: shapes do not match: q {:?} (total_q, heads, d), k {:?} and v {:?} must be (total_k, kv_heads, d) and (total_k, kv_heads, d_v)",
            q.dims(),
            k.dims(),
            v.dims()
        )
    }
    if total_q == 0 || total_k == 0 {
        bail!("flash-attn3: empty input: q {:?}, k {:?}", q.dims(), k.dims())
    }
    check_heads(heads, kv_heads)?;
    check_head_dims(head_dim, head_dim_v)?;
    for (name, t) in [("seqlens_q", seqlens_q.tensor()), ("seqlens_k", seqlens_k.tensor())] {
        if !t.device().same_device(q.device()) {
            bail!(
                "flash-attn3: {name} must be on the device of q ({:?}), got {:?}{}",
                q.device().location(),
                t.device().location(),
                same_gpu_note(q.device(), t.device())
            )
        }
    }
    let cu_q = seqlens_q.validate("seqlens_q", total_q, max_seqlen_q)?;
    let cu_k = seqlens_k.validate("seqlens_k", total_k, max_seqlen_k)?;
    if cu_q.len() != cu_k.len() {
        bail!(
            "flash-attn3: seqlens_q and seqlens_k must describe the same batch, got {} and {} offsets",
            cu_q.len(),
            cu_k.len()
        )
    }
    let dims = Dims {
        batch: cu_q.len() - 1,
        seqlen_q: max_seqlen_q,
        seqlen_k: max_seqlen_k,
        total_q,
        total_k,
        heads,
        kv_heads,
        head_dim,
        head_dim_v,
    };
    let varlen = Varlen {
        seqlens_q: seqlens_q.tensor().clone(),
        seqlens_k: seqlens_k.tensor().clone(),
        cu_q,
        cu_k,
    };
    Ok((dims, varlen))
}

/// The most split-KV shares of one tile (FA3's limit too).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const MAX_SPLITS: usize = 128;

/// Key blocks up to which [`split_count`] never splits (when left to choose).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const MAX_UNSPLIT_KEY_BLOCKS: usize = 4;

/// How many split-KV shares each tile gets when the caller left it to us (`requested` 0).
///
/// Splitting pays when the tiles alone would leave SMs idle: `tiles` CTAs on `sms` SMs, each
/// walking `key_blocks` key blocks. As FA3 does, pick the split count whose last wave is fullest
/// (efficiency = waves / ceil(waves)), preferring the smallest within 85% of the best, and skip
/// counts that do not shorten the longest share (ceil(key_blocks / s) unchanged from s - 1).
///
/// Up to [`MAX_UNSPLIT_KEY_BLOCKS`] key blocks (FA3's 4), an eager call is never split: the
/// partial outputs and their combine launch cost more than the shares save. It was 8 until
/// session 21, from batch-1 decode timings (d64, 32/8 heads, H100, eager: 5 blocks 12.8 µs
/// unsplit against 16.4 split) taken when a split cost about 7 µs more of host time per call,
/// before the combine's version 2 and the scheduler counter without a memset; measured again on
/// an H100 (same call, eager, d128, 32/4 heads, 8 key blocks): batch 1 12.2–12.8 µs split against
/// 17.7–18.3 unsplit, batch 8 14.8–15.6 against 18.2–19.0, over pages of 16 keys 12.8–16.9 against
/// 27 (docs/kernels/kvcache.md, version 4), and flash-llama's eager decode of the 1B shape (d64,
/// 5 key blocks) 1.01x at batch 1 and 1.02–1.04x at batch 8. A call `captured` into a CUDA graph
/// pays no host time on replay, so it splits from 2 key blocks: graph-replayed on an H100, d128
/// batch-1 decode over 8 key blocks 11.6 µs split 8 ways against 17.0 unsplit, and flash-llama's
/// graph decode of the 1B shape (d64, 5 key blocks, 8 tiles) 1.05x the tokens/s.
/// Whether `tiles` CTAs fill most of `slots` (the CTAs that run at once, at least 80% of them):
/// then a call has no split ([`split_count`]).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn tiles_fill(tiles: usize, slots: usize) -> bool {
    tiles * 10 >= slots * 8
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn split_count(requested: usize, tiles: usize, sms: usize, key_blocks: usize, captured: bool) -> usize {
    if requested > 0 {
        return requested.min(MAX_SPLITS).min(key_blocks.max(1));
    }
    let unsplit_up_to = if captured { 1 } else { MAX_UNSPLIT_KEY_BLOCKS };
    // Enough tiles for most SMs, or too few key blocks to share: no split.
    if tiles_fill(tiles, sms) || key_blocks <= unsplit_up_to {
        return 1;
    }
    let max_splits = MAX_SPLITS.min(sms).min(key_blocks);
    let eligible = |s: usize| s == 1 || key_blocks.div_ceil(s) != key_blocks.div_ceil(s - 1);
    let efficiency = |s: usize| {
        let waves = (tiles * s) as f64 / sms as f64;
        waves / waves.ceil()
    };
    let best = (1..=max_splits)
        .filter(|&s| eligible(s))
        .map(efficiency)
        .fold(0.0, f64::max);
    (1..=max_splits)
        .find(|&s| eligible(s) && efficiency(s) >= 0.85 * best)
        .unwrap_or(1)
}

/// Bytes of K and V that the dynamic tile order keeps in L2 at once (FA3's budget; the H100's L2
/// holds 50 MB).
const L2_SECTION_BYTES: usize = 32 << 20;

/// How many (batch, head) pairs share a section of the dynamic tile order
/// (`fa3::FwdParams::l2_section`, kernels/flash_fwd/scheduler.cuh): a section runs the longest
/// query tile of each of its pairs first, then the next longest, so that a launch of uneven
/// (causal, windowed, varlen) tiles ends on short tiles, while the CTAs working at the same time
/// read the K/V of at most one section's heads. As in FA3: the kv heads whose K/V
/// (`seqlen_k * (head_dim + head_dim_v)` 16-bit elements each, counted twice for headroom) fit in
/// [`L2_SECTION_BYTES`], rounded down to a power of two, times the q heads per kv head (`group`;
/// 1 when a tile already packs the group). At least 1, at most `pairs`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn l2_section_pairs(
    seqlen_k: usize,
    head_dim: usize,
    head_dim_v: usize,
    group: usize,
    pairs: usize,
) -> usize {
    let kv_head_bytes = (seqlen_k.max(1) * (head_dim + head_dim_v) * 2 * 2).max(1);
    let kv_heads = L2_SECTION_BYTES / kv_head_bytes;
    let pow2 = if kv_heads == 0 { 1 } else { 1 << kv_heads.ilog2() };
    (pow2 * group.max(1)).clamp(1, pairs.max(1))
}

/// A divisor fixed per launch, with the multiplier and shift that let the forward kernel divide
/// by it without a division instruction (`fa3::FastDiv`, kernels/flash_fwd/params.cuh; mirrored
/// field for field): for `0 <= n < 2^31`, `n / d = umulhi(n, mul) >> shift`, where
/// `l = ceil(log2 d)`, `mul = ceil(2^(31 + l) / d)` and `shift = l - 1` (Granlund and Montgomery's
/// method: `mul * d - 2^(31 + l) < d <= 2^l`, so the error times `n < 2^31` stays below
/// `2^(31 + l)`). `d = 1` is passed through by the kernel (`mul` and `shift` unused).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct FastDiv {
    d: i32,
    mul: u32,
    shift: u32,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl FastDiv {
    /// `d` must be in `1..2^31` (tile counts and head counts; the launch checks them against i32).
    pub(crate) fn new(d: usize) -> Result<Self> {
        if d == 0 || d > i32::MAX as usize {
            candle_core::bail!("flash-attn: internal divisor {d} out of range")
        }
        if d == 1 {
            return Ok(Self { d: 1, mul: 0, shift: 0 });
        }
        let l = usize::BITS - (d - 1).leading_zeros(); // ceil(log2 d), >= 1
        let mul = (1u64 << (31 + l)).div_ceil(d as u64);
        Ok(Self {
            d: d as i32,
            mul: mul as u32,
            shift: l - 1,
        })
    }

    /// What the kernel computes (for the tests).
    #[cfg(test)]
    fn div(&self, n: u32) -> u32 {
        if self.d == 1 {
            n
        } else {
            ((n as u64 * self.mul as u64) >> 32) as u32 >> self.shift
        }
    }
}

/// What to add to a "not on q's device" error when both tensors sit on the same GPU through two
/// candle `Device`s (each `Device::new_cuda(0)` is a device of its own, with its own context and
/// stream, and candle keeps tensors of different ones apart).
pub(crate) fn same_gpu_note(a: &candle_core::Device, b: &candle_core::Device) -> &'static str {
    if a.location() == b.location() {
        " (the same GPU through two candle Devices: create the Device once and share it)"
    } else {
        ""
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_div_matches_integer_division() {
        let mut divisors: Vec<usize> = (1..=300).collect();
        divisors.extend([
            511,
            512,
            513,
            1000,
            4095,
            65_535,
            65_536,
            1 << 20,
            (1 << 30) + 1,
            i32::MAX as usize,
        ]);
        // Numerators at the ends of the range and around multiples of d, where a rounding error
        // would show first.
        for &d in &divisors {
            let f = FastDiv::new(d).unwrap();
            let mut ns: Vec<u32> = vec![0, 1, 2, 3, i32::MAX as u32, i32::MAX as u32 - 1];
            for m in [1u64, 2, 3, 7, 1000, (i32::MAX as u64) / d as u64] {
                for delta in [-1i64, 0, 1] {
                    let n = (m * d as u64) as i64 + delta;
                    if (0..=i32::MAX as i64).contains(&n) {
                        ns.push(n as u32);
                    }
                }
            }
            for n in ns {
                assert_eq!(f.div(n), n / d as u32, "{n} / {d}");
            }
        }
        assert!(FastDiv::new(0).is_err());
        assert!(FastDiv::new(1 << 31).is_err());
    }

    /// The kernel's tile decode (scheduler.cuh, get_tile, without splits): tile -> (m_block, pair).
    fn decode_tile(tile: usize, num_m_blocks: usize, pairs: usize, section: usize) -> (usize, usize) {
        let full_sections = pairs / section;
        let last = if pairs % section == 0 { section } else { pairs % section };
        let (sec, in_section) = (tile / (section * num_m_blocks), tile % (section * num_m_blocks));
        let width = if sec < full_sections { section } else { last };
        let (m_rev, hb_in) = (in_section / width, in_section % width);
        (num_m_blocks - 1 - m_rev, sec * section + hb_in)
    }

    #[test]
    fn l2_sections_cover_every_tile_once_longest_first() {
        for (num_m_blocks, pairs, section) in [
            (16, 128, 16),
            (16, 128, 1),
            (5, 7, 4),
            (3, 10, 10),
            (1, 9, 2),
            (4, 6, 8),
        ] {
            let section = section.min(pairs);
            let tiles: Vec<(usize, usize)> = (0..num_m_blocks * pairs)
                .map(|t| decode_tile(t, num_m_blocks, pairs, section))
                .collect();
            let mut seen = tiles.clone();
            seen.sort();
            seen.dedup();
            assert_eq!(
                seen.len(),
                num_m_blocks * pairs,
                "{num_m_blocks} x {pairs} by {section}"
            );
            assert!(tiles.iter().all(|&(m, hb)| m < num_m_blocks && hb < pairs));
            // Inside a section the query tiles never grow; sections follow one another.
            for w in tiles.windows(2) {
                let (s0, s1) = (w[0].1 / section, w[1].1 / section);
                assert!(s1 == s0 && w[1].0 <= w[0].0 || s1 == s0 + 1, "{w:?}");
            }
        }
    }

    #[test]
    fn l2_section_pairs_follow_the_l2_budget() {
        // d128 bf16: 2 MiB of K/V per kv head at 2k keys (counted twice) -> 16 pairs; 8 at 4k.
        assert_eq!(l2_section_pairs(2048, 128, 128, 1, 128), 16);
        assert_eq!(l2_section_pairs(4096, 128, 128, 1, 64), 8);
        // Rounded down to a power of two, times the q heads per kv head, within [1, pairs].
        assert_eq!(l2_section_pairs(3000, 128, 128, 1, 1000), 8);
        assert_eq!(l2_section_pairs(4096, 128, 128, 4, 1000), 32);
        assert_eq!(l2_section_pairs(4096, 128, 128, 1, 3), 3);
        assert_eq!(l2_section_pairs(1 << 20, 256, 256, 1, 100), 1);
        assert_eq!(l2_section_pairs(0, 64, 64, 1, 0), 1);
    }

    fn params(left: Option<usize>, right: Option<usize>) -> AttnParams {
        AttnParams {
            softmax_scale: 1.0,
            window_left: left,
            window_right: right,
            softcap: None,
            num_splits: 0,
            tuning: Tuning::default(),
        }
    }

    #[test]
    fn split_count_fills_the_gpu_only_when_tiles_are_few() {
        // Enough tiles (>= 80% of the SMs) or a single key block: never split.
        assert_eq!(split_count(0, 106, 132, 64, false), 1);
        assert_eq!(split_count(0, 4, 132, 1, false), 1);
        // Few key blocks: the combine costs more than the shares save.
        assert_eq!(split_count(0, 1, 132, MAX_UNSPLIT_KEY_BLOCKS, false), 1);
        assert!(split_count(0, 1, 132, MAX_UNSPLIT_KEY_BLOCKS + 1, false) > 1);
        // Decode at batch 1 with 8 kv heads (pack-GQA: 8 tiles) and 64 key blocks: enough shares
        // to fill most SMs, each share at least one block.
        let s = split_count(0, 8, 132, 64, false);
        assert!((8..=32).contains(&s), "{s}");
        assert!(8 * s <= 2 * 132);
        // Never more shares than key blocks, nor than the cap.
        assert!(split_count(0, 1, 132, 3, false) <= 3);
        assert!(split_count(0, 1, 1000, 10_000, false) <= MAX_SPLITS);
        // Forced counts are capped the same way.
        assert_eq!(split_count(7, 200, 132, 64, false), 7);
        assert_eq!(split_count(1, 1, 132, 64, false), 1);
        assert_eq!(split_count(500, 1, 132, 1000, false), MAX_SPLITS);
        assert_eq!(split_count(16, 1, 132, 5, false), 5);
        // Captured into a CUDA graph (no host time per split on replay): few key blocks split
        // too, to fill the GPU: 8 tiles of 5 blocks one block per share, 64 tiles two shares.
        assert_eq!(split_count(0, 8, 132, 5, true), 5);
        assert_eq!(split_count(0, 64, 132, 5, true), 2);
        assert_eq!(split_count(0, 4, 132, 8, true), 8);
        assert_eq!(split_count(0, 8, 132, 1, true), 1);
        assert_eq!(split_count(0, 106, 132, 5, true), 1);
    }

    #[test]
    fn key_range_is_bottom_right_aligned() {
        // Causal with sq < sk: the last query sees every key.
        let causal = params(None, Some(0));
        assert_eq!(causal.key_range(0, 2, 5), (0, 4));
        assert_eq!(causal.key_range(1, 2, 5), (0, 5));
        // Causal with sq > sk: early queries see nothing.
        assert_eq!(causal.key_range(0, 5, 2), (0, 0));
        assert_eq!(causal.key_range(3, 5, 2), (0, 1));
        // A window of 1 left, 1 right around the diagonal.
        let window = params(Some(1), Some(1));
        assert_eq!(window.key_range(0, 4, 4), (0, 2));
        assert_eq!(window.key_range(2, 4, 4), (1, 4));
        // Unbounded.
        assert_eq!(params(None, None).key_range(3, 4, 9), (0, 9));
    }
}
