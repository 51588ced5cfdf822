//! The GPU side of [`crate::kvcache`]: the append kernel (kernels/kvcache/append.cu), which
//! writes the new keys and values into the cache, turns them and q by the rotary embedding and
//! checks each sequence's cache rows or pages, then the attention over the cache: the forward
//! kernel (kernels/flash_fwd/, `FwdParams::seqused_k / kv_batch_idx / page_table`; launched to
//! overlap the append kernel, whose end its CTAs wait for after their set-up), or for
//! single-query calls over short 16-bit caches the decode kernel (decode.rs), which does the
//! append itself where a sequence gets at most one new key (one launch for the call).

use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::CudaDevice;
use candle_core::op::BackpropOp;
use candle_core::{bail, DType, Result, Shape, Storage, Tensor};

use super::{device_address, launch_with_params, load_kernel, tensor_map_nd, TmaDesc};
use crate::descale::Fp8Call;
use crate::kvcache::CacheShape;
use crate::params::AttnParams;

static CUBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kvcache_append.cubin"));

/// `fa3::kAppendThreads`.
const APPEND_THREADS: u32 = 256;

/// What the forward kernel needs to read K and V from a cache (device addresses, 0 for absent).
pub(crate) struct CacheLaunch {
    /// (batch) u32: the keys each sequence attends to.
    pub seqused_k: u64,
    /// (batch) u32: each sequence's row of a contiguous cache.
    pub kv_batch_idx: u64,
    /// (batch, max_pages) u32: a paged cache's page table.
    pub page_table: u64,
    pub max_pages: usize,
    /// Keys per page (paged caches).
    pub page_size: usize,
}

/// The TMA maps of a paged K or V cache for the `_pw` forward kernels, which store K and V tiles
/// in 8-row groups (kernels/flash_fwd/traits.cuh `kKVRowGroups`) so that one box holds a page's
/// rows with all their columns (load.cuh `issue_page_box`): one TMA issue per page where the
/// other kernels issue one per page and 64-column block. A 5-D map over the cache (num_pages,
/// page_size, kv_heads, head_dim): columns (a 128-byte column block), 8 rows, column block, 8-row
/// group, and last `page · page_units + kv head` in units of the head stride, since TMA's five
/// dimensions leave no room for the kv head and the page apart.
pub(super) struct PagedKvMaps {
    dtype: DType,
    addr: u64,
    /// Columns of the first dimension: the head dim, at most one column block (zeros past it).
    cols: usize,
    col_blocks: usize,
    row_stride: usize,
    head_stride: usize,
    groups: usize,
    box_groups: usize,
    units: usize,
    /// A page's stride in head strides.
    pub(super) page_units: usize,
}

/// Columns per column block of the `_pw` kernels (128-byte rows of 16-bit elements).
const PW_COL_ELEMS: usize = 64;

impl PagedKvMaps {
    /// The maps of a cache of `sizes` (page_size, kv_heads, num_pages) and element `strides` (row,
    /// head, page) for a kernel of head dim `kernel_head_dim`, read in boxes of `box_rows` rows;
    /// `None` where the layout has no such map: a head dim padded inside a column block past the
    /// first (TMA zero-fills only past a dimension's end), a page stride that is no multiple of
    /// the head stride or smaller than a page's heads (a page past the pool must fall outside the
    /// map), rows not in whole 8-row groups, or coordinates past i32.
    pub(super) fn new(
        dtype: DType,
        addr: u64,
        head_dim: usize,
        kernel_head_dim: usize,
        sizes: [usize; 3],
        strides: [usize; 3],
        box_rows: usize,
    ) -> Option<Self> {
        let [page_size, kv_heads, num_pages] = sizes;
        let [row_stride, head_stride, page_stride] = strides;
        let col_blocks = kernel_head_dim / PW_COL_ELEMS;
        let whole_columns = col_blocks == 1 || head_dim == kernel_head_dim;
        if !whole_columns || head_stride == 0 || page_size % 8 != 0 || box_rows % 8 != 0 || num_pages == 0 {
            return None;
        }
        if page_stride % head_stride != 0 || page_stride / head_stride < kv_heads {
            return None;
        }
        let page_units = page_stride / head_stride;
        let units = (num_pages - 1).checked_mul(page_units)?.checked_add(kv_heads)?;
        if units > i32::MAX as usize {
            return None;
        }
        Some(Self {
            dtype,
            addr,
            cols: head_dim.min(PW_COL_ELEMS),
            col_blocks,
            row_stride,
            head_stride,
            groups: page_size / 8,
            box_groups: box_rows / 8,
            units,
            page_units,
        })
    }

