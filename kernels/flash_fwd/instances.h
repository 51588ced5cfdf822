// Every forward kernel, one line each: FA3_FWD_KERNEL_OF(NAME, consumer warpgroups, FwdTraits...),
// which the file that includes this one defines. kernel.cu compiles each line into the kernel NAME;
// kernels/smem_table.cpp (run at build time by crates/flash-attn/build.rs) prints each one's
// dynamic shared memory, the size the host launches it with. No include guard: one list, read
// once per file that includes it.

#define FA3_FWD_KERNEL_WG(NAME, D, BN, DT, WGS) FA3_FWD_KERNEL_OF(NAME, WGS, fa3::FwdTraits<D, BN, DT, WGS>)
#define FA3_FWD_KERNEL(NAME, D, BN, DT) FA3_FWD_KERNEL_WG(NAME, D, BN, DT, 2)
#define FA3_FWD_KERNEL_FP8_TV(NAME, D) FA3_FWD_KERNEL_OF(NAME, 2, fa3::FwdTraits<D, 128, fa3::DT_E4M3, 2, true>)

// Instantiations: (padded head dim, key block) per dtype. Any other head dim (a multiple of 8)
// runs on the next one up with TMA zero-filling the missing columns.
// (The stage-1 consumers, one key block at a time per warpgroup, were retired in session 14:
// docs/kernels/forward-sm90.md, version 1.)
FA3_FWD_KERNEL(flash_fwd_d64_bf16, 64, 128, fa3::DT_BF16)
FA3_FWD_KERNEL(flash_fwd_d96_bf16, 96, 128, fa3::DT_BF16)
FA3_FWD_KERNEL(flash_fwd_d128_bf16, 128, 128, fa3::DT_BF16)
FA3_FWD_KERNEL(flash_fwd_d192_bf16, 192, 112, fa3::DT_BF16)
FA3_FWD_KERNEL(flash_fwd_d256_bf16, 256, 80, fa3::DT_BF16)
FA3_FWD_KERNEL(flash_fwd_d64_f16, 64, 128, fa3::DT_F16)
FA3_FWD_KERNEL(flash_fwd_d96_f16, 96, 128, fa3::DT_F16)
FA3_FWD_KERNEL(flash_fwd_d128_f16, 128, 128, fa3::DT_F16)
FA3_FWD_KERNEL(flash_fwd_d192_f16, 192, 112, fa3::DT_F16)
FA3_FWD_KERNEL(flash_fwd_d256_f16, 256, 80, fa3::DT_F16)
// d64 with 3 consumer warpgroups (192-row tiles, FA3's d64 shape): the default for head dims <= 64
// except short masked calls (crates/flash-attn/src/cuda/forward.rs, Variant::pick).
FA3_FWD_KERNEL_WG(flash_fwd_d64x3_bf16, 64, 128, fa3::DT_BF16, 3)
FA3_FWD_KERNEL_WG(flash_fwd_d64x3_f16, 64, 128, fa3::DT_F16, 3)
// Decode over a KV cache on one consumer warpgroup, two CTAs per SM (each tile's rows fit one
// warpgroup's 64, so the two-warpgroup kernel's second warpgroup would idle): where the host's rule
// takes it (forward.rs, decode_on_one_warpgroup), two chains of key blocks run per SM. d128 on
// 64-key blocks with one Q buffer (96 KiB of shared memory a CTA).
FA3_FWD_KERNEL_WG(flash_fwd_d64x1_bf16, 64, 128, fa3::DT_BF16, 1)
FA3_FWD_KERNEL_WG(flash_fwd_d64x1_f16, 64, 128, fa3::DT_F16, 1)
FA3_FWD_KERNEL_WG(flash_fwd_d128x1_bf16, 128, 64, fa3::DT_BF16, 1)
FA3_FWD_KERNEL_WG(flash_fwd_d128x1_f16, 128, 64, fa3::DT_F16, 1)
// Split-KV decode calls whose shares merge in a thread-block cluster (cluster_combine.cuh; the host's
// rule in crates/flash-attn/src/cuda/forward.rs): the d64 and d128 kernels with the merge compiled in.
#define FA3_FWD_KERNEL_CM(NAME, D, DT) FA3_FWD_KERNEL_OF(NAME, 2, fa3::FwdTraits<D, 128, DT, 2, false, true>)
FA3_FWD_KERNEL_CM(flash_fwd_d64_bf16_cm, 64, fa3::DT_BF16)
FA3_FWD_KERNEL_CM(flash_fwd_d128_bf16_cm, 128, fa3::DT_BF16)
FA3_FWD_KERNEL_CM(flash_fwd_d64_f16_cm, 64, fa3::DT_F16)
FA3_FWD_KERNEL_CM(flash_fwd_d128_f16_cm, 128, fa3::DT_F16)

