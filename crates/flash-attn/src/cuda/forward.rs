//! The forward launch (kernels/flash_fwd/, the forward cubin): the kernel's parameters, which
//! instantiation runs a call (`Variant`), the split-KV share count and partials, and the combine
//! that merges them. The fp8 pieces (V transpose pre-pass, descales) are in fp8.rs, a KV cache's
//! append in kvcache.rs; the shared plumbing (kernel loading, TMA maps, addresses) in mod.rs.

use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::{bail, CudaStorage, DType, Layout, Result};
use half::{bf16, f16};

use super::{
    attention_smem, bind_context, check_tma_head_dims, ctas_per_sm, device_addr, fp8, gcd, geometry, input_ptr,
    is_capturing, kernel, kvcache, launch_with_attributes, launch_with_params, max_active_clusters, offsets_addr,
    optional_ptr_mut, sm_count, tensor_map_nd, tile_counter, TmaDesc, WG_ROWS,
};
use crate::descale::Fp8Call;
use crate::params::{l2_section_pairs, split_count, tiles_fill, AttnParams, Dims, FastDiv, Varlen};

/// Mirror of `fa3::FwdParams` (kernels/flash_fwd/params.cuh), field for field.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct FwdParams {
    tma_q: TmaDesc,
    tma_k: TmaDesc,
    tma_v: TmaDesc,
    tma_o: TmaDesc,
    tma_v_rows: TmaDesc,
    out: u64,
    lse: u64,
    cu_q: u64,
    cu_k: u64,
    tile_counter: u64,
    out_row_stride: i64,
    lse_head_stride: i64,
    lse_batch_stride: i64,
    seqlen_q: i32,
    seqlen_k: i32,
    heads: i32,
    group: FastDiv,
    head_dim_v: i32,
    window_left: i32,
    window_right: i32,
    scale_log2: f32,
    softcap_pre: f32,
    negate: i32,
    num_m_blocks: FastDiv,
    batch: i32,
    direct_store: i32,
    pack_gqa: i32,
    tile_heads: FastDiv,
    q_tile_queries: i32,
    q_tile_bytes: u32,
    num_splits: FastDiv,
    l2_section: FastDiv,
    l2_last_section: FastDiv,
    l2_section_tiles: FastDiv,
    l2_full_sections: i32,
    total_q: i32,
    o_accum: u64,
    lse_accum: u64,
    q_descale: u64,
    k_descale: u64,
    v_descale: u64,
    q_descale_blocks: i32,
    k_descale_blocks: i32,
    q_descale_batch_stride: i32,
    k_descale_batch_stride: i32,
    v_descale_batch_stride: i32,
    q_descale_per_kv_head: i32,
    out_f16: i32,
    seqused_k: u64,
    kv_batch_idx: u64,
    page_table: u64,
    max_pages: i32,
    page_size: FastDiv,
    page_box_rows: i32,
    sinks: u64,
    solo_consumer: i32,
    cluster_combine: i32,
    page_units: i32,
    vt_src: fp8::PrepassParams,
    vt_done: u64,
    vt_units_per_pair: i32,
    vt_pairs: i32,
}

/// A small-page call on a `_pw` kernel: the kernel and its K / V maps of one box per page
/// (`kvcache::PagedKvMaps`), with the page stride in head strides that the kernel's box
/// coordinates need (`fa3::FwdParams::page_units`).
struct PageWarpLaunch {
    name: &'static str,
    tma_k: TmaDesc,
    tma_v: TmaDesc,
    page_units: usize,
}

/// The most key shares merged in one thread-block cluster (`fa3::kClusterMaxShares`): the
/// portable cluster size.
const MAX_CLUSTER_SHARES: usize = 8;

/// The most rows of a tile whose shares merge in a cluster: single-query decode with GQA groups
/// up to 16 (at 32 rows the merge measured slower than the combine kernel).
const MAX_CLUSTER_ROWS: usize = 16;

/// Mirror of `fa3::CombineParams` (kernels/flash_fwd/params.cuh).
#[repr(C)]
#[derive(Clone, Copy)]
struct CombineParams {
    o_accum: u64,
    lse_accum: u64,
    out: u64,
    lse: u64,
    num_splits: i32,
    total_q: i32,
    heads: i32,
    head_dim_v: i32,
    seqlen_q: i32,
    varlen: i32,
    lse_head_stride: i64,
    lse_batch_stride: i64,
    sinks: u64,
    warps_per_row: i32,
}

// SAFETY: a plain #[repr(C)] POD that matches the kernel's parameter struct byte for byte.
unsafe impl DeviceRepr for CombineParams {}

/// Warps of the combine kernel's 256-thread blocks (`fa3::kCombineWarps`).
const COMBINE_WARPS: usize = 8;

/// Warps that share one row of the combine (`CombineParams::warps_per_row`): enough that each
/// reads at most 4 splits (`fa3::kCombineInFlight`, loads in flight at once), a power of two up
/// to the block's 8.
fn combine_warps_per_row(splits: usize) -> usize {
    splits.div_ceil(4).next_power_of_two().clamp(1, COMBINE_WARPS)
}

// SAFETY: a plain #[repr(C)] POD that matches the kernel's parameter struct byte for byte.
unsafe impl DeviceRepr for FwdParams {}

/// One compiled instantiation: padded head dim, keys per pipeline stage, consumer warpgroups,
/// e4m3 inputs or 16-bit.
#[derive(Clone, Copy)]
struct Variant {
    head_dim: usize,
    block_n: usize,
    consumer_wgs: usize,
    fp8: bool,
    /// fp8 over a KV cache: V transposed in shared memory by the kernel, not by the pre-pass
    /// (kernels/flash_fwd/transpose_v.cuh).
    transpose_v: bool,
}

/// Kernels compiled beside the default instantiations for one kind of call: compiled into the
/// default kernels, their code made those kernels' other calls slower, so they have their own
/// (`Variant::own_kernel_name`).
#[derive(Clone, Copy)]
enum OwnKernel {
    /// Split-KV shares merged in a thread-block cluster (`fa3::FwdTraits::kClusterCombine`, the
    /// `_cm` kernels).
    ClusterMerge,
    /// A small-page cache's page indices looked up by the page warp (`fa3::FwdTraits::kPageWarp`,
    /// the `_pw` kernels).
    PageWarp,
    /// The other way round: fp8 calls without pack-GQA, varlen, split-KV, softcap, direct stores,
    /// per-block descales or a cache, on kernels with those paths compiled out
    /// (`fa3::FwdTraits::kPlain`, kernels/flash_fwd/options.cuh, the `_plain` kernels). With
    /// them, the fp8 kernels had 2-2.5x the SASS and spilled; without, H200, same calls
    /// (docs/kernels/forward-fp8.md, version 19): +8-13% at 512 tokens, +1-5% at 2k, 0-4% from
    /// 4k.
    Plain,
}

