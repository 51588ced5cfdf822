//! The single-query decode kernel (kernels/kvcache/decode.cu): `flash_attn_with_kvcache` calls
//! with one query per sequence over a 16-bit cache that holds few keys per sequence run on small
//! CUDA-core CTAs, every sequence's key shares merged inside a thread-block cluster, instead of on
//! the forward kernel, whose big warp-specialised CTAs cost ~10 µs a call at short caches
//! (docs/kernels/kvcache.md, session 39). [`plan`] says whether a call takes it; [`launch`] runs it.
//! A call with at most one new key per sequence has its append done inside the kernel
//! ([`FusedAppend`]): one launch for the whole call.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::driver::{sys, CudaFunction, DevicePtrMut, DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::{CudaDType, CudaDevice, DeviceId};
use candle_core::{bail, CudaStorage, DType, Result, Tensor};
use half::{bf16, f16};

use super::kvcache::{CacheLaunch, GpuCall};
use super::{device_address, launch_with_attributes, load_kernel, max_active_clusters};
use crate::kvcache::CacheShape;
use crate::params::AttnParams;

static CUBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kvcache_decode.cubin"));

/// `fa3::kDecodeMaxGroup`: q heads per kv head (a CTA's rows); at head dim 128 at most 8 (its
/// 16-row kernel would spill).
const MAX_GROUP: usize = 16;
fn max_group(head_dim: usize) -> usize {
    if head_dim == 128 {
        8
    } else {
        MAX_GROUP
    }
}
/// `fa3::kClusterMaxShares` (kernels/flash_fwd/share_merge.cuh): a sequence's key shares, one CTA
/// each, in one cluster (the portable cluster size).
const MAX_SHARES: usize = 8;
/// A share's keys at least (fewer keys, fewer shares, rounded up to a power of two): each of a CTA's
/// eight warps then takes about 8 or more.
const MIN_KEYS_PER_SHARE: usize = 64;
/// Under `Tuning::decode_kernel: None`, a call takes the kernel at head dim 64 where a sequence
/// holds at most this many keys (a share's keys run in one CTA, where the forward kernel spreads
/// long caches over the whole GPU) and its grid has at most one CTA per SM. Elsewhere (8k keys,
/// more CTAs, head dim 128) the forward kernel measured faster (docs/kernels/kvcache.md, sessions
/// 39 and 40).
const DEFAULT_MAX_KEYS: usize = 2048;
/// The same for calls whose shares were halved to fit one CTA per SM (more sequences).
const HALVED_MAX_KEYS: usize = 1024;
/// `fa3::kDecodeWarps`: each warp's rows are staged in shared memory for the merge.
const WARPS: usize = 8;

/// The decode kernel of a call: the GQA group's rows are unrolled to a bound of 4, 8 or 16 q
/// heads per kv head.
fn kernel_name(head_dim: usize, dtype: DType, group: usize) -> Result<&'static str> {
    Ok(match (head_dim, dtype, group.next_power_of_two().max(4)) {
        (64, DType::BF16, 4) => "kvcache_decode_d64_bf16_g4",
        (64, DType::BF16, 8) => "kvcache_decode_d64_bf16_g8",
        (64, DType::BF16, 16) => "kvcache_decode_d64_bf16_g16",
        (64, DType::F16, 4) => "kvcache_decode_d64_f16_g4",
        (64, DType::F16, 8) => "kvcache_decode_d64_f16_g8",
        (64, DType::F16, 16) => "kvcache_decode_d64_f16_g16",
        (128, DType::BF16, 4) => "kvcache_decode_d128_bf16_g4",
        (128, DType::BF16, 8) => "kvcache_decode_d128_bf16_g8",
        (128, DType::F16, 4) => "kvcache_decode_d128_f16_g4",
        (128, DType::F16, 8) => "kvcache_decode_d128_f16_g8",
        (d, dt, _) => {
            bail!("flash-attn3: kvcache: no decode kernel for head dim {d}, {dt:?} and {group} q heads per kv head")
        }
    })
}

