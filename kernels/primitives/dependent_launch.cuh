// Programmatic dependent launch (sm_90, PTX `griddepcontrol`): a kernel launched with the
// programmatic-stream-serialization attribute (crates/flash-attn/src/cuda/mod.rs,
// launch_with_attributes) may start its CTAs while the kernel before it on the stream still runs.
// Both calls are no-ops for a kernel launched normally.
#pragma once

namespace fa3 {

// Lets the kernel after this one start its CTAs (once every CTA of this grid has called this or
// exited): called early by kernels whose successor has set-up work of its own to overlap.
__device__ __forceinline__ void let_dependents_start() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// Waits until the kernels before this one on the stream have finished and their memory is
// visible: before the first read of anything they write (or write of anything they read).
__device__ __forceinline__ void wait_for_prerequisites() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

}  // namespace fa3