    pub(super) fn map(&self, name: &str) -> Result<TmaDesc> {
        tensor_map_nd(
            name,
            self.dtype,
            self.addr,
            self.cols,
            &[8, self.col_blocks, self.groups, self.units],
            &[self.row_stride, PW_COL_ELEMS, 8 * self.row_stride, self.head_stride],
            &[8, self.col_blocks as u32, self.box_groups as u32, 1],
            PW_COL_ELEMS as u32,
        )
    }
}

/// Mirror of `fa3::KvAppendParams` (kernels/kvcache/append.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct AppendParams {
    k_new: u64,
    v_new: u64,
    k_cache: u64,
    v_cache: u64,
    q: u64,
    q_rot: u64,
    cos: u64,
    sin: u64,
    cache_seqlens: u64,
    kv_batch_idx: u64,
    page_table: u64,
    seqused: u64,
    status: u64,
    k_slot_stride: i64,
    k_row_stride: i64,
    k_head_stride: i64,
    v_slot_stride: i64,
    v_row_stride: i64,
    v_head_stride: i64,
    k_new_strides: [i64; 2],
    v_new_strides: [i64; 2],
    batch: i32,
    seqlen_new: i32,
    seqlen_q: i32,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    head_dim_v: i32,
    slots: i32,
    rows: i32,
    max_pages: i32,
    rotary_half: i32,
    interleaved: i32,
    positions: i32,
    q_per_token: i32,
}

// SAFETY: a plain #[repr(C)] POD that matches the kernel's parameter struct byte for byte.
unsafe impl DeviceRepr for AppendParams {}

/// One GPU call: the tensors of a [`crate::kvcache::KvCacheAttn`] and their sizes, checked.
pub(crate) struct GpuCall<'a> {
    pub params: AttnParams,
    pub shape: &'a CacheShape,
    pub q: &'a Tensor,
    pub k_cache: &'a Tensor,
    pub v_cache: &'a Tensor,
    pub cache_seqlens: &'a Tensor,
    pub new: Option<(&'a Tensor, &'a Tensor)>,
    pub page_table: Option<&'a Tensor>,
    pub cache_batch_idx: Option<&'a Tensor>,
    /// cos, sin, interleaved.
    pub rotary: Option<(&'a Tensor, &'a Tensor, bool)>,
    pub status: Option<&'a Tensor>,
    /// Varlen queries: q packed (total_q, heads, d) at these offsets.
    pub varlen_q: Option<&'a crate::SeqOffsets>,
    /// (heads,) f32, contiguous.
    pub sinks: Option<&'a Tensor>,
    /// FP8 (e4m3) q and caches: their descales and the output dtype.
    pub fp8: Option<&'a Fp8Call>,
}

/// A tensor's CUDA storage, or an error naming it.
fn cuda_of<'s>(storage: &'s Storage, name: &str) -> Result<&'s candle_core::CudaStorage> {
    match storage {
        Storage::Cuda(cs) => Ok(cs),
        _ => bail!("flash-attn3: kvcache: {name} must be on the GPU"),
    }
}

/// The device address of a (small, contiguous) tensor's data; `name` for the error.
fn addr_of(t: &Tensor, name: &str) -> Result<u64> {
    device_address(t).map_err(|e| candle_core::Error::Msg(format!("flash-attn3: kvcache: {name}: {e}")))
}

/// The decode kernel's key shares for a call, if that kernel takes it ([`super::decode::plan`]).
fn decode_shares(
    s: &CacheShape,
    params: &AttnParams,
    dtype: DType,
    (k, v): (&Tensor, &Tensor),
    dev: &CudaDevice,
) -> Result<Option<usize>> {
    let sms = super::sm_count(dev)?;
    Ok(super::decode::plan(
        s,
        params,
        dtype,
        dtype == DType::F8E4M3,
        (super::decode::CacheStrides::of(k), super::decode::CacheStrides::of(v)),
        sms,
        super::decode::resident_ctas(dev, s, dtype, sms)?,
    ))
}

/// A call whose append the decode kernel does itself: it takes the call, and each sequence gets
/// at most one new key.
fn fuses_append(s: &CacheShape, decode_shares: Option<usize>) -> bool {
    decode_shares.is_some() && s.seqlen_new <= 1
}