/// The decode kernel's function for a call of head dim `d`, `dtype` and GQA `group`, loaded once
/// (with the shared-memory attribute for its largest group), and its block size.
fn kernel(dev: &CudaDevice, d: usize, dtype: DType, group: usize) -> Result<(&'static str, CudaFunction, u32)> {
    let name = kernel_name(d, dtype, group)?;
    let func = load_kernel(dev, CUBIN, " kvcache decode", name, smem_bytes(d, max_group(d)))?;
    // The kernel's block size is its __launch_bounds__ (`fa3::kDecodeThreads`).
    let threads = func
        .get_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)
        .map_err(|e| candle_core::Error::Msg(format!("flash-attn3: {name}: block size: {e:?}")))?;
    Ok((name, func, threads as u32))
}

/// How many CTAs of a call's decode kernel run at once in clusters of 1, 2, 4 and 8 CTAs
/// ([`plan`]'s `resident`): the driver's count of co-resident clusters
/// (cuOccupancyMaxActiveClusters) times their size. A cluster's CTAs must share a GPC, so a
/// kernel of one CTA per SM fits 120 CTAs in clusters of 4 or 8 on a 132-SM H200, not 132; a
/// call that needs the 128 of 16 such clusters ran a second wave for the last (1.3-1.5x the time
/// of the same keys on half the shares; docs/kernels/kvcache.md, session 51). A call that no
/// decode kernel takes gets `sms` everywhere.
/// Cached per device, kernel and shared-memory size: every `flash_attn_with_kvcache` call asks.
pub(super) fn resident_ctas(dev: &CudaDevice, s: &CacheShape, dtype: DType, sms: usize) -> Result<[usize; 4]> {
    let group = s.heads / s.kv_heads.max(1);
    let Some(name) = kernel_name(s.head_dim, dtype, group).ok().filter(|_| group > 0) else {
        return Ok([sms; 4]);
    };
    let smem = smem_bytes(s.head_dim, group) as u32;
    type Cache = Mutex<HashMap<(DeviceId, &'static str, u32), [usize; 4]>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let key = (dev.id(), name, smem);
    if let Some(&counts) = CACHE.get_or_init(Default::default).lock().unwrap().get(&key) {
        return Ok(counts);
    }
    let (name, func, threads) = kernel(dev, s.head_dim, dtype, group)?;
    let mut counts = [0; 4];
    for (i, n) in counts.iter_mut().enumerate() {
        let cluster = 1u32 << i;
        *n = max_active_clusters(dev, &func, name, cluster, threads, smem)? * cluster as usize;
    }
    CACHE.get_or_init(Default::default).lock().unwrap().insert(key, counts);
    Ok(counts)
}

/// `fa3::DecodeSmem`'s bytes for a GQA group of `group` rows at head dim `d`: the merge's inbox
/// mbarrier (16 bytes), then f32s: q's rows, each warp's probabilities of its step
/// (`fa3::DecodeTraits::kKeys` keys: 16 at d64, 8 at d128), each warp's O rows, max and sum, and
/// the shares' O at this CTA's items (one group's rows in all) with their rows' max and sum (up to
/// `MAX_SHARES` shares); then the fused append's new key and value row (16-bit).
fn smem_bytes(d: usize, group: usize) -> usize {
    let keys = 32 / (d / 32);
    let warps = WARPS * group * (keys + d + 2);
    16 + 4 * (group * d + warps + group * d + 2 * MAX_SHARES * group) + 2 * 2 * d
}

/// Mirror of `fa3::DecodeParams` (kernels/kvcache/decode.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct DecodeParams {
    q: u64,
    k_cache: u64,
    v_cache: u64,
    seqused: u64,
    kv_batch_idx: u64,
    page_table: u64,
    sinks: u64,
    out: u64,
    lse: u64,
    k_slot_stride: i64,
    k_row_stride: i64,
    k_head_stride: i64,
    v_slot_stride: i64,
    v_row_stride: i64,
    v_head_stride: i64,
    heads: i32,
    group: i32,
    slots: i32,
    rows: i32,
    max_pages: i32,
    capacity: i32,
    window_left: i32,
    scale_log2: f32,
    softcap_pre: f32,
    k_new: u64,
    v_new: u64,
    rotary_cos: u64,
    rotary_sin: u64,
    status: u64,
    q_batch_stride: i64,
    k_new_batch_stride: i64,
    v_new_batch_stride: i64,
    seqlen_new: i32,
    checked: i32,
    rotary_half: i32,
    rotary_interleaved: i32,
    positions: i32,
}