impl Variant {
    /// Head dims round up to the next instantiation; TMA zero-fills the padding columns.
    /// `uneven`: a causal/windowed/varlen call (tiles of unequal work). d64 runs on 192-row tiles
    /// except for uneven calls whose longest query sequence is under 4096, where the coarser
    /// tiles cost more in masked rows and balance than they gain (measured, causal: -8% at 512,
    /// -2..-20% at 1k-2k, +6% at 8k; unmasked +4..+13% everywhere; docs/kernels/forward-sm90.md,
    /// version 9).
    /// `d64_rows`: [`crate::Tuning::d64_tile_rows`].
    fn pick(
        head_dim: usize,
        head_dim_v: usize,
        uneven: bool,
        seqlen_q: usize,
        d64_rows: Option<usize>,
    ) -> Result<Self> {
        check_tma_head_dims("kernel", head_dim, head_dim_v)?;
        Ok(match head_dim.max(head_dim_v) {
            0..=64 => Self {
                head_dim: 64,
                block_n: 128,
                consumer_wgs: d64_consumer_wgs(uneven, seqlen_q, d64_rows, D64_UNEVEN_MIN),
                fp8: false,
                transpose_v: false,
            },
            // Native d96 (64-byte swizzled tiles), 128 x 128 like d128.
            65..=96 => Self {
                head_dim: 96,
                block_n: 128,
                consumer_wgs: 2,
                fp8: false,
                transpose_v: false,
            },
            97..=128 => Self {
                head_dim: 128,
                block_n: 128,
                consumer_wgs: 2,
                fp8: false,
                transpose_v: false,
            },
            // FA3's d192 tile: 112-key blocks (one Q buffer, O stored from registers: 218 KiB).
            129..=192 => Self {
                head_dim: 192,
                block_n: 112,
                consumer_wgs: 2,
                fp8: false,
                transpose_v: false,
            },
            193..=256 => Self {
                head_dim: 256,
                block_n: 80,
                consumer_wgs: 2,
                fp8: false,
                transpose_v: false,
            },
            d => bail!("flash-attn3: the GPU kernel supports head dims up to 256, got {d}"),
        })
    }

    /// The fp8 kernels: d64, d128 and d256 (96 and 192 run on the next one up, TMA zero-filling
    /// the columns), 128-key blocks (256 at d128: `fp8::block_n`), two consumer warpgroups (three
    /// for d64 where `pick` uses three; one for d64 decode over a KV cache, below).
    /// `tile_rows`: a sequence's query rows in a tile.
    #[allow(clippy::too_many_arguments)]
    fn pick_fp8(
        head_dim: usize,
        head_dim_v: usize,
        uneven: bool,
        seqlen_q: usize,
        seqlen_k: usize,
        tile_rows: usize,
        tuning: &crate::Tuning,
        transpose_v: bool,
    ) -> Result<Self> {
        let head_dim = match head_dim.max(head_dim_v) {
            0..=64 => 64,
            65..=128 => 128,
            129..=256 => 256,
            d => bail!("flash-attn3: the GPU kernel supports head dims up to 256, got {d}"),
        };
        // d64 on 192-row tiles (three consumer warpgroups) as for 16 bits, but for uneven calls
        // from 2k queries instead of 4k (FP8_D64_UNEVEN_MIN). Session 14: +6..+11% unmasked from
        // 2k, +2..+7% causal from 4k, -10% causal at 512 and 1k (same call).
        Ok(Self {
            head_dim,
            block_n: fp8::block_n(head_dim, transpose_v, uneven, seqlen_k, tuning.fp8_d128_block_n),
            consumer_wgs: match head_dim {
                64 if !transpose_v => d64_consumer_wgs(uneven, seqlen_q, tuning.d64_tile_rows, FP8_D64_UNEVEN_MIN),
                // d64 decode over an fp8 cache (a sequence's query rows within one warpgroup's
                // 64): `flash_fwd_d64x1_e4m3_tv`, one consumer warpgroup, two CTAs per SM. The
                // two-warpgroup kernel reads K and V there at about half a 16-bit call's
                // bandwidth, held by each key block's chain of dependent steps, not by HBM; two
                // CTAs per SM run two chains. H200, same call (docs/kernels/kvcache.md, session
                // 38): 0.78-0.84x the time from batch 8, 0.91x graph-replayed at batch 1 over 8k
                // keys. (16-bit d64 decode on such a kernel measured 1.01-1.13x slower from batch
                // 8: it already reads at the copy bandwidth.) `Tuning::decode_one_cta_per_sm`: off.
                64 if transpose_v && tile_rows <= WG_ROWS && !tuning.decode_one_cta_per_sm => 1,
                _ => 2,
            },
            fp8: true,
            transpose_v,
        })
    }

    /// The same on one consumer warpgroup at two CTAs per SM (16-bit decode tiles,
    /// `decode_on_one_warpgroup`): d128 on 64-key blocks, so that two CTAs fit an SM's shared
    /// memory (one Q buffer, `fa3::FwdTraits::kQStages`; the sizes: kernels/smem_table.cpp).
    fn on_one_warpgroup(self) -> Self {
        Self {
            consumer_wgs: 1,
            block_n: if self.head_dim == 128 { 64 } else { self.block_n },
            ..self
        }
    }

    /// The instantiation's name in kernels/flash_fwd/kernel.cu.
    fn kernel_name(&self, dtype: DType) -> &'static str {
        if self.consumer_wgs == 1 {
            return match (self.fp8, dtype == DType::BF16) {
                (true, _) => "flash_fwd_d64x1_e4m3_tv", // fp8 d64 decode (`pick_fp8`)
                (false, true) if self.head_dim == 128 => "flash_fwd_d128x1_bf16",
                (false, false) if self.head_dim == 128 => "flash_fwd_d128x1_f16",
                (false, true) => "flash_fwd_d64x1_bf16",
                (false, false) => "flash_fwd_d64x1_f16",
            };
        }
        if self.transpose_v {
            return match self.head_dim {
                64 => "flash_fwd_d64_e4m3_tv",
                128 => "flash_fwd_d128_e4m3_tv",
                _ => "flash_fwd_d256_e4m3_tv",
            };
        }
        if self.fp8 {
            return match self.head_dim {
                64 if self.consumer_wgs == 3 => "flash_fwd_d64x3_e4m3",
                64 => "flash_fwd_d64_e4m3",
                128 if self.block_n == 256 => "flash_fwd_d128_n256_e4m3",
                128 => "flash_fwd_d128_e4m3",
                _ => "flash_fwd_d256_e4m3",
            };
        }
        let bf16 = dtype == DType::BF16;
        if self.consumer_wgs == 3 {
            return if bf16 {
                "flash_fwd_d64x3_bf16"
            } else {
                "flash_fwd_d64x3_f16"
            };
        }
        match (self.head_dim, bf16) {
            (64, true) => "flash_fwd_d64_bf16",
            (96, true) => "flash_fwd_d96_bf16",
            (128, true) => "flash_fwd_d128_bf16",
            (192, true) => "flash_fwd_d192_bf16",
            (_, true) => "flash_fwd_d256_bf16",
            (64, false) => "flash_fwd_d64_f16",
            (96, false) => "flash_fwd_d96_f16",
            (128, false) => "flash_fwd_d128_f16",
            (192, false) => "flash_fwd_d192_f16",
            (_, false) => "flash_fwd_d256_f16",
        }
    }

    /// Columns per shared-memory column block (and TMA box): 64 (128-byte swizzle), or 32 (64-byte
    /// swizzle) for head dim 96, which is no multiple of 64 (`fa3::FwdTraits::kColElems`).
    fn col_elems(&self) -> u32 {
        if self.fp8 {
            // 128-byte rows, or 64-byte rows (64B swizzle) for d64.
            return if self.head_dim % 128 == 0 { 128 } else { 64 };
        }
        if self.head_dim % 64 == 0 {
            64
        } else {
            32
        }
    }

    /// This variant's instantiation of a kind of its own ([`OwnKernel`]), if there is one: 16
    /// bits, two consumer warpgroups, head dims 64 and 128 (plain: every fp8 kernel that serves
    /// no cache). Same shared-memory layout.
    fn own_kernel_name(&self, dtype: DType, kind: OwnKernel) -> Option<&'static str> {
        // d64 bf16, d128 bf16, d64 f16, d128 f16 (kernels/flash_fwd/kernel.cu).
        let names = match kind {
            OwnKernel::Plain => return self.plain_kernel_name(),
            _ if self.fp8 || self.consumer_wgs != 2 => return None,
            OwnKernel::ClusterMerge => [
                "flash_fwd_d64_bf16_cm",
                "flash_fwd_d128_bf16_cm",
                "flash_fwd_d64_f16_cm",
                "flash_fwd_d128_f16_cm",
            ],
            OwnKernel::PageWarp => [
                "flash_fwd_d64_bf16_pw",
                "flash_fwd_d128_bf16_pw",
                "flash_fwd_d64_f16_pw",
                "flash_fwd_d128_f16_pw",
            ],
        };
        let head_dim = match self.head_dim {
            64 => 0,
            128 => 1,
            _ => return None,
        };
        Some(names[head_dim + if dtype == DType::BF16 { 0 } else { 2 }])
    }

    /// The fp8 kernel's `_plain` twin ([`OwnKernel::Plain`]); none for the `_tv` kernels (KV-cache
    /// calls) and the 16-bit ones.
    fn plain_kernel_name(&self) -> Option<&'static str> {
        if !self.fp8 || self.transpose_v {
            return None;
        }
        Some(match self.head_dim {
            64 if self.consumer_wgs == 3 => "flash_fwd_d64x3_e4m3_plain",
            64 => "flash_fwd_d64_e4m3_plain",
            128 if self.block_n == 256 => "flash_fwd_d128_n256_e4m3_plain",
            128 => "flash_fwd_d128_e4m3_plain",
            _ => "flash_fwd_d256_e4m3_plain",
        })
    }

    /// Query rows per tile: 64 per consumer warpgroup.
    fn block_m(&self) -> usize {
        WG_ROWS * self.consumer_wgs
    }

    /// Threads per CTA: the producer warpgroup and the consumers.
    fn threads(&self) -> u32 {
        128 * (1 + self.consumer_wgs as u32)
    }
}