/// [`crate::KvCacheAttn::appends_in_kernel`] on the GPU.
pub(crate) fn appends_in_kernel(
    s: &CacheShape,
    params: &AttnParams,
    dtype: DType,
    caches: (&Tensor, &Tensor),
    dev: &CudaDevice,
) -> Result<bool> {
    Ok(s.seqlen_new > 0 && fuses_append(s, decode_shares(s, params, dtype, caches, dev)?))
}

/// Appends, turns and checks (when the call asks for any of it), then attends.
pub(crate) fn forward(c: &GpuCall) -> Result<(Tensor, Tensor)> {
    let s = c.shape;
    let dtype = c.q.dtype();
    let kernel_name = match dtype {
        DType::BF16 => "kvcache_append_bf16",
        DType::F16 => "kvcache_append_f16",
        DType::F8E4M3 => "kvcache_append_e4m3",
        dt => bail!(
            "flash-attn3: kvcache: the GPU kernels take bf16, f16 and f8e4m3, got {dt:?}; run f32 calls on the CPU"
        ),
    };
    let dev: CudaDevice = match c.q.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => bail!("flash-attn3: kvcache: expected a GPU call"),
    };
    let stream = dev.cuda_stream();
    // The decode kernel, where it takes the call, reads q and the new rows in place and does the
    // append itself when each sequence gets at most one new key.
    let decode_shares = decode_shares(s, &c.params, dtype, (c.k_cache, c.v_cache), &dev)?;
    let fused_append = fuses_append(s, decode_shares);
    // The other kernels index these densely.
    let q = match fused_append {
        true => c.q.clone(),
        false => c.q.contiguous()?,
    };
    let contiguous_u32 = |t: Option<&Tensor>| t.map(|t| t.contiguous()).transpose();
    let cache_seqlens = c.cache_seqlens.contiguous()?;
    let page_table = contiguous_u32(c.page_table)?;
    let cache_batch_idx = contiguous_u32(c.cache_batch_idx)?;
    let rotary = match c.rotary {
        Some((cos, sin, interleaved)) => Some((
            cos.to_dtype(DType::F32)?.contiguous()?,
            sin.to_dtype(DType::F32)?.contiguous()?,
            interleaved,
        )),
        None => None,
    };
    // The new rows as they are where each token's heads are contiguous (flash-llama's views of
    // its fused projection; the append kernel takes their batch and token strides), else dense
    // copies.
    let heads_contiguous = |t: &Tensor| -> Result<Tensor> {
        let (st, d) = (t.stride(), t.dim(3)?);
        match st[3] == 1 && st[2] == d {
            true => Ok(t.clone()),
            false => t.contiguous(),
        }
    };
    let new = match (c.new, fused_append) {
        (Some((k, v)), false) => Some((heads_contiguous(k)?, heads_contiguous(v)?)),
        _ => None,
    };

    // The append kernel runs when the call appends, turns or asks for the status and the decode
    // kernel does not do it itself; it writes the key count each sequence attends to (0 for a
    // sequence with an error). Otherwise the attention reads cache_seqlens itself (clamped to the
    // cache; pages past the pool read as zeros).
    let asks_append = c.new.is_some() || rotary.is_some() || c.status.is_some();
    let run_append = asks_append && !fused_append;
    let mut seqused = match run_append {
        // SAFETY: the append kernel's block 0 of every sequence writes its entry.
        true => Some(unsafe { dev.alloc::<u32>(s.batch)? }),
        false => None,
    };
    let scratch_status = match (run_append, c.status) {
        // SAFETY: a word the append kernel ORs its error bits into and nobody reads.
        (true, None) => Some(unsafe { dev.alloc::<u32>(1)? }),
        _ => None,
    };
    let q_rot = match &rotary {
        Some(_) if run_append => {
            // SAFETY: the append kernel writes every element (one block per q token).
            let storage = unsafe { dev.alloc_uninit(q.shape(), dtype)? };
            Some(Tensor::from_storage(
                Storage::Cuda(storage),
                q.shape().clone(),
                BackpropOp::none(),
                false,
            ))
        }
        _ => None,
    };
    let addr = |t: Option<&Tensor>, name: &str| t.map_or(Ok(0), |t| addr_of(t, name));
    // The append kernel's launch, queued right before the attention's (below).
    let append_launch = if run_append {
        let (k_new, v_new) = match &new {
            Some((k, v)) => (Some(k), Some(v)),
            None => (None, None),
        };
        let status = match (c.status, &scratch_status) {
            (Some(t), _) => addr_of(t, "status")?,
            (None, Some(buf)) => buf.device_ptr(&stream).0,
            (None, None) => unreachable!("a status word exists whenever the append kernel runs"),
        };
        let seqused_addr = seqused.as_mut().map_or(0, |b| b.device_ptr_mut(&stream).0);
        let (ks, vs) = (c.k_cache.stride(), c.v_cache.stride());
        let new_strides = |t: Option<&Tensor>| t.map_or([0, 0], |t| [t.stride()[0] as i64, t.stride()[1] as i64]);
        let p = AppendParams {
            k_new: addr(k_new, "k_new")?,
            v_new: addr(v_new, "v_new")?,
            k_cache: addr_of(c.k_cache, "k_cache")?,
            v_cache: addr_of(c.v_cache, "v_cache")?,
            q: addr_of(&q, "q")?,
            q_rot: addr(q_rot.as_ref(), "q")?,
            cos: addr(rotary.as_ref().map(|r| &r.0), "rotary cos")?,
            sin: addr(rotary.as_ref().map(|r| &r.1), "rotary sin")?,
            cache_seqlens: addr_of(&cache_seqlens, "cache_seqlens")?,
            kv_batch_idx: addr(cache_batch_idx.as_ref(), "cache_batch_idx")?,
            page_table: addr(page_table.as_ref(), "page_table")?,
            seqused: seqused_addr,
            status,
            k_slot_stride: ks[0] as i64,
            k_row_stride: ks[1] as i64,
            k_head_stride: ks[2] as i64,
            v_slot_stride: vs[0] as i64,
            v_row_stride: vs[1] as i64,
            v_head_stride: vs[2] as i64,
            k_new_strides: new_strides(k_new),
            v_new_strides: new_strides(v_new),
            batch: s.batch as i32,
            seqlen_new: s.seqlen_new as i32,
            seqlen_q: s.seqlen_q as i32,
            heads: s.heads as i32,
            kv_heads: s.kv_heads as i32,
            head_dim: s.head_dim as i32,
            head_dim_v: s.head_dim_v as i32,
            slots: s.slots as i32,
            rows: s.rows as i32,
            max_pages: s.paged.unwrap_or(0) as i32,
            rotary_half: (s.rotary_dim / 2) as i32,
            interleaved: rotary.as_ref().is_some_and(|r| r.2) as i32,
            positions: rotary.as_ref().map_or(0, |r| r.0.dims()[0]) as i32,
            q_per_token: c.params.is_masked() as i32,
        };
        let blocks = 1 + s.seqlen_new + if rotary.is_some() { s.seqlen_q } else { 0 };
        if blocks > i32::MAX as usize || s.batch > 65535 {
            bail!("flash-attn3: kvcache: too many tokens or sequences for one append launch")
        }
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, s.batch as u32, 1),
            block_dim: (APPEND_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let func = load_kernel(&dev, CUBIN, " kvcache append", kernel_name, 0)?;
        Some((p, cfg, func))
    } else {
        None
    };
    let queue_append = || -> Result<()> {
        match &append_launch {
            // SAFETY: every address is a live buffer of the sizes in `p` (checked by
            // KvCacheAttn::check on the host; page indices, positions and cache rows are checked
            // by the kernel before use), alive until after the attention's launch.
            Some((p, cfg, func)) => unsafe { launch_with_params(&stream, func, kernel_name, *cfg, p) },
            None => Ok(()),
        }
    };

    // The attention over the cache.
    //
    // Varlen queries: q's offsets for q and k alike (the kernel takes each sequence's key count
    // from seqused_k and its keys from the cache, kernels/flash_fwd/scheduler.cuh get_tile), and
    // a contiguous cache's rows through kv_batch_idx (the identity unless the caller gave
    // cache_batch_idx: varlen calls have no batch coordinate of their own).
    let varlen = c.varlen_q.map(|cu| {
        let host: Vec<usize> = cu.as_slice().iter().map(|&x| x as usize).collect();
        crate::params::Varlen {
            seqlens_q: cu.tensor().clone(),
            seqlens_k: cu.tensor().clone(),
            cu_q: host.clone(),
            cu_k: host,
        }
    });
    let identity_rows = match (c.varlen_q, &cache_batch_idx, &page_table) {
        (Some(_), None, None) => Some(Tensor::arange(0u32, s.batch as u32, c.q.device())?),
        _ => None,
    };
    let dims = s.dims();
    let launch = CacheLaunch {
        seqused_k: match &seqused {
            Some(b) => b.device_ptr(&stream).0,
            None => addr_of(&cache_seqlens, "cache_seqlens")?,
        },
        kv_batch_idx: addr(cache_batch_idx.as_ref().or(identity_rows.as_ref()), "cache_batch_idx")?,
        page_table: addr(page_table.as_ref(), "page_table")?,
        max_pages: s.paged.unwrap_or(0),
        page_size: s.rows,
    };
    let q_attn = q_rot.as_ref().unwrap_or(&q);
    let (out, lse) = if let Some(shares) = decode_shares {
        let append = match fused_append && asks_append {
            true => Some(super::decode::FusedAppend {
                // (an append of no keys writes nothing)
                new: c.new.filter(|_| s.seqlen_new == 1),
                rotary: rotary.as_ref().map(|(cos, sin, i)| (cos, sin, *i)),
                status: addr(c.status, "status")?,
            }),
            false => None,
        };
        queue_append()?;
        super::decode::launch(c, q_attn, shares, &launch, append.as_ref())?
    } else {
        let (q_st, q_l) = q_attn.storage_and_layout();
        let (k_st, k_l) = c.k_cache.storage_and_layout();
        let (v_st, v_l) = c.v_cache.storage_and_layout();
        super::forward(
            &dims,
            c.params,
            varlen.as_ref(),
            (cuda_of(&q_st, "q")?, q_l),
            (cuda_of(&k_st, "k_cache")?, k_l),
            (cuda_of(&v_st, "v_cache")?, v_l),
            &super::FwdExtras {
                fp8: c.fp8,
                cache: Some(&launch),
                sinks: addr(c.sinks, "sinks")?,
                // The forward kernel overlaps the append kernel's run (a programmatic dependent
                // launch; it waits for it before its first read).
                before_launch: append_launch.as_ref().map(|_| &queue_append as &dyn Fn() -> Result<()>),
            },
        )?
    };
    // Freed in stream order after the kernels.
    drop((seqused, scratch_status));
    let (out_shape, lse_shape) = match s.varlen_q {
        false => (
            Shape::from((s.batch, s.seqlen_q, s.heads, s.head_dim_v)),
            Shape::from((s.batch, s.heads, s.seqlen_q)),
        ),
        true => (
            Shape::from((s.total_q, s.heads, s.head_dim_v)),
            Shape::from((s.heads, s.total_q)),
        ),
    };
    let out = Tensor::from_storage(Storage::Cuda(out), out_shape, BackpropOp::none(), false);
    let lse = Tensor::from_storage(Storage::Cuda(lse), lse_shape, BackpropOp::none(), false);
    Ok((out, lse))
}

