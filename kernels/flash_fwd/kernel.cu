// The Hopper (sm_90a) FlashAttention-3 forward: warp-specialised TMA + wgmma.
//
// A persistent CTA (one per SM, looping over tiles claimed statically or through an atomic
// counter, scheduler.cuh) of 3 or 4 warpgroups: warpgroup 0 is the producer (one thread issues
// TMA copies, one claims tiles; the warpgroup gives its registers away with setmaxnreg), the
// others are consumers that each own 64 rows of the 128- or 192-row query tile.
// See docs/kernels/forward-sm90.md.
#include "../primitives/cluster.cuh"
#include "../primitives/dependent_launch.cuh"
#include "../primitives/warp.cuh"
#include "combine.cuh"
#include "fp8_prepass.cuh"
#include "fp8_vt_fill.cuh"
#include "load.cuh"
#include "mainloop.cuh"

namespace fa3 {

template <class Tr> __device__ __forceinline__ void flash_fwd(const FwdParams& p) {
    // 227 KiB of shared memory per CTA, with 1024 bytes of slack to align the start.
    static_assert(sizeof(SharedStorage<Tr>) + 1024 <= 227 * 1024, "shared memory");
    extern __shared__ uint8_t smem_raw[];
    // TMA's 128B swizzle and the wgmma descriptors assume 1024-byte aligned tiles.
    uintptr_t base = (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023);
    SharedStorage<Tr>& s = *reinterpret_cast<SharedStorage<Tr>*>(base);

    // fp8 (traits.cuh kUniformWarpgroup): made warp-uniform here, once, for ptxas's sake.
    const int wg = Tr::kUniformWarpgroup ? (int)uniform(threadIdx.x / 128) : threadIdx.x / 128;
    const int tid = threadIdx.x % 128;
    // One consumer warpgroup computes; with kTransposeV the other transposes V (params.cuh).
    const bool solo = solo_consumer<Tr>(p);
    const int consumers = solo ? 1 : Tr::kConsumerWGs;
    const int transposers = transposer_threads<Tr>(p);
    if (threadIdx.x == 0) {
        trace_life(0);
#pragma unroll
        for (int i = 0; i < Tr::kQStages; ++i) {
            mbar_init(&s.bar_q[i], 1);
            mbar_init(&s.q_empty[i], 128 * consumers);
        }
#pragma unroll
        for (int i = 0; i < Tr::kStages; ++i) {
            mbar_init(&s.full_k[i], 1);
            mbar_init(&s.empty_k[i], 128 * consumers);
            // V lands by TMA (one arrival and its bytes) or from the transposer threads.
            mbar_init(&s.full_v[i], Tr::kTransposeV ? transposers : 1);
            mbar_init(&s.empty_v[i], 128 * consumers);
        }
        if constexpr (Tr::kTransposeV) {
#pragma unroll
            for (int i = 0; i < Tr::kVRawStages; ++i) {
                mbar_init(&s.full_v_raw[i], 1);
                mbar_init(&s.empty_v_raw[i], transposers);
            }
            s.transpose_stop = -1;  // set by the TMA thread at the end (transpose_v.cuh)
        }
        if constexpr (Tr::kPageWarp) {
#pragma unroll
            for (int i = 0; i < Tr::kPageSlots; ++i) {
                mbar_init(&s.pages_full[i], 32);  // every lane of the page warp
                mbar_init(&s.pages_empty[i], 2);  // the TMA thread (K) and the V thread
            }
        }
        if constexpr (Tr::kVtFill) {
            mbar_init(&s.vt_fill_full, 1);
            mbar_init(&s.vt_fill_stopped, 1);
            mbar_init(&s.tma_done, 1);
        }
        if constexpr (Tr::kSerialConsumer) s.zero = 0;
        mbar_init(&s.tile_full, 1);
        // The consumers, the TMA thread and (paged caches) the V thread release a tile index;
        // with kPageWarp every lane of the page warp too.
        mbar_init(&s.tile_empty, 128 * consumers + 1 + (paged_v_thread<Tr>(p) ? (Tr::kPageWarp ? 33 : 1) : 0));
        mbar_init_fence();
        // No writer in this call (fp8_vt_fill.cuh): its buffer is free from the start.
        if constexpr (Tr::kVtFill) {
            if (p.vt_done == nullptr) mbar_arrive(&s.vt_fill_stopped);
        }
    }
    __syncthreads();
    // A KV-cache call's append kernel may still be running (the host launches this kernel to
    // overlap it: crates/flash-attn/src/cuda/forward.rs, FwdExtras::before_launch): the launch and
    // the set-up above ran beside it; the key counts, q and the cache it writes are read after.
    wait_for_prerequisites();
    if (threadIdx.x == 0) trace_life(1);

    if (wg == 0) {
        warpgroup_reg_dealloc<Tr::kProducerRegs>();
        if (tid == 0) trace_life(4);
        const bool v_thread = paged_v_thread<Tr>(p);
        if (tid == 0) {
            producer<Tr>(p, s, {true, !v_thread});  // the TMA thread
            if constexpr (Tr::kVtFill) mbar_arrive(&s.tma_done);  // no more reads of vt_done (fp8_vt_fill.cuh)
            trace_life(2);
        }
        if (tid == 64 && v_thread) producer<Tr>(p, s, {false, true});  // a paged cache's V
        if constexpr (Tr::kPageWarp) {
            if (tid >= 96 && v_thread) page_warp<Tr>(p, s, tid - 96);  // and its page indices
        }
        if (tid == 32) scheduler<Tr>(p, s);      // claims tiles (scheduler.cuh)
        if constexpr (Tr::kTransposeV) {
            if (tid >= 64) v_transposer<Tr>(s, tid - 64, transposers);  // V -> V^T (transpose_v.cuh)
        } else if constexpr (Tr::kVtFill) {
            if (tid >= 64 && p.vt_done != nullptr) vt_fill<Tr>(p, s, tid / 32 - 2, tid % 32);  // V^T (fp8_vt_fill.cuh)
        }
    } else if (solo && wg == 2) {
        // The second consumer warpgroup of a solo call: the transposer's threads 64..191. It keeps
        // the launch's register count (no setmaxnreg): the transposer needs few, and the first
        // warpgroup's increase is still covered by what the producer gave away.
        v_transposer<Tr>(s, Tr::kTransposeThreads + tid, transposers);
    } else {
        warpgroup_reg_alloc<Tr::kConsumerRegs>();
        if (wg == 1 && tid == 0) trace_life(7);
        // it: K/V blocks consumed so far (ring position); tc: tiles with keys so far (Q parity).
        RingCount it = 0;
        int tc = 0;
        PendingStore pending;  // thread 0: this warpgroup's staged O, not yet stored (epilogue.cuh)
        const bool pingpong = takes_turns<Tr>(solo);
        if (pingpong) pingpong_ring_start<Tr::kConsumerWGs>(wg - 1);
        for (int k = 0;; ++k) {
            TileInfo t;
            bool valid;
            trace_fine(wg, tc - 1, 7);
            const int tile = receive_tile<Tr>(p, s, k, t, valid, wg, tc);  // claimed and decoded by the scheduler thread
            trace_fine(wg, tc - 1, 6);
            if (tile >= num_tiles(p)) break;
            if (!valid) continue;  // past this sequence's end (varlen)
            if (t.n_max <= t.n_min) {
                // No row of the tile sees a key: zero output, LSE -inf (or the row's sink logit);
                // nothing was loaded.
                float o[Tr::kORegs];
#pragma unroll
                for (int i = 0; i < Tr::kORegs; ++i) o[i] = 0.f;
                const int warp = tid / 32, lane = tid % 32;
                const int row = (wg - 1) * 64 + warp * 16 + lane / 4;
                const float inv[2] = {0.f, 0.f};
                float lse[2];
                row_sinks_log2<Tr>(p, t, row, lse);
                lse[0] *= 0.69314718055994531f;
                lse[1] *= 0.69314718055994531f;
                epilogue<Tr>(p, s, t, o, inv, lse, wg - 1, tid, row, lane % 4, pending);
                continue;
            }
            if constexpr (Tr::kSerialConsumer) {
                consumer_serial<Tr>(p, s, t, wg - 1, tid, it, tc, pending);
            } else {
                consumer_pingpong<Tr>(p, s, t, wg - 1, tid, it, tc, pending);
            }
            ++tc;
        }
        if (pingpong) pingpong_ring_end(wg - 1);
        epilogue_drain<Tr>(p, s, wg - 1, tid, pending);
        if (wg == 1 && tid == 0) trace_life(3);
    }
}

}  // namespace fa3