// SAFETY: a plain #[repr(C)] POD that matches the kernel's parameter struct byte for byte.
unsafe impl DeviceRepr for DecodeParams {}

/// A cache tensor's element strides (slot, row, head) and start offset, for [`plan`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct CacheStrides {
    pub strides: [usize; 4],
    pub start_offset: usize,
}

impl CacheStrides {
    pub(super) fn of(t: &Tensor) -> Self {
        let layout = t.layout();
        let s = layout.stride();
        Self {
            strides: [s[0], s[1], s[2], s[3]],
            start_offset: layout.start_offset(),
        }
    }

    /// Every row starts on 16 bytes (the kernel's cp.async copies) and its elements are
    /// contiguous.
    fn rows_aligned(&self) -> bool {
        self.strides[3] == 1
            && self.strides[..3]
                .iter()
                .chain([&self.start_offset])
                .all(|&x| x % 8 == 0)
    }
}

/// The key shares (CTAs per sequence and kv head, one cluster) of a call that runs on the decode
/// kernel, or None for a call the forward kernel runs; `resident`: the CTAs of that kernel that
/// run at once in clusters of 1, 2, 4 and 8 ([`resident_ctas`]). The kernel takes one query per
/// sequence (not varlen), a 16-bit cache with rows aligned to 16 bytes, head dim 64 or 128 for q,
/// k and v, at most 16 q heads per kv head (8 at head dim 128), `num_splits` 0 (an explicit split
/// is the forward kernel's), and under `Tuning::decode_kernel: None` head dim 64, a cache of at
/// most [`DEFAULT_MAX_KEYS`] keys and a grid of at most one CTA per SM of the `sms` (the shares
/// halved down to two to fit it, over at most [`HALVED_MAX_KEYS`] keys). Windows, softcap, sinks,
/// pages, cache_batch_idx and an append before it all apply.
pub(super) fn plan(
    shape: &CacheShape,
    params: &AttnParams,
    dtype: DType,
    fp8: bool,
    (k, v): (CacheStrides, CacheStrides),
    sms: usize,
    resident: [usize; 4],
) -> Option<usize> {
    let s = shape;
    let supported = !fp8
        && matches!(dtype, DType::BF16 | DType::F16)
        && s.seqlen_q == 1
        && !s.varlen_q
        && (s.head_dim == 64 || s.head_dim == 128)
        && s.head_dim_v == s.head_dim
        && s.kv_heads > 0
        && s.heads % s.kv_heads == 0
        && s.heads / s.kv_heads <= max_group(s.head_dim)
        && params.num_splits == 0
        && k.rows_aligned()
        && v.rows_aligned()
        && s.batch <= u16::MAX as usize
        && s.kv_heads <= u16::MAX as usize
        && s.capacity() <= i32::MAX as usize
        && s.slots <= i32::MAX as usize;
    if !supported {
        return None;
    }
    // A power of two, so that the shares' CTAs own equal parts of the group's rows in the merge;
    // halved while the grid is more than one CTA per SM (more CTAs would only queue behind each
    // other, where fewer shares give each CTA more keys).
    let by_keys = s
        .capacity()
        .div_ceil(MIN_KEYS_PER_SHARE)
        .next_power_of_two()
        .clamp(1, MAX_SHARES);
    // At most one CTA per SM, and no more than run at once in clusters of that size (`resident`:
    // [1, 2, 4, 8]-CTA clusters).
    let pairs = s.batch * s.kv_heads;
    let fits = |shares: usize| pairs * shares <= sms.min(resident[shares.trailing_zeros() as usize]);
    let mut shares = by_keys;
    while shares > 1 && !fits(shares) {
        shares /= 2;
    }
    // Where that leaves one share (one CTA of eight warps walking all of a sequence's keys, step
    // after step), a kernel that runs two CTAs per SM takes two shares if they all run at once:
    // 16 warps an SM, each half the keys. That is the head-dim-64 kernel of groups up to 4
    // (`__launch_bounds__(256, 2)`); the others run one CTA per SM, so `resident` holds no more
    // than the SMs and the halving above already found two shares too many for them. Measured
    // 0.81-0.95x the time at batch 9-16 of the 1B shape (640-2,048 keys); four shares instead of
    // two at batch 8 were 1.4x slower (docs/kernels/kvcache.md, session 50).
    if shares == 1 && by_keys >= 2 && 2 * pairs <= resident[1] {
        shares = 2;
    }
    match params.tuning.decode_kernel {
        Some(false) => None,
        Some(true) => Some(shares),
        None => {
            let one_wave = fits(shares);
            // Halved to fit the wave (batch 4 and 8 of the 1B shape): measured faster than the
            // forward kernel up to 1,024 keys with two shares or more, not over 2,048 keys or
            // on one share (docs/kernels/kvcache.md, session 44).
            let short = match shares == by_keys {
                true => s.capacity() <= DEFAULT_MAX_KEYS,
                false => s.capacity() <= HALVED_MAX_KEYS && shares >= 2,
            };
            (s.head_dim == 64 && short && one_wave).then_some(shares)
        }
    }
}