// Paged caches of small pages (16 and 32 keys) with the page warp (load.cuh page_warp) and K / V
// tiles in 8-row groups, one TMA box per page (traits.cuh kKVRowGroups): head dims 64 and 128; the
// other head dims' small pages keep their lookups in the issuing threads.
#define FA3_FWD_KERNEL_PW(NAME, D, DT) FA3_FWD_KERNEL_OF(NAME, 2, fa3::FwdTraits<D, 128, DT, 2, false, false, true>)
FA3_FWD_KERNEL_PW(flash_fwd_d64_bf16_pw, 64, fa3::DT_BF16)
FA3_FWD_KERNEL_PW(flash_fwd_d128_bf16_pw, 128, fa3::DT_BF16)
FA3_FWD_KERNEL_PW(flash_fwd_d64_f16_pw, 64, fa3::DT_F16)
FA3_FWD_KERNEL_PW(flash_fwd_d128_f16_pw, 128, fa3::DT_F16)
// FP8 (e4m3 inputs, bf16 or f16 output): 128-key blocks (whole 128-byte rows of V^T); head dims
// 96 and 192 run on d128 and d256 with zero-filled columns; d64 also on 192-row tiles, chosen as
// for 16 bits but for masked calls from 2k queries (cuda/forward.rs, FP8_D64_UNEVEN_MIN); d128
// also on 256-key blocks without intra-warpgroup overlap (mainloop.cuh consumer_serial) for calls
// of 512 keys or more, 2k when masked (crates/flash-attn/src/cuda/fp8.rs, block_n).
// docs/kernels/forward-fp8.md.
FA3_FWD_KERNEL(flash_fwd_d64_e4m3, 64, 128, fa3::DT_E4M3)
FA3_FWD_KERNEL_WG(flash_fwd_d64x3_e4m3, 64, 128, fa3::DT_E4M3, 3)
FA3_FWD_KERNEL(flash_fwd_d128_e4m3, 128, 128, fa3::DT_E4M3)
FA3_FWD_KERNEL(flash_fwd_d128_n256_e4m3, 128, 256, fa3::DT_E4M3)
FA3_FWD_KERNEL(flash_fwd_d256_e4m3, 256, 128, fa3::DT_E4M3)
// The same five without pack-GQA, varlen, split-KV, softcap, direct stores and per-block descales
// (options.cuh, FwdTraits::kPlain), for the calls that use none of them (forward.rs,
// OwnKernel::Plain): unmasked, causal and windowed fixed-length calls with one descale per head.
// Those paths cost the general kernels a tile's worth of fixed time (spills and 2-2.5x the SASS);
// without them, H200: +8-13% at 512 tokens, +1-5% at 2k, 0-4% from 4k
// (docs/kernels/forward-fp8.md, version 19).
#define FA3_FWD_KERNEL_FP8_PLAIN(NAME, D, BN, WGS) \
    FA3_FWD_KERNEL_OF(NAME, WGS, fa3::FwdTraits<D, BN, fa3::DT_E4M3, WGS, false, false, false, true>)
FA3_FWD_KERNEL_FP8_PLAIN(flash_fwd_d64_e4m3_plain, 64, 128, 2)
FA3_FWD_KERNEL_FP8_PLAIN(flash_fwd_d64x3_e4m3_plain, 64, 128, 3)
FA3_FWD_KERNEL_FP8_PLAIN(flash_fwd_d128_e4m3_plain, 128, 128, 2)
FA3_FWD_KERNEL_FP8_PLAIN(flash_fwd_d128_n256_e4m3_plain, 128, 256, 2)
FA3_FWD_KERNEL_FP8_PLAIN(flash_fwd_d256_e4m3_plain, 256, 128, 2)

// FP8 over KV caches (flash_attn_with_kvcache): V as the cache holds it, contiguous or paged,
// transposed in shared memory (transpose_v.cuh) instead of by a pre-pass over the whole cache.
// Slower than the pre-pass design on long prefill-shaped calls (docs/kernels/forward-fp8.md,
// version 3), so the other fp8 calls keep the pre-pass.
FA3_FWD_KERNEL_FP8_TV(flash_fwd_d64_e4m3_tv, 64)
// d64 fp8 decode (a sequence's query rows within one warpgroup's 64) on one consumer warpgroup,
// two CTAs per SM: two chains of key blocks per SM (forward.rs, `Variant::pick_fp8`).
FA3_FWD_KERNEL_OF(flash_fwd_d64x1_e4m3_tv, 1, fa3::FwdTraits<64, 128, fa3::DT_E4M3, 1, true>)
FA3_FWD_KERNEL_FP8_TV(flash_fwd_d128_e4m3_tv, 128)
FA3_FWD_KERNEL_FP8_TV(flash_fwd_d256_e4m3_tv, 256)
