//! Compiles flash-llama's kernels (kernels/model/ at the workspace root: fused.cu, the inference
//! path; train_ops.cu, the training path) into one sm_90a cubin each when the `cuda` feature is
//! on, as crates/flash-attn/build.rs does for the attention: embedded with `include_bytes!`,
//! loaded at run time through candle's cudarc.

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=NVCC");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let nvcc = find_nvcc();
    let header = manifest.join("../../kernels/model/dtype.cuh");
    println!(
        "cargo:rerun-if-changed={}",
        header.canonicalize().unwrap_or(header).display()
    );
    // Each kernels/model/NAME.cu becomes $OUT_DIR/NAME.cubin.
    for name in ["fused", "train_ops"] {
        let src = manifest.join(format!("../../kernels/model/{name}.cu"));
        let src = src.canonicalize().unwrap_or(src);
        println!("cargo:rerun-if-changed={}", src.display());
        let out = out_dir.join(format!("{name}.cubin"));
        let status = Command::new(&nvcc)
            .args(["-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17"])
            .arg(&src)
            .arg("-o")
            .arg(&out)
            .status()
            .unwrap_or_else(|e| panic!("flash-llama: could not run {} ({e})", nvcc.display()));
        if !status.success() {
            panic!("flash-llama: nvcc failed to compile kernels/model/{name}.cu ({status})");
        }
    }
}

/// nvcc from $NVCC, $CUDA_HOME/bin or the PATH (the same search as flash-attn3's build.rs).
fn find_nvcc() -> PathBuf {
    if let Some(nvcc) = env::var_os("NVCC") {
        return PathBuf::from(nvcc);
    }
    let homes = [env::var_os("CUDA_HOME"), env::var_os("CUDA_PATH")];
    let dirs = homes.into_iter().flatten().map(|h| PathBuf::from(h).join("bin"));
    let path = env::var_os("PATH")
        .map(|p| env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    dirs.chain(path)
        .map(|d| d.join("nvcc"))
        .find(|n| n.exists())
        .unwrap_or_else(|| {
            panic!(
                "flash-llama: the `cuda` feature needs nvcc (CUDA >= 12.3 for sm_90a), found none in $NVCC, \
                 $CUDA_HOME/bin or the PATH. Install a toolkit with scripts/install-cuda-toolkit.sh and export \
                 the CUDA_HOME/PATH lines it prints."
            )
        })
}