/// 16-bit decode over a KV cache (each tile's rows within one warpgroup's 64; `tiles` of them, one
/// a (sequence, kv head) with pack-GQA; `seqlen_k` the keys a sequence's cache holds, as for the
/// split rule): whether the one-warpgroup kernel at two CTAs per SM
/// (`flash_fwd_d64x1_*`, `flash_fwd_d128x1_*` on 64-key blocks) takes it instead of the
/// two-warpgroup kernel, whose second warpgroup has no rows there. H200, graph-replayed, against
/// the two-warpgroup kernels (docs/kernels/kvcache.md, session 52):
/// - d64, where the tiles fill both CTA slots of most SMs without a split (`tiles_fill` at two
///   per SM): short caches 0.73-0.96x at 640-1,024 keys, ~1.0 at 2,048, 1.05-1.16x at 8,192
///   (so not there); small pages (which it loads the plain way, not with the page warp) 0.72-0.80x
///   from batch 32; and small pages at batch 1-16 from 2,048 keys 0.79-0.96x (its shares then merge
///   in the combine kernel, which at 640 keys cost more than the warpgroup saves).
/// - d128 (two CTAs fit only with 64-key blocks): small pages over up to 2,048 keys where the tiles
///   fill both slots, 0.93-0.95x (batch 128, pages of 16, 1,024 keys: 1.03-1.04x the contiguous
///   call instead of 1.09-1.10x); contiguous and split calls measured 1.0-1.24x, so not there.
fn decode_on_one_warpgroup(head_dim: usize, tiles: usize, sms: usize, small_pages: bool, seqlen_k: usize) -> bool {
    let fills_without_split = tiles_fill(tiles, 2 * sms);
    match head_dim {
        64 => (fills_without_split && (small_pages || seqlen_k <= 2048)) || (small_pages && seqlen_k >= 2048),
        128 => fills_without_split && small_pages && seqlen_k <= 2048,
        _ => false,
    }
}

/// Consumer warpgroups of the d64 kernels: 3 (192-row tiles) except for uneven calls whose
/// longest query sequence is under `uneven_min` ([`D64_UNEVEN_MIN`] for 16 bits,
/// [`FP8_D64_UNEVEN_MIN`] for fp8), or as [`crate::Tuning::d64_tile_rows`] says.
fn d64_consumer_wgs(uneven: bool, seqlen_q: usize, rows: Option<usize>, uneven_min: usize) -> usize {
    match rows {
        Some(rows) => rows / WG_ROWS,
        None if uneven && seqlen_q < uneven_min => 2,
        None => 3,
    }
}

/// The 16-bit d64 kernels' threshold for uneven calls: below it their coarser tiles cost more in
/// masked rows and balance than they gain ([`Variant::pick`]).
const D64_UNEVEN_MIN: usize = 4096;

/// The fp8 d64 kernels' threshold for uneven calls: since the 192-row kernel took the lazy running
/// max (docs/kernels/forward-fp8.md, version 6) it is the faster one from 2k queries, causal 345
/// against 322 TFLOP/s at 2k (the 128-row kernel with every 8th exponential on the FMA pipe); at 1k
/// 236 against 238 (H200, session 50).
const FP8_D64_UNEVEN_MIN: usize = 2048;

/// Whether the q heads of a kv head share one tile (pack-GQA): for decode-like calls (at most 64
/// queries per sequence), where one tile per q head would hold a handful of rows and every q head
/// would stream the same K/V again; `forced`: [`crate::Tuning::pack_gqa`].
fn pack_gqa(group: usize, seqlen_q: usize, forced: Option<bool>) -> bool {
    (2..=64).contains(&group) && forced.unwrap_or(seqlen_q <= 64)
}

/// FA3_TRACE=1 in the environment: print CTA 0's timeline after each forward launch (needs a
/// build with FA3_NVCC_FLAGS=-DFA3_TRACE; kernels/primitives/trace.cuh, scripts/trace_timeline.py),
/// or with `-DFA3_TRACE -DFA3_TRACE_CTA` every CTA's first tile summarised every 64th launch.
fn trace_requested() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("FA3_TRACE").is_some_and(|v| v != "0"))
}

fn dump_trace(dev: &CudaDevice) -> Result<()> {
    let func = kernel(dev, "fa3_trace_dump", 0).map_err(|e| {
        candle_core::Error::Msg(format!(
            "FA3_TRACE is set but the kernels were built without -DFA3_TRACE ({e})"
        ))
    })?;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    };
    // The launch's number (the per-CTA trace prints every 64th launch).
    static LAUNCHES: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);
    let launch = LAUNCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // SAFETY: the dump kernel reads only its own module's trace buffers.
    unsafe { launch_with_params(&dev.cuda_stream(), &func, "fa3_trace_dump", cfg, &launch) }
}

/// Launches the split-KV combine over `rows` (token, head) rows (kernels/flash_fwd/combine.cuh).
fn combine_splits(dev: &CudaDevice, dtype: DType, p: &CombineParams, rows: usize) -> Result<()> {
    let rows_per_block = COMBINE_WARPS / p.warps_per_row as usize;
    let name = if dtype == DType::BF16 {
        "flash_fwd_combine_bf16"
    } else {
        "flash_fwd_combine_f16"
    };
    let func = kernel(dev, name, 0)?;
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(rows_per_block) as u32, 1, 1),
        block_dim: (32 * COMBINE_WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the params point at the partials, out and lse, all alive until the caller drops
    // them after this launch is queued (in stream order).
    unsafe { launch_with_params(&dev.cuda_stream(), &func, name, cfg, p) }
}

/// What a forward launch takes beyond q, k, v and the options: the descales and output dtype of
/// e4m3 inputs, a KV cache's indices (kvcache.rs: k and v are then the caches), the attention
/// sinks, and a kernel to queue just before the forward's.
#[derive(Default)]
pub(crate) struct FwdExtras<'a> {
    pub fp8: Option<&'a Fp8Call>,
    pub cache: Option<&'a kvcache::CacheLaunch>,
    /// Device address of the (heads,) f32 sink logits, 0 for none.
    pub sinks: u64,
    /// Queues a kernel whose output the forward reads (the KV cache's append kernel), after the
    /// forward's buffers are allocated and right before its launch, which then overlaps it (a
    /// programmatic dependent launch: the forward's CTAs set up while that kernel runs and wait
    /// for it before their first read, kernels/flash_fwd/kernel.cu). Nothing else may be queued
    /// in between: in a CUDA-graph capture an allocation there would cut the programmatic edge.
    /// (An fp8 call whose V goes through the pre-pass queues it before the pre-pass instead,
    /// without the overlap.)
    pub before_launch: Option<&'a dyn Fn() -> Result<()>>,
}