#[cfg(test)]
mod tests {
    use super::PagedKvMaps;
    use candle_core::DType;

    /// Which paged caches get the `_pw` kernels' 5-D maps (host logic only: no map is encoded).
    #[test]
    fn paged_kv_maps_need_whole_columns_and_pages_apart() {
        let maps = |head_dim, kernel, sizes, strides, box_rows| {
            PagedKvMaps::new(DType::BF16, 0, head_dim, kernel, sizes, strides, box_rows)
        };
        // A contiguous pool (pages, 16, 4 kv heads, 128): a page is 16 rows of 4 heads.
        let m = maps(128, 128, [16, 4, 100], [512, 128, 16 * 512], 16).expect("contiguous pool");
        assert_eq!((m.page_units, m.units, m.col_blocks, m.cols), (64, 99 * 64 + 4, 2, 64));
        // flash-llama's layout: k and v heads interleaved in one pool (a view of every other 4 heads).
        let m = maps(128, 128, [16, 4, 10], [1024, 128, 16 * 1024], 16).expect("strided views");
        assert_eq!(m.page_units, 128);
        // d64 kernel, head dim 48: one column block, zero-filled past column 48.
        let m = maps(48, 64, [32, 2, 10], [96, 48, 32 * 96], 32).expect("d48");
        assert_eq!((m.cols, m.col_blocks, m.groups, m.box_groups), (48, 1, 4, 4));
        // d112 on the d128 kernel: the second column block would read past the head's columns.
        assert!(maps(112, 128, [16, 4, 10], [448, 112, 16 * 448], 16).is_none());
        // A page stride that is no multiple of the head stride, or smaller than a page's heads.
        assert!(maps(128, 128, [16, 4, 10], [512, 128, 16 * 512 + 64], 16).is_none());
        assert!(maps(128, 128, [16, 4, 10], [512, 128, 2 * 128], 16).is_none());
        // Coordinates past i32.
        assert!(maps(128, 128, [16, 4, 1 << 26], [512, 128, 16 * 512], 16).is_none());
        // No pages.
        assert!(maps(128, 128, [16, 4, 0], [512, 128, 16 * 512], 16).is_none());
    }
}