// One kernel: NAME runs flash_fwd over the FwdTraits given last, WGS consumer warpgroups, with
// the traits' CTAs per SM (two for one consumer warpgroup).
#define FA3_FWD_KERNEL_OF(NAME, WGS, ...)                                                              \
    extern "C" __global__ void __launch_bounds__(128 * (1 + WGS), __VA_ARGS__::kCtasPerSm)             \
        NAME(const __grid_constant__ fa3::FwdParams p) {                                                \
        fa3::flash_fwd<__VA_ARGS__>(p);                                                                 \
    }
// The instantiations (kernels/flash_fwd/instances.h).
#include "instances.h"

#ifdef FA3_TRACE
extern "C" __global__ void fa3_trace_dump(int launch) { fa3::trace_dump(launch); }
#endif

// The fp8 forward's V transpose (fp8_prepass.cuh): grid (key blocks of 128 (64 for d > 128), kv heads, sequences).
extern "C" __global__ void __launch_bounds__(fa3::kPrepassThreads)
    flash_fwd_fp8_transpose_v(const __grid_constant__ fa3::Fp8PrepassParams p) {
    fa3::fp8_transpose_v(p);
}

// Split-KV combine (combine.cuh): 256 threads, one warp per (token, head) row.
extern "C" __global__ void __launch_bounds__(32 * fa3::kCombineWarps)
    flash_fwd_combine_bf16(const __grid_constant__ fa3::CombineParams p) {
    fa3::combine_splits<fa3::DT_BF16>(p);
}
extern "C" __global__ void __launch_bounds__(32 * fa3::kCombineWarps)
    flash_fwd_combine_f16(const __grid_constant__ fa3::CombineParams p) {
    fa3::combine_splits<fa3::DT_F16>(p);
}