/// Runs the forward on the GPU; returns the output and the LSE.
pub(crate) fn forward(
    dims: &Dims,
    params: AttnParams,
    varlen: Option<&Varlen>,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    extras: &FwdExtras,
) -> Result<(CudaStorage, CudaStorage)> {
    match (q.0.dtype(), extras.fp8.map(|f| f.out_dtype)) {
        (DType::BF16, None) | (DType::F8E4M3, Some(DType::BF16)) => {
            forward_t::<bf16>(dims, params, varlen, q, k, v, extras)
        }
        (DType::F16, None) | (DType::F8E4M3, Some(DType::F16)) => {
            forward_t::<f16>(dims, params, varlen, q, k, v, extras)
        }
        (dt, _) => bail!("flash-attn3: the GPU kernel supports bf16, f16 and f8e4m3, got {dt:?}; convert with .to_dtype(DType::BF16) or run on the CPU"),
    }
}

/// The forward launch; `T` is the output's element type (the inputs' for 16-bit calls, bf16 or
/// f16 for fp8 calls). With a cache, k and v are the KV caches and `dims.seqlen_k` the keys one
/// sequence's cache holds.
fn forward_t<T: CudaDType + DeviceRepr>(
    dims: &Dims,
    params: AttnParams,
    varlen: Option<&Varlen>,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    extras: &FwdExtras,
) -> Result<(CudaStorage, CudaStorage)> {
    let (fp8, cache) = (extras.fp8, extras.cache);
    let dtype = q.0.dtype();
    let out_dtype = fp8.map_or(dtype, |f| f.out_dtype);
    let dev = q.0.device.clone();
    if !(k.0.device.id() == dev.id() && v.0.device.id() == dev.id()) {
        bail!("flash-attn3: q, k and v must be on the same GPU")
    }
    bind_context(&dev)?;
    // KV cache calls have a key count per sequence: uneven tiles.
    let uneven = varlen.is_some() || cache.is_some() || params.is_masked();
    let group = dims.group();
    // FP8: a packed tile holds a whole GQA group, so its q heads must share one descale.
    let tuning = params.tuning;
    let pack_gqa = pack_gqa(group, dims.seqlen_q, tuning.pack_gqa) && fp8.is_none_or(|f| f.q_shared_by_group());
    let rows = tuning.d64_tile_rows;
    // The query rows of one sequence in a tile (decode: one tile of seqlen_q x group packed rows).
    let tile_rows = if pack_gqa { dims.seqlen_q * group } else { dims.seqlen_q };
    let mut variant = match fp8 {
        Some(_) => Variant::pick_fp8(
            dims.head_dim,
            dims.head_dim_v,
            uneven || pack_gqa,
            dims.seqlen_q,
            dims.seqlen_k,
            tile_rows,
            &tuning,
            cache.is_some(),
        )?,
        None => Variant::pick(dims.head_dim, dims.head_dim_v, uneven || pack_gqa, dims.seqlen_q, rows)?,
    };
    // Only the fp8 kernels that transpose V tiles themselves compile the KV-cache paths (page
    // table, key counts, cache rows; `FwdTraits::kServesCache`): the others would ignore them.
    if variant.fp8 && cache.is_some() && !variant.transpose_v {
        bail!("flash-attn3: internal error: an fp8 KV-cache call picked a kernel without the cache paths")
    }
    // 16-bit decode tiles (a sequence's rows within one warpgroup's 64) on one consumer warpgroup
    // at two CTAs per SM where that measured faster (`decode_on_one_warpgroup`).
    let sms = sm_count(&dev)?;
    let tile_heads = if pack_gqa { dims.kv_heads } else { dims.heads };
    if let Some(c) = cache.filter(|_| !variant.fp8 && tile_rows <= WG_ROWS && !tuning.decode_one_cta_per_sm) {
        let tiles = dims.batch * tile_heads; // one query tile each: the rows fit one warpgroup
        let small_pages = c.page_table != 0 && c.page_size < 64;
        if decode_on_one_warpgroup(variant.head_dim, tiles, sms, small_pages, dims.seqlen_k) {
            variant = variant.on_one_warpgroup();
        }
    }
    let elem_bytes = if variant.fp8 { 1 } else { 2 };
    let stream = dev.cuda_stream();

    let (q_addr, _q_sync) = input_ptr(q.0, q.1, &stream)?;
    let (k_addr, _k_sync) = input_ptr(k.0, k.1, &stream)?;
    let (v_addr, _v_sync) = input_ptr(v.0, v.1, &stream)?;
    let (q_sizes, q_strides) = geometry(q.1);
    let (k_sizes, k_strides) = geometry(k.1);
    let (v_sizes, v_strides) = geometry(v.1);
    // Pack-GQA: a tile holds q_tile_queries queries x the group's q heads (row = token * group +
    // head in group), loaded as boxes of (64, group, q_tile_queries) from a 5-D view of q:
    // (head_dim, q head in group, token, kv head, batch).
    let block_m = variant.block_m();
    let q_tile_queries = if pack_gqa { block_m / group } else { block_m };
    // Maps in the kernel's column-block width (64 columns, or 32 for head dim 96).
    let cols = variant.col_elems();
    let map = |name: &str, addr: u64, d: usize, sizes: [usize; 3], strides: [usize; 3], rows: usize| {
        tensor_map_nd(name, dtype, addr, d, &sizes, &strides, &[rows as u32, 1, 1], cols)
    };
    let tma_q = if pack_gqa {
        let [tokens, _, batch] = q_sizes;
        let [token_stride, head_stride, batch_stride] = q_strides;
        tensor_map_nd(
            "q",
            dtype,
            q_addr,
            dims.head_dim,
            &[group, tokens, dims.kv_heads, batch],
            &[head_stride, token_stride, group * head_stride, batch_stride],
            &[group as u32, q_tile_queries as u32, 1, 1],
            cols,
        )?
    } else {
        map("q", q_addr, dims.head_dim, q_sizes, q_strides, block_m)?
    };
    let q_tile_bytes = (variant.head_dim * elem_bytes * if pack_gqa { q_tile_queries * group } else { block_m }) as u32;
    // K and V boxes: a key block, or for a paged cache a part of one that never crosses a page
    // (kernels/flash_fwd/load.cuh, load_paged_rows).
    let kv_box_rows = match cache {
        Some(c) if c.page_table != 0 => gcd(c.page_size, variant.block_n),
        _ => variant.block_n,
    };
    // The output is ours, contiguous (total_q, heads, head_dim_v); the epilogue stores 64-row
    // boxes, one per consumer warpgroup.
    let out_len = dims.total_q * dims.heads * dims.head_dim_v;
    let lse_len = dims.total_q * dims.heads;
    // SAFETY: the kernel writes every element of both (every row of every sequence and head).
    let mut out = unsafe { dev.alloc::<T>(out_len)? };
    let mut lse = unsafe { dev.alloc::<f32>(lse_len)? };
    let (o_sizes, o_strides) = {
        let row = dims.heads * dims.head_dim_v;
        match varlen {
            Some(_) => ([dims.total_q, dims.heads, 1], [row, dims.head_dim_v, 0]),
            None => (
                [dims.seqlen_q, dims.heads, dims.batch],
                [row, dims.head_dim_v, dims.seqlen_q * row],
            ),
        }
    };
    let out_addr = device_addr(&out, &stream, &Layout::contiguous(out_len));
    // 16-bit output in the kernel's staging layout: the inputs' column blocks, or 64 columns
    // (128-byte rows) for fp8 kernels.
    let out_cols = if variant.fp8 { 64 } else { cols };
    let tma_o = tensor_map_nd(
        "out",
        out_dtype,
        out_addr,
        dims.head_dim_v,
        &o_sizes,
        &o_strides,
        &[WG_ROWS as u32, 1, 1],
        out_cols,
    )?;

    let num_m_blocks = dims.seqlen_q.div_ceil(q_tile_queries);
    // A two-warpgroup kernel that transposes V in shared memory (fp8 over a KV cache) with every
    // tile's rows in the first consumer warpgroup's 64: the second warpgroup would idle, so it
    // transposes V beside the producer's two warps (`fa3::FwdParams::solo_consumer`,
    // kernels/flash_fwd/transpose_v.cuh).
    let solo_consumer = variant.transpose_v && variant.consumer_wgs == 2 && tile_rows <= WG_ROWS;
    // A call captured into a CUDA graph does not pay a split's host time on replay.
    let captured = is_capturing(&dev.cuda_stream());
    // CTAs that run at once: one per SM, two for the one-warpgroup kernels (as the occupancy
    // calculator finds them).
    let slots = match variant.consumer_wgs {
        1 => {
            let name = variant.kernel_name(dtype);
            let smem = attention_smem(name)?;
            sms * ctas_per_sm(&dev, &kernel(&dev, name, smem)?, name, variant.threads(), smem)?
        }
        _ => sms,
    };
    let splits = split_count(
        params.num_splits,
        num_m_blocks * tile_heads * dims.batch,
        slots,
        dims.seqlen_k.div_ceil(variant.block_n),
        captured,
    );
    let num_tiles = num_m_blocks * tile_heads * dims.batch * splits;
    // The shares of each tile merged inside the launch, as one thread-block cluster
    // (kernels/flash_fwd/cluster_combine.cuh, the `_cm` kernels): single-query decode shapes (a
    // tile's rows at most MAX_CLUSTER_ROWS) whose shares fit a portable cluster and whose CTAs fill
    // at most half the SMs, with every cluster resident at once. Measured on an H200
    // (docs/kernels/kvcache.md, session 34) against the combine kernel: batch 1 over 1k keys (32
    // CTAs) 0.90x graph-replayed and 0.75x eager, the 1B model's batch-1 graph decode +0.8%;
    // where the rule leaves it out it measured slower: 4 queries x group 8 (32 rows) 1.07x, grids
    // of 128 CTAs (batch 8) 1.02-1.07x, a second wave of clusters up to 2x. Each CTA then takes
    // exactly one (tile, share), in static order.
    let cluster_kernel = match variant.own_kernel_name(dtype, OwnKernel::ClusterMerge) {
        Some(cm)
            if splits > 1
                && splits <= MAX_CLUSTER_SHARES
                && !tuning.global_combine
                && varlen.is_none()
                && tile_rows <= MAX_CLUSTER_ROWS
                && 2 * num_tiles <= sms =>
        {
            let smem = attention_smem(cm)?;
            let func = kernel(&dev, cm, smem)?;
            let fits = num_tiles / splits
                <= max_active_clusters(&dev, &func, cm, splits as u32, variant.threads(), smem as u32)?;
            fits.then_some((cm, func))
        }
        _ => None,
    };
    let cluster_combine = cluster_kernel.is_some();
    // A paged cache of pages smaller than 64 keys (up to 8 boxes per key block): the `_pw` kernels,
    // whose page warp looks each block's page indices up ahead of the threads that issue its
    // boxes (kernels/flash_fwd/load.cuh, page_warp). Measured against the lookups in the issuing
    // threads (docs/kernels/kvcache.md, session 35): pages of 16 graph-replayed at 0.81-1.00x the
    // time on an H200 (0.81-0.96x where HBM sets it), 0.95-1.02x on an H100. Kernels of their own:
    // compiled into the default ones, the code made contiguous split calls 2-5% slower. The
    // cluster merge goes first (its kernels look the pages up the old way).
    // The `_pw` kernels store K and V tiles in 8-row groups so that a page is one box, one TMA
    // issue for all its columns (`kvcache::PagedKvMaps`; session 37: pages of 16 graph-replayed at
    // 0.92-0.96x the time of two issues per page from 8k keys or batch 8, H200). A cache with no
    // such map (a head dim padded inside the second column block, pages interleaved with each
    // other) keeps the default kernel.
    let small_pages = matches!(cache, Some(c) if c.page_table != 0) && kv_box_rows < 64;
    let page_maps = match variant.own_kernel_name(dtype, OwnKernel::PageWarp) {
        Some(name) if small_pages && cluster_kernel.is_none() => {
            let k_map = kvcache::PagedKvMaps::new(
                dtype,
                k_addr,
                dims.head_dim,
                variant.head_dim,
                k_sizes,
                k_strides,
                kv_box_rows,
            );
            let v_map = kvcache::PagedKvMaps::new(
                dtype,
                v_addr,
                dims.head_dim_v,
                variant.head_dim,
                v_sizes,
                v_strides,
                kv_box_rows,
            );
            match (k_map, v_map) {
                (Some(k), Some(v)) if k.page_units == v.page_units => Some(PageWarpLaunch {
                    name,
                    tma_k: k.map("k")?,
                    tma_v: v.map("v")?,
                    page_units: k.page_units,
                }),
                _ => None,
            }
        }
        _ => None,
    };
    // An fp8 call that uses none of the options the plain kernels compile out.
    let plain_call = fp8.is_some_and(|f| f.q_blocks == 0 && f.k_blocks == 0)
        && cache.is_none()
        && varlen.is_none()
        && !pack_gqa
        && splits == 1
        && params.softcap.is_none()
        && !tuning.direct_store;
    let plain_kernel = variant.own_kernel_name(dtype, OwnKernel::Plain).filter(|_| plain_call);
    let name = match (&cluster_kernel, &page_maps, plain_kernel) {
        (Some((cluster, _)), _, _) => *cluster,
        (None, Some(pw), _) => pw.name,
        (None, None, Some(plain)) => plain,
        (None, None, None) => variant.kernel_name(dtype),
    };
    // The kernel's own shared-memory size (kernels/smem_table.cpp, measured by the build).
    let smem = attention_smem(name)?;
    let func = match cluster_kernel {
        Some((_, func)) => func,
        None => kernel(&dev, name, smem)?,
    };
    let tma_k = match &page_maps {
        Some(pw) => pw.tma_k,
        None => map("k", k_addr, dims.head_dim, k_sizes, k_strides, kv_box_rows)?,
    };
    // Tile order: uneven tiles run longest first across the pairs of an L2-sized section; even
    // tiles keep one pair per section (each pair's tiles in a row).
    let pairs = tile_heads * dims.batch;
    let section = match tuning.l2_section {
        Some(n) => n.clamp(1, pairs.max(1)),
        None if uneven => l2_section_pairs(
            dims.seqlen_k,
            dims.head_dim,
            dims.head_dim_v,
            if pack_gqa { 1 } else { dims.group() },
            pairs,
        ),
        None => 1,
    };
    let last_section = match pairs % section {
        0 => section,
        r => r,
    };
    // Split-KV partials: (splits, total_q, heads, head_dim_v) f32 and (splits, total_q, heads).
    // SAFETY (both): every split writes every row of its tiles (zeros and -inf for a share
    // without keys), and the combine reads only those rows.
    let (mut o_accum, mut lse_accum) = match splits > 1 && !cluster_combine {
        true => (
            Some(unsafe { dev.alloc::<f32>(splits * out_len)? }),
            Some(unsafe { dev.alloc::<f32>(splits * lse_len)? }),
        ),
        false => (None, None),
    };
    // A persistent grid, one CTA per SM (a CTA's shared memory fills most of an SM; two for the
    // one-warpgroup kernels), so that a CTA's next Q and K/V loads overlap its current tile's last
    // P·V and epilogue. Tiles of equal work are strided statically; uneven tiles (causal/windows,
    // varlen) are claimed through an atomic counter, longest first (kernels/flash_fwd/scheduler.cuh),
    // and so are the tiles of calls whose last query tile leaves a consumer warpgroup without
    // rows: that tile costs less than the others (d64's 192-row tiles at every power-of-two
    // length: 2,048 queries are 10 2/3 tiles), and strided, the CTAs that draw the short tiles
    // finish a tile ahead of the rest (fp8 d64 unmasked +3% at 2k-4k on an H200,
    // docs/kernels/forward-sm90.md, version 39).
    // `Tuning::per_tile` launches one CTA per uneven tile instead (the hardware's block
    // scheduler balances them; the path before the counter, kept for comparison).
    let grid = if cluster_combine || (uneven && tuning.per_tile) {
        num_tiles
    } else {
        num_tiles.min(slots)
    };
    // The counter ends at (tiles past the first grid) + grid: stay inside i32.
    if num_tiles + grid > i32::MAX as usize {
        bail!("flash-attn3: too many query tiles for one launch ({num_tiles})")
    }
    // The dynamic scheduler's counters: one zeroed buffer per device and thread, which every
    // launch leaves zeroed (kernels/flash_fwd/scheduler.cuh), so no memset per call.
    let counter = tile_counter(&dev)?;
    let last_tile_rows =
        (dims.seqlen_q - num_m_blocks.saturating_sub(1) * q_tile_queries) * if pack_gqa { group } else { 1 };
    let idle_warpgroup = last_tile_rows + WG_ROWS <= block_m;
    let dynamic = tuning.dynamic_tiles.unwrap_or(uneven || idle_warpgroup);
    let counter_addr = match dynamic && grid < num_tiles && !cluster_combine {
        true => counter,
        false => 0,
    };

    // Varlen offsets: the caller's u32 device tensors when contiguous, else a fresh upload of
    // the host copies that validation already read. (A KV-cache call with varlen queries passes
    // q's offsets for k too: the kernel takes each sequence's keys from the cache instead,
    // kernels/flash_fwd/scheduler.cuh get_tile.)
    let (cu_q_t, cu_k_t) = match varlen {
        Some(vl) => (
            Some(vl.seqlens_q.storage_and_layout()),
            Some(vl.seqlens_k.storage_and_layout()),
        ),
        None => (None, None),
    };
    let mut uploads = Vec::new();
    let cu_q = offsets_addr(
        &dev,
        &stream,
        cu_q_t.as_ref().map(|(s, l)| (&**s, *l)),
        varlen.map_or(&[][..], |v| &v.cu_q),
        &mut uploads,
    )?;
    let cu_k = offsets_addr(
        &dev,
        &stream,
        cu_k_t.as_ref().map(|(s, l)| (&**s, *l)),
        varlen.map_or(&[][..], |v| &v.cu_k),
        &mut uploads,
    )?;

    // V as the kernel reads it: the caller's (keys, head_dim_v) rows, or for fp8 outside KV caches
    // V^T written by the pre-pass or the kernel's writer warps (sequences, kv heads, head_dim_v,
    // keys), boxes of 128 keys by up to 128 head-dim rows (d256: two per 128 keys).
    // (KV-cache calls: the kernel transposes V tiles itself, transpose_v.cuh; a pass over the
    // whole cache per call would cost more than the attention.)
    // The kernel queued before the forward's (`FwdExtras::before_launch`): right before it, or
    // before the pre-pass, which reads what that kernel writes.
    let mut before_launch = extras.before_launch;
    let vt = match fp8 {
        Some(_) if !variant.transpose_v => {
            if let Some(queue) = before_launch.take() {
                queue()?;
            }
            let writer = fp8::VtWriter::pick(tuning.fp8_vt_in_kernel);
            Some(fp8::transpose_v(&dev, dims, v, cu_k, writer, variant.head_dim)?)
        }
        _ => None,
    };
    let tma_v = match (&vt, &page_maps) {
        (_, Some(pw)) => pw.tma_v,
        (Some(vt), None) => {
            let padded = vt.keys_padded;
            let slab = padded * dims.head_dim_v;
            tensor_map_nd(
                "v (transposed)",
                dtype,
                device_addr(&vt.vt, &stream, &Layout::contiguous(vt.vt.len())),
                padded,
                &[dims.head_dim_v, dims.kv_heads, dims.batch],
                &[padded, slab, slab * dims.kv_heads],
                &[fp8::vt_box_rows(variant.head_dim) as u32, 1, 1],
                fp8::VT_COL_KEYS as u32,
            )?
        }
        (None, None) => map("v", v_addr, dims.head_dim_v, v_sizes, v_strides, kv_box_rows)?,
    };
    let descales = match fp8 {
        Some(call) => Some(fp8::DescalePtrs::new(&dev, call)?),
        None => None,
    };

    let window = |w: Option<usize>| w.map_or(-1, |w| w.min(1 << 30) as i32);
    let scale = params.softmax_scale;
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    let (scale_log2, softcap_pre, negate) = match params.softcap {
        _ if scale == 0.0 => (1e-30, 0.0, 0),
        Some(cap) => (cap * LOG2E, scale / cap, 0),
        None => (scale.abs() * LOG2E, 0.0, (scale < 0.0) as i32),
    };
    let (lse_head_stride, lse_batch_stride) = match varlen {
        Some(_) => (dims.total_q as i64, 0),
        None => (dims.seqlen_q as i64, (dims.heads * dims.seqlen_q) as i64),
    };

    {
        let (out_ptr, _out_sync) = out.device_ptr_mut(&stream);
        let (lse_ptr, _lse_sync) = lse.device_ptr_mut(&stream);
        let _vt_sync = vt.as_ref().map(|vt| vt.vt.device_ptr(&stream));
        let vt_fill = vt.as_ref().and_then(|vt| vt.fill.as_ref());
        // The writer's loads: V as the caller laid it out, 128-key boxes in the kernel's
        // column-block width (fp8_vt_fill.cuh, `FwdTraits::kVtFillUnitKeys`).
        let tma_v_rows = match vt_fill {
            Some(_) => map(
                "v (rows)",
                v_addr,
                dims.head_dim_v,
                v_sizes,
                v_strides,
                fp8::VT_FILL_KEYS,
            )?,
            None => TmaDesc([0; 16]),
        };
        let vt_done = vt_fill.map_or(0, |f| f.done);
        let (o_accum_ptr, _o_accum_sync) = optional_ptr_mut(&mut o_accum, &stream);
        let (lse_accum_ptr, _lse_accum_sync) = optional_ptr_mut(&mut lse_accum, &stream);
        let p = FwdParams {
            tma_q,
            tma_k,
            tma_v,
            tma_o,
            tma_v_rows,
            out: out_ptr,
            lse: lse_ptr,
            cu_q,
            cu_k,
            tile_counter: counter_addr,
            out_row_stride: (dims.heads * dims.head_dim_v) as i64,
            lse_head_stride,
            lse_batch_stride,
            seqlen_q: dims.seqlen_q as i32,
            seqlen_k: dims.seqlen_k as i32,
            heads: dims.heads as i32,
            group: FastDiv::new(dims.group())?,
            head_dim_v: dims.head_dim_v as i32,
            window_left: window(params.window_left),
            window_right: window(params.window_right),
            scale_log2,
            softcap_pre,
            negate,
            num_m_blocks: FastDiv::new(num_m_blocks)?,
            batch: dims.batch as i32,
            direct_store: tuning.direct_store as i32,
            pack_gqa: pack_gqa as i32,
            tile_heads: FastDiv::new(tile_heads)?,
            q_tile_queries: q_tile_queries as i32,
            q_tile_bytes,
            num_splits: FastDiv::new(splits)?,
            l2_section: FastDiv::new(section)?,
            l2_last_section: FastDiv::new(last_section)?,
            l2_section_tiles: FastDiv::new(section * num_m_blocks)?,
            l2_full_sections: (pairs / section) as i32,
            total_q: dims.total_q as i32,
            o_accum: o_accum_ptr,
            lse_accum: lse_accum_ptr,
            q_descale: descales.as_ref().map_or(0, |d| d.q),
            k_descale: descales.as_ref().map_or(0, |d| d.k),
            v_descale: descales.as_ref().map_or(0, |d| d.v),
            q_descale_blocks: fp8.map_or(0, |f| f.q_blocks as i32),
            k_descale_blocks: fp8.map_or(0, |f| f.k_blocks as i32),
            q_descale_batch_stride: descales.as_ref().map_or(0, |d| d.q_batch_stride),
            k_descale_batch_stride: descales.as_ref().map_or(0, |d| d.k_batch_stride),
            v_descale_batch_stride: descales.as_ref().map_or(0, |d| d.v_batch_stride),
            q_descale_per_kv_head: descales.as_ref().map_or(0, |d| d.q_per_kv_head),
            out_f16: (out_dtype == DType::F16) as i32,
            seqused_k: cache.map_or(0, |c| c.seqused_k),
            kv_batch_idx: cache.map_or(0, |c| c.kv_batch_idx),
            page_table: cache.map_or(0, |c| c.page_table),
            max_pages: cache.map_or(0, |c| c.max_pages as i32),
            page_size: FastDiv::new(cache.map_or(1, |c| c.page_size.max(1)))?,
            page_box_rows: kv_box_rows as i32,
            sinks: extras.sinks,
            solo_consumer: solo_consumer as i32,
            cluster_combine: cluster_combine as i32,
            page_units: page_maps.as_ref().map_or(0, |pw| pw.page_units as i32),
            vt_src: vt_fill.map_or_else(Default::default, |f| f.src),
            vt_done,
            vt_units_per_pair: vt_fill.map_or(0, |f| f.units_per_pair as i32),
            vt_pairs: vt_fill.map_or(0, |f| f.pairs as i32),
        };
        let cfg = LaunchConfig {
            grid_dim: (grid as u32, 1, 1),
            block_dim: (variant.threads(), 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let overlaps_previous = match before_launch {
            Some(queue) => {
                queue()?;
                true
            }
            None => false,
        };
        let cluster_x = cluster_combine.then_some(splits as u32);
        // SAFETY: the params describe live device buffers (q, k, v, out, lse, cu_*) whose
        // guards are held until after the launch is queued on candle's stream; every thread of
        // the kernel waits for the kernel before it (griddepcontrol.wait) before its first read.
        match cluster_x.is_some() || overlaps_previous {
            true => unsafe { launch_with_attributes(&stream, &func, name, cfg, cluster_x, overlaps_previous, &p) }?,
            false => unsafe { launch_with_params(&stream, &func, name, cfg, &p) }?,
        }
    }
    if trace_requested() {
        dump_trace(&dev)?;
    }
    if let (Some(o_accum), Some(lse_accum)) = (&o_accum, &lse_accum) {
        let (o_accum_ptr, _o_accum_sync) = o_accum.device_ptr(&stream);
        let (lse_accum_ptr, _lse_accum_sync) = lse_accum.device_ptr(&stream);
        let (out_ptr, _out_sync) = out.device_ptr_mut(&stream);
        let (lse_ptr, _lse_sync) = lse.device_ptr_mut(&stream);
        combine_splits(
            &dev,
            out_dtype,
            &CombineParams {
                o_accum: o_accum_ptr,
                lse_accum: lse_accum_ptr,
                out: out_ptr,
                lse: lse_ptr,
                num_splits: splits as i32,
                total_q: dims.total_q as i32,
                heads: dims.heads as i32,
                head_dim_v: dims.head_dim_v as i32,
                seqlen_q: dims.seqlen_q.max(1) as i32,
                varlen: varlen.is_some() as i32,
                lse_head_stride,
                lse_batch_stride,
                sinks: extras.sinks,
                warps_per_row: combine_warps_per_row(splits) as i32,
            },
            dims.total_q * dims.heads,
        )?;
    }
    // The uploaded offsets, the counter and the split partials (if any) are freed in stream
    // order after the kernels.
    drop(uploads);
    drop((vt, descales));
    drop((o_accum, lse_accum));
    Ok((T::wrap_cuda_slice(out, dev.clone()), f32::wrap_cuda_slice(lse, dev)))
}

#[cfg(test)]
mod tests {
    use super::{attention_smem, decode_on_one_warpgroup, OwnKernel, Variant, WG_ROWS};
    use crate::Tuning;
    use candle_core::DType;

    /// Every forward kernel the host can pick, and each one of its own kinds (`_cm`, `_pw`), has
    /// its shared memory in the build's table (kernels/smem_table.cpp, from the kernels' own
    /// layouts) within a CTA's 227 KiB, and the one-warpgroup kernels fit two CTAs an SM (228 KiB,
    /// 1 KiB of each reserved by the driver).
    #[test]
    fn every_picked_kernel_has_its_shared_memory_from_the_build() {
        let mut picked = Vec::new();
        let fp8_tunings = [
            Tuning::default(),
            Tuning {
                fp8_d128_block_n: Some(128),
                ..Tuning::default()
            },
            Tuning {
                decode_one_cta_per_sm: true,
                ..Tuning::default()
            },
        ];
        for d in [32, 64, 96, 128, 160, 192, 256] {
            for uneven in [false, true] {
                for seqlen in [1, 512, 2048, 16384] {
                    for rows in [None, Some(128)] {
                        let v = Variant::pick(d, d, uneven, seqlen, rows).unwrap();
                        for dtype in [DType::BF16, DType::F16] {
                            picked.push((v, dtype));
                            if d <= 128 {
                                picked.push((v.on_one_warpgroup(), dtype));
                            }
                        }
                    }
                    for tuning in &fp8_tunings {
                        for (cache, tile_rows) in [(false, WG_ROWS), (true, 4), (true, WG_ROWS + 1)] {
                            let v = Variant::pick_fp8(d, d, uneven, seqlen, seqlen, tile_rows, tuning, cache).unwrap();
                            picked.push((v, DType::F8E4M3));
                        }
                    }
                }
            }
        }
        for (v, dtype) in picked {
            let own = [OwnKernel::ClusterMerge, OwnKernel::PageWarp, OwnKernel::Plain]
                .map(|kind| v.own_kernel_name(dtype, kind));
            for name in own.into_iter().flatten().chain([v.kernel_name(dtype)]) {
                let smem = attention_smem(name).unwrap_or_else(|e| panic!("{name}: {e}"));
                assert!(smem > 1024 && smem <= 227 * 1024, "{name}: {smem} bytes");
                if v.consumer_wgs == 1 {
                    assert!(2 * (smem + 1024) <= 228 * 1024, "{name}: {smem} bytes, two CTAs an SM");
                }
            }
        }
    }

    /// Every fp8 kernel but the KV-cache ones has a `_plain` twin of the same tile, and no 16-bit
    /// kernel has one (host logic only; the kernels exist:
    /// `every_picked_kernel_has_its_shared_memory_from_the_build`).
    #[test]
    fn fp8_plain_twins() {
        let default = Tuning::default();
        let fp8 = |d: usize, uneven: bool, seqlen: usize, cache: bool| {
            let v = Variant::pick_fp8(d, d, uneven, seqlen, seqlen, WG_ROWS, &default, cache).unwrap();
            (
                v.kernel_name(DType::F8E4M3),
                v.own_kernel_name(DType::F8E4M3, OwnKernel::Plain),
            )
        };
        let twin = |general: &str| Some(format!("{general}_plain"));
        for (d, uneven, seqlen) in [
            (64, false, 512),
            (64, true, 512),
            (64, false, 16384),
            (128, false, 256),
            (128, false, 4096),
            (256, true, 2048),
        ] {
            let (general, plain) = fp8(d, uneven, seqlen, false);
            assert!(!general.ends_with("_tv"), "{general}");
            assert_eq!(
                plain.map(str::to_string),
                twin(general),
                "d{d} uneven {uneven} seqlen {seqlen}"
            );
        }
        for d in [64, 128, 256] {
            let (general, plain) = fp8(d, true, 1, true);
            assert!(general.ends_with("_tv") && plain.is_none(), "{general}: {plain:?}");
        }
        for d in [64, 128, 256] {
            let v = Variant::pick(d, d, false, 4096, None).unwrap();
            for dtype in [DType::BF16, DType::F16] {
                assert_eq!(v.own_kernel_name(dtype, OwnKernel::Plain), None);
            }
        }
    }

    /// Which fp8 calls take the one-warpgroup decode kernel (host logic only; its two CTAs an SM:
    /// `every_picked_kernel_has_its_shared_memory_from_the_build`).
    #[test]
    fn fp8_d64_decode_takes_the_two_ctas_per_sm_kernel() {
        let pick = |d: usize, tile_rows: usize, tuning: &Tuning, cache: bool| {
            Variant::pick_fp8(d, d, true, 1, 8192, tile_rows, tuning, cache).unwrap()
        };
        let default = Tuning::default();
        // The 1B shape's decode over an fp8 cache: 1 query x 4 q heads per kv head.
        let v = pick(64, 4, &default, true);
        assert_eq!((v.consumer_wgs, v.block_m(), v.threads()), (1, 64, 256));
        assert_eq!(v.kernel_name(DType::F8E4M3), "flash_fwd_d64x1_e4m3_tv");
        // Head dims up to 64, and rows up to one warpgroup's.
        assert_eq!(pick(48, WG_ROWS, &default, true).consumer_wgs, 1);
        // More rows, a larger head dim, no cache (the pre-pass kernels), or the tuning switch: not.
        assert_eq!(pick(64, WG_ROWS + 1, &default, true).consumer_wgs, 2);
        assert_eq!(pick(128, 4, &default, true).consumer_wgs, 2);
        assert_ne!(pick(64, 4, &default, false).consumer_wgs, 1);
        let off = Tuning {
            decode_one_cta_per_sm: true,
            ..default
        };
        let v = pick(64, 4, &off, true);
        assert_eq!(v.consumer_wgs, 2);
        assert_eq!(v.kernel_name(DType::F8E4M3), "flash_fwd_d64_e4m3_tv");
    }

    /// fp8 d128's key blocks (host logic only): 256 (the serial consumer) from 512 keys, from
    /// 2,048 for uneven calls, never over a KV cache (the in-kernel V transpose moves 128-key
    /// blocks); `Tuning::fp8_d128_block_n` overrides.
    #[test]
    fn fp8_d128_key_blocks_by_length_and_evenness() {
        let default = Tuning::default();
        let pick = |uneven: bool, seqlen_k: usize, tuning: &Tuning, cache: bool| {
            Variant::pick_fp8(128, 128, uneven, 4096, seqlen_k, WG_ROWS, tuning, cache).unwrap()
        };
        let keys = |uneven: bool, seqlen_k: usize| pick(uneven, seqlen_k, &default, false).block_n;
        assert_eq!(
            (keys(false, 511), keys(false, 512), keys(false, 16384)),
            (128, 256, 256)
        );
        assert_eq!((keys(true, 1024), keys(true, 2047), keys(true, 2048)), (128, 128, 256));
        assert_eq!(pick(false, 16384, &default, true).block_n, 128);
        let v = pick(false, 4096, &default, false);
        assert_eq!(v.kernel_name(DType::F8E4M3), "flash_fwd_d128_n256_e4m3");
        let forced = Tuning {
            fp8_d128_block_n: Some(128),
            ..default
        };
        assert_eq!(
            pick(false, 16384, &forced, false).kernel_name(DType::F8E4M3),
            "flash_fwd_d128_e4m3"
        );
    }

    /// d64's tile rows (host logic only): 192 (three consumer warpgroups) except for uneven calls
    /// under 4096 queries in 16 bits and under 2048 in fp8; `Tuning::d64_tile_rows` overrides.
    #[test]
    fn d64_tiles_of_uneven_calls_by_dtype() {
        let default = Tuning::default();
        let bf16 = |uneven: bool, seqlen_q: usize| Variant::pick(64, 64, uneven, seqlen_q, None).unwrap().consumer_wgs;
        let fp8 = |uneven: bool, seqlen_q: usize, tuning: &Tuning| {
            Variant::pick_fp8(64, 64, uneven, seqlen_q, seqlen_q, WG_ROWS, tuning, false)
                .unwrap()
                .consumer_wgs
        };
        assert_eq!(
            (bf16(true, 2048), bf16(true, 4095), bf16(true, 4096), bf16(false, 512)),
            (2, 2, 3, 3)
        );
        assert_eq!(
            (
                fp8(true, 1024, &default),
                fp8(true, 2047, &default),
                fp8(true, 2048, &default)
            ),
            (2, 2, 3)
        );
        assert_eq!(fp8(false, 512, &default), 3);
        let rows_128 = Tuning {
            d64_tile_rows: Some(128),
            ..default
        };
        assert_eq!(fp8(true, 8192, &rows_128), 2);
        assert_eq!(Variant::pick(64, 64, false, 8192, Some(128)).unwrap().consumer_wgs, 2);
    }

    /// Where 16-bit decode takes the one-warpgroup kernel (H200's and H100's 132 SMs: 212 tiles fill
    /// both CTA slots of most SMs; with 8 kv heads, batch 27), on 64-key blocks at d128.
    #[test]
    fn decode_takes_one_warpgroup_where_it_measured_faster() {
        let d64 = |tiles, small_pages, keys| decode_on_one_warpgroup(64, tiles, 132, small_pages, keys);
        // Enough tiles: short caches and small pages; not long contiguous caches.
        assert!(d64(212, false, 640) && d64(1024, false, 2048) && d64(212, true, 640));
        assert!(!d64(256, false, 4096) && !d64(1024, false, 8192));
        // Fewer tiles: only small pages over long caches (their shares then merge in the combine).
        assert!(!d64(211, false, 640) && !d64(128, true, 640) && !d64(8, false, 8192));
        assert!(d64(8, true, 2048) && d64(128, true, 8192));
        // d128: small pages over short caches with enough tiles, nothing else; d96 / d256 never.
        let d128 = |tiles, small_pages, keys| decode_on_one_warpgroup(128, tiles, 132, small_pages, keys);
        assert!(d128(512, true, 1024) && !d128(512, false, 1024) && !d128(128, true, 1024) && !d128(512, true, 8192));
        assert!(
            !decode_on_one_warpgroup(96, 512, 132, true, 1024) && !decode_on_one_warpgroup(256, 512, 132, true, 1024)
        );
        for d in [64, 128] {
            let v = Variant::pick(d, d, true, 1, None).unwrap().on_one_warpgroup();
            assert_eq!((v.consumer_wgs, v.block_n), (1, if d == 128 { 64 } else { 128 }));
        }
    }
}
