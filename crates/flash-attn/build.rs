//! Compiles the Hopper kernels (kernels/ at the workspace root) into five cubins (forward,
//! backward, fp8 quantizer, KV cache append, single-query decode) when the `cuda` feature is on.
//! The crate embeds them with `include_bytes!` and loads them at run time through candle's cudarc;
//! nothing links against the CUDA runtime.

use std::env;
use std::path::PathBuf;

include!("../build-support/nvcc.rs");

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=../build-support/nvcc.rs");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=CUDA_PATH");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=FA3_NVCC_FLAGS");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let kernels = manifest.join("../../kernels");
    let kernels = kernels.canonicalize().unwrap_or(kernels);
    watch(&kernels);

    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    // Extra nvcc flags for experiments: -lineinfo for ncu's source view, -DFA3_HANG_CHECK (a stuck
    // mbarrier wait prints where and traps, kernels/primitives/mbarrier.cuh), -DFA3_TRACE for the
    // forward's timeline (kernels/primitives/trace.cuh).
    let extra: Vec<String> = env::var("FA3_NVCC_FLAGS")
        .map(|f| f.split_whitespace().map(String::from).collect())
        .unwrap_or_default();
    // The forward, the backward, the fp8 quantizer, the KV cache's append and its single-query
    // decode are separate cubins, compiled in parallel.
    let jobs = [
        ("flash_fwd/kernel.cu", "flash_fwd.cubin"),
        ("flash_bwd/kernel.cu", "flash_bwd.cubin"),
        ("fp8/quantize.cu", "fp8_quantize.cubin"),
        ("kvcache/append.cu", "kvcache_append.cubin"),
        ("kvcache/decode.cu", "kvcache_decode.cubin"),
    ]
    .map(|(src, cubin)| (kernels.join(src), out_dir.join(cubin)));
    compile_cubins("flash-attn3", &jobs, &extra);
    smem_table(&kernels, &out_dir, &extra);
}

/// kernels/smem_table.cpp, compiled as host C++ by nvcc and run here: each forward and backward
/// kernel's dynamic shared memory, from the layouts the kernels are compiled with, as Rust
/// (OUT_DIR/smem_table.rs, included by src/cuda/mod.rs). Needs no GPU. The macros of
/// `FA3_NVCC_FLAGS` (`-D`, `-U`) reach it too, so that a kernel experiment that changes a layout
/// gets its own sizes.
fn smem_table(kernels: &std::path::Path, out_dir: &std::path::Path, extra: &[String]) {
    use std::process::Command;
    let exe = out_dir.join("smem_table");
    let status = Command::new(find_nvcc("flash-attn3"))
        .args([
            "-x",
            "c++",
            "-std=c++17",
            "-cudart",
            "none",
            "-include",
            "cuda_runtime_api.h",
        ])
        .args(extra.iter().filter(|f| f.starts_with("-D") || f.starts_with("-U")))
        .arg(kernels.join("smem_table.cpp"))
        .arg("-o")
        .arg(&exe)
        .status()
        .unwrap_or_else(|e| panic!("flash-attn3: could not run nvcc for kernels/smem_table.cpp ({e})"));
    if !status.success() {
        panic!("flash-attn3: nvcc failed to compile kernels/smem_table.cpp ({status})");
    }
    let out = Command::new(&exe)
        .output()
        .unwrap_or_else(|e| panic!("flash-attn3: could not run {} ({e})", exe.display()));
    if !out.status.success() {
        panic!("flash-attn3: {} failed ({})", exe.display(), out.status);
    }
    std::fs::write(out_dir.join("smem_table.rs"), out.stdout).expect("writing smem_table.rs");
}