/// The append kernel's work (kernels/kvcache/append.cu) done inside the decode kernel, for a call
/// with at most one new key per sequence: `cache_seqlens` is read as it is (the key counts before
/// the new key), the new key and value written into the cache and attended to, q and the key
/// turned by the rotary tables, each sequence checked (a bad one reads as empty) with the error
/// bits ORed into `status` (0: none).
pub(super) struct FusedAppend<'a> {
    /// k_new, v_new (batch, 1, kv_heads, head_dim).
    pub new: Option<(&'a Tensor, &'a Tensor)>,
    /// cos, sin (positions, rotary_dim / 2) f32, contiguous; interleaved.
    pub rotary: Option<(&'a Tensor, &'a Tensor, bool)>,
    pub status: u64,
}

/// A (batch, 1, heads, head_dim) tensor whose token rows the kernel reads in place (each row's
/// heads contiguous, rows an even number of elements apart), or a contiguous copy; with its row
/// stride in elements.
fn token_rows(t: &Tensor) -> Result<(Tensor, i64)> {
    let (st, d) = (t.stride(), t.dim(3)?);
    if st[3] == 1 && st[2] == d && st[0] % 2 == 0 && t.layout().start_offset() % 2 == 0 {
        return Ok((t.clone(), st[0] as i64));
    }
    let t = t.contiguous()?;
    let rows = (t.dim(1)? * t.dim(2)? * d) as i64;
    Ok((t, rows))
}

/// Runs the decode kernel over `shares` key shares for the call `c` with (possibly turned) `q`;
/// `cache` has the key counts, cache rows and page table the forward kernel would read; `append`
/// the call's fused append, if it has one. Returns the output (batch, heads, head_dim) in q's
/// dtype and the LSE (batch, heads), f32.
pub(super) fn launch(
    c: &GpuCall,
    q: &Tensor,
    shares: usize,
    cache: &CacheLaunch,
    append: Option<&FusedAppend>,
) -> Result<(CudaStorage, CudaStorage)> {
    match q.dtype() {
        DType::BF16 => launch_t::<bf16>(c, q, shares, cache, append),
        DType::F16 => launch_t::<f16>(c, q, shares, cache, append),
        dt => bail!("flash-attn3: kvcache: the decode kernel takes bf16 and f16, got {dt:?}"),
    }
}

