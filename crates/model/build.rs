//! Compiles flash-llama's kernels (kernels/model/ at the workspace root: fused.cu, the inference
//! path; linear_rows.cu, its projections of 2-64 tokens; train_ops.cu, the training path; sampling.cu, token sampling on the device) into one sm_90a cubin each when the `cuda` feature is
//! on, as crates/flash-attn/build.rs does for the attention: embedded with `include_bytes!`,
//! loaded at run time through candle's cudarc.

use std::env;
use std::path::PathBuf;

include!("../build-support/nvcc.rs");

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=../build-support/nvcc.rs");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=CUDA_PATH");
    println!("cargo:rerun-if-env-changed=NVCC");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let kernels = manifest.join("../../kernels/model");
    let kernels = kernels.canonicalize().unwrap_or(kernels);
    watch(&kernels);
    // fused.cu and linear_rows.cu include primitives that flash-attn3's kernels share (cp.async, wgmma).
    let primitives = manifest.join("../../kernels/primitives");
    watch(&primitives.canonicalize().unwrap_or(primitives));
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    // Each kernels/model/NAME.cu becomes $OUT_DIR/NAME.cubin.
    let jobs = ["fused", "linear_rows", "train_ops", "sampling"].map(|name| {
        (
            kernels.join(format!("{name}.cu")),
            out_dir.join(format!("{name}.cubin")),
        )
    });
    compile_cubins("flash-llama", &jobs, &[]);
}
