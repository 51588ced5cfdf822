// The run-time options that only some forward calls use, as the kernels read them. A plain kernel
// (FwdTraits::kPlain; the host picks one for calls without these options) reads each as its "off"
// value, a constant the compiler folds, so that their paths leave the kernel: the fp8 kernels
// carried them as 2-2.5x their SASS (docs/kernels/forward-fp8.md, session 70). The attention
// window (causal included), sinks and a negative scale stay run-time values in every kernel.
// (The KV cache's fields, page table, key counts and cache rows, are folded the same way by
// FwdTraits::kServesCache where load.cuh and scheduler.cuh read them: off in every fp8 kernel but
// the `_tv` ones, the plain ones included.)
#pragma once

#include "params.cuh"

namespace fa3 {

// Pack-GQA: a tile holds the q heads of one kv head (FwdParams::pack_gqa).
template <class Tr> __device__ __forceinline__ bool packs_gqa(const FwdParams& p) {
    if constexpr (Tr::kPlain) return false;
    else return p.pack_gqa != 0;
}
// Varlen: sequences addressed through cu_q / cu_k.
template <class Tr> __device__ __forceinline__ bool is_varlen(const FwdParams& p) {
    if constexpr (Tr::kPlain) return false;
    else return p.cu_q != nullptr;
}
// Split-KV: a tile's key blocks shared by num_splits CTAs.
template <class Tr> __device__ __forceinline__ bool is_split(const FwdParams& p) {
    if constexpr (Tr::kPlain) return false;
    else return p.num_splits.d > 1;
}
// Softcap (0: none).
template <class Tr> __device__ __forceinline__ float softcap_pre(const FwdParams& p) {
    if constexpr (Tr::kPlain) return 0.f;
    else return p.softcap_pre;
}
// O stored from registers even where the TMA store applies (a tuning value).
template <class Tr> __device__ __forceinline__ bool stores_direct(const FwdParams& p) {
    if constexpr (Tr::kPlain) return false;
    else return p.direct_store != 0;
}
// FP8 descales per block of query rows / keys (0: one per sequence and head).
template <class Tr> __device__ __forceinline__ int q_descale_blocks(const FwdParams& p) {
    if constexpr (Tr::kPlain) return 0;
    else return p.q_descale_blocks;
}
template <class Tr> __device__ __forceinline__ int k_descale_blocks(const FwdParams& p) {
    if constexpr (Tr::kPlain) return 0;
    else return p.k_descale_blocks;
}

}  // namespace fa3