fn launch_t<T: CudaDType + DeviceRepr>(
    c: &GpuCall,
    q: &Tensor,
    shares: usize,
    cache: &CacheLaunch,
    append: Option<&FusedAppend>,
) -> Result<(CudaStorage, CudaStorage)> {
    let s = c.shape;
    let dev: CudaDevice = match q.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => bail!("flash-attn3: kvcache: expected a GPU call"),
    };
    let stream = dev.cuda_stream();
    let group = s.heads / s.kv_heads;
    let (name, func, threads) = kernel(&dev, s.head_dim, q.dtype(), group)?;
    let (q, q_batch_stride) = token_rows(q)?;
    let new = match append.and_then(|a| a.new) {
        Some((k, v)) => Some((token_rows(k)?, token_rows(v)?)),
        None => None,
    };
    let rotary = append.and_then(|a| a.rotary);
    let rows = s.batch * s.heads;
    // SAFETY: the kernel writes every element: each (sequence, kv head) cluster stores all of its
    // group's rows and their LSEs.
    let mut out = unsafe { dev.alloc::<T>(rows * s.head_dim)? };
    let mut lse = unsafe { dev.alloc::<f32>(rows)? };
    let (k, v) = (CacheStrides::of(c.k_cache), CacheStrides::of(c.v_cache));
    let scale = c.params.softmax_scale;
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    let (scale_log2, softcap_pre) = match c.params.softcap {
        Some(cap) => (cap * LOG2E, scale / cap),
        None => (scale * LOG2E, 0.0),
    };
    {
        let (out_addr, _out_sync) = out.device_ptr_mut(&stream);
        let (lse_addr, _lse_sync) = lse.device_ptr_mut(&stream);
        let p = DecodeParams {
            q: device_address(&q)?,
            k_cache: device_address(c.k_cache)?,
            v_cache: device_address(c.v_cache)?,
            seqused: cache.seqused_k,
            kv_batch_idx: cache.kv_batch_idx,
            page_table: cache.page_table,
            sinks: c.sinks.map_or(Ok(0), device_address)?,
            out: out_addr,
            lse: lse_addr,
            k_slot_stride: k.strides[0] as i64,
            k_row_stride: k.strides[1] as i64,
            k_head_stride: k.strides[2] as i64,
            v_slot_stride: v.strides[0] as i64,
            v_row_stride: v.strides[1] as i64,
            v_head_stride: v.strides[2] as i64,
            heads: s.heads as i32,
            group: group as i32,
            slots: s.slots as i32,
            rows: s.rows as i32,
            max_pages: cache.max_pages as i32,
            capacity: s.capacity() as i32,
            window_left: c.params.window_left.map_or(-1, |w| w.min(i32::MAX as usize) as i32),
            scale_log2,
            softcap_pre,
            k_new: new.as_ref().map_or(Ok(0), |((k, _), _)| device_address(k))?,
            v_new: new.as_ref().map_or(Ok(0), |(_, (v, _))| device_address(v))?,
            rotary_cos: rotary.map_or(Ok(0), |(cos, _, _)| device_address(cos))?,
            rotary_sin: rotary.map_or(Ok(0), |(_, sin, _)| device_address(sin))?,
            status: append.map_or(0, |a| a.status),
            q_batch_stride,
            k_new_batch_stride: new.as_ref().map_or(0, |((_, st), _)| *st),
            v_new_batch_stride: new.as_ref().map_or(0, |(_, (_, st))| *st),
            seqlen_new: new.is_some() as i32,
            checked: append.is_some() as i32,
            rotary_half: (s.rotary_dim / 2) as i32,
            rotary_interleaved: rotary.is_some_and(|r| r.2) as i32,
            positions: rotary.map_or(0, |(cos, _, _)| cos.dim(0).unwrap_or(0).min(i32::MAX as usize)) as i32,
        };
        let cfg = LaunchConfig {
            grid_dim: (shares as u32, s.kv_heads as u32, s.batch as u32),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem_bytes(s.head_dim, group) as u32,
        };
        // SAFETY: every address is a live buffer of the sizes in `p` (checked by
        // KvCacheAttn::check on the host; key counts are clamped to the capacity, and cache slots
        // and pages past the pool read as zeros in the kernel).
        unsafe { launch_with_attributes(&stream, &func, name, cfg, Some(shares as u32), false, &p) }?;
    }
    Ok((T::wrap_cuda_slice(out, dev.clone()), f32::wrap_cuda_slice(lse, dev)))
}

#[cfg(test)]
mod tests {
    use super::{plan, CacheStrides};
    use crate::kvcache::CacheShape;
    use crate::params::AttnParams;
    use crate::Tuning;
    use candle_core::DType;

    fn shape(batch: usize, seqlen_q: usize, heads: usize, kv_heads: usize, d: usize, rows: usize) -> CacheShape {
        CacheShape {
            batch,
            seqlen_q,
            total_q: batch * seqlen_q,
            varlen_q: false,
            seqlen_new: 0,
            heads,
            kv_heads,
            head_dim: d,
            head_dim_v: d,
            slots: batch,
            rows,
            paged: None,
            rotary_dim: 0,
        }
    }

    /// [`super::resident_ctas`] as an H200 (132 SMs) gives it: the kernels of one CTA per SM fit
    /// 30 clusters of 4 and 15 of 8 (120 CTAs); the 4-row d64 kernel, two per SM, twice that.
    fn h200(s: &CacheShape) -> [usize; 4] {
        match s.head_dim == 64 && s.heads / s.kv_heads <= 4 {
            true => [264, 264, 240, 240],
            false => [132, 132, 120, 120],
        }
    }

    fn contiguous(s: &CacheShape) -> CacheStrides {
        let d = s.head_dim;
        CacheStrides {
            strides: [s.rows * s.kv_heads * d, s.kv_heads * d, d, 1],
            start_offset: 0,
        }
    }

    /// Which calls take the decode kernel, and over how many shares (host logic only).
    #[test]
    fn single_query_short_caches_take_the_decode_kernel() {
        let params = |tuning: Tuning, num_splits: usize| AttnParams {
            softmax_scale: 0.125,
            window_left: None,
            window_right: Some(0),
            softcap: None,
            num_splits,
            tuning,
        };
        let auto = params(Tuning::default(), 0);
        const SMS: usize = 132;
        let take = |s: &CacheShape, p: &AttnParams, dtype: DType| {
            plan(s, p, dtype, false, (contiguous(s), contiguous(s)), SMS, h200(s))
        };
        // The 1B model's batch-1 step: d64, 32/8 heads, 640 keys: 8 shares.
        let s = shape(1, 1, 32, 8, 64, 640);
        assert_eq!(take(&s, &auto, DType::BF16), Some(8));
        assert_eq!(take(&s, &auto, DType::F16), Some(8));
        // Batch 2 (128 CTAs) takes it; batch 4 and 8 on fewer shares, one CTA per SM (4 and 2),
        // up to 1,024 keys; batch 16 (one share) not.
        assert_eq!(take(&shape(2, 1, 32, 8, 64, 640), &auto, DType::BF16), Some(8));
        assert_eq!(take(&shape(4, 1, 32, 8, 64, 640), &auto, DType::BF16), Some(4));
        assert_eq!(take(&shape(8, 1, 32, 8, 64, 1024), &auto, DType::BF16), Some(2));
        assert_eq!(take(&shape(8, 1, 32, 8, 64, 1025), &auto, DType::BF16), None);
        assert_eq!(take(&shape(4, 1, 32, 8, 64, 2048), &auto, DType::BF16), None);
        assert_eq!(take(&shape(2, 1, 32, 8, 64, 2048), &auto, DType::BF16), Some(8));
        assert_eq!(take(&shape(16, 1, 32, 8, 64, 640), &auto, DType::BF16), None);
        // With 4 kv heads (groups of 8: one CTA per SM), batch 4 on 4 shares: 16 clusters of 8 do
        // not run at once (15 do).
        assert_eq!(take(&shape(4, 1, 32, 4, 64, 640), &auto, DType::BF16), Some(4));
        let forced = params(
            Tuning {
                decode_kernel: Some(true),
                ..Default::default()
            },
            0,
        );
        assert_eq!(take(&shape(4, 1, 32, 8, 64, 640), &forced, DType::BF16), Some(4));
        assert_eq!(take(&shape(32, 1, 32, 8, 64, 640), &forced, DType::BF16), Some(1));
        // Where one CTA per SM leaves one share (batch 9-16 with 8 kv heads), two shares at two
        // CTAs per SM, for groups of up to 4 at head dim 64; not under the per-call choice.
        assert_eq!(take(&shape(16, 1, 32, 8, 64, 640), &forced, DType::BF16), Some(2));
        assert_eq!(take(&shape(9, 1, 32, 8, 64, 640), &forced, DType::BF16), Some(2));
        assert_eq!(take(&shape(17, 1, 32, 8, 64, 640), &forced, DType::BF16), Some(1));
        assert_eq!(take(&shape(16, 1, 64, 8, 64, 640), &forced, DType::BF16), Some(1));
        assert_eq!(take(&shape(16, 1, 32, 8, 64, 64), &forced, DType::BF16), Some(1));
        // A kernel of one CTA per SM (groups over 4 at d64) in clusters of 4 or 8: no more CTAs
        // than run at once (120 on an H200, not 132). Groups of 7, 14/2 heads (Qwen2.5-0.5B):
        // batch 4 on 8 shares (64 CTAs), batch 8 on 4 (64; 8 would be 128), batch 16 on 2 (64;
        // 4 would be 128), batch 32 on 2 (128 in clusters of 2, which fit).
        assert_eq!(take(&shape(4, 1, 14, 2, 64, 640), &auto, DType::BF16), Some(8));
        assert_eq!(take(&shape(8, 1, 14, 2, 64, 640), &auto, DType::BF16), Some(4));
        assert_eq!(take(&shape(16, 1, 14, 2, 64, 640), &forced, DType::BF16), Some(2));
        assert_eq!(take(&shape(32, 1, 14, 2, 64, 640), &forced, DType::BF16), Some(2));
        // The same counts with every cluster fitting (`resident` at the SM count): the old rule.
        let all_fit = |s: &CacheShape| {
            plan(
                s,
                &forced,
                DType::BF16,
                false,
                (contiguous(s), contiguous(s)),
                SMS,
                [SMS; 4],
            )
        };
        assert_eq!(all_fit(&shape(8, 1, 14, 2, 64, 640)), Some(8));
        assert_eq!(all_fit(&shape(16, 1, 14, 2, 64, 640)), Some(4));
        // A cache of 100 keys: at least 64 keys a share, two shares; 150 keys: three, rounded up
        // to a power of two.
        assert_eq!(take(&shape(1, 1, 32, 8, 64, 100), &auto, DType::BF16), Some(2));
        assert_eq!(take(&shape(1, 1, 32, 8, 64, 150), &auto, DType::BF16), Some(4));
        // Caches of more than 2,048 keys go to the forward kernel unless forced.
        assert_eq!(take(&shape(1, 1, 32, 8, 64, 2048), &auto, DType::BF16), Some(8));
        let long = shape(1, 1, 32, 8, 64, 2049);
        assert_eq!(take(&long, &auto, DType::BF16), None);
        assert_eq!(take(&long, &forced, DType::BF16), Some(8));
        // d128 only when forced.
        let d128 = shape(1, 1, 32, 4, 128, 640);
        assert_eq!(take(&d128, &auto, DType::BF16), None);
        assert_eq!(take(&d128, &forced, DType::BF16), Some(8));
        // Never, when asked; an explicit split; more than one query; fp8, f32; other head dims;
        // groups over 16.
        let never = params(
            Tuning {
                decode_kernel: Some(false),
                ..Default::default()
            },
            0,
        );
        assert_eq!(take(&s, &never, DType::BF16), None);
        assert_eq!(take(&s, &params(Tuning::default(), 3), DType::BF16), None);
        assert_eq!(take(&shape(1, 4, 32, 8, 64, 640), &auto, DType::BF16), None);
        assert_eq!(
            plan(
                &s,
                &auto,
                DType::F8E4M3,
                true,
                (contiguous(&s), contiguous(&s)),
                SMS,
                h200(&s)
            ),
            None
        );
        assert_eq!(take(&s, &auto, DType::F32), None);
        assert_eq!(take(&shape(1, 1, 32, 8, 96, 640), &auto, DType::BF16), None);
        assert_eq!(take(&shape(1, 1, 32, 1, 64, 640), &auto, DType::BF16), None);
        // Rows that do not start on 16 bytes.
        let odd = CacheStrides {
            strides: [640 * 8 * 64, 8 * 64, 64, 1],
            start_offset: 4,
        };
        assert_eq!(
            plan(&s, &auto, DType::BF16, false, (odd, contiguous(&s)), SMS, h200(&s)),
            None
        );
        let strided_d = CacheStrides {
            strides: [640 * 8 * 128, 8 * 128, 128, 2],
            start_offset: 0,
        };
        assert_eq!(
            plan(
                &s,
                &auto,
                DType::BF16,
                false,
                (contiguous(&s), strided_d),
                SMS,
                h200(&s)
            ),
            None
        );
    }
}
