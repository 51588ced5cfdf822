//! Compiles the Hopper kernels (kernels/ at the workspace root) into two cubins (forward and
//! backward) when the `cuda` feature is on. The crate embeds them with `include_bytes!` and loads
//! them at run time through candle's cudarc; nothing links against the CUDA runtime.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=FA3_NVCC_FLAGS");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let kernels = manifest.join("../../kernels");
    let kernels = kernels.canonicalize().unwrap_or(kernels);
    println!("cargo:rerun-if-changed={}", kernels.display());
    watch(&kernels);

    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let nvcc = find_nvcc();
    // Extra nvcc flags for experiments: -lineinfo for ncu's source view, -DFA3_TRACE for the
    // forward's timeline (kernels/primitives/trace.cuh).
    let extra: Vec<String> = env::var("FA3_NVCC_FLAGS")
        .map(|f| f.split_whitespace().map(String::from).collect())
        .unwrap_or_default();
    // The forward and the backward are separate cubins, compiled in parallel.
    let jobs: Vec<_> = [
        ("flash_fwd/kernel.cu", "flash_fwd.cubin"),
        ("flash_bwd/kernel.cu", "flash_bwd.cubin"),
    ]
    .into_iter()
    .map(|(src, cubin)| {
        let child = Command::new(&nvcc)
            .args([
                "-cubin",
                "-gencode=arch=compute_90a,code=sm_90a",
                "-O3",
                "-std=c++17",
                "-Xptxas=-warn-spills",
            ])
            .args(&extra)
            .arg(kernels.join(src))
            .arg("-o")
            .arg(out_dir.join(cubin))
            .spawn()
            .unwrap_or_else(|e| panic!("flash-attn3: could not run {} ({e})", nvcc.display()));
        (src, child)
    })
    .collect();
    for (src, mut child) in jobs {
        let status = child.wait().expect("flash-attn3: waiting for nvcc");
        if !status.success() {
            panic!("flash-attn3: nvcc failed to compile kernels/{src} ({status})");
        }
    }
}

/// Registers every file under `dir` so that editing a header rebuilds the cubin.
fn watch(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                watch(&path);
            } else {
                println!("cargo:rerun-if-changed={}", path.display());
            }
        }
    }
}

/// nvcc from $NVCC, $CUDA_HOME/bin or the PATH.
fn find_nvcc() -> PathBuf {
    if let Some(nvcc) = env::var_os("NVCC") {
        return PathBuf::from(nvcc);
    }
    if let Some(home) = env::var_os("CUDA_HOME").or_else(|| env::var_os("CUDA_PATH")) {
        let nvcc = PathBuf::from(home).join("bin/nvcc");
        if nvcc.exists() {
            return nvcc;
        }
    }
    if let Some(path) = env::var_os("PATH") {
        for dir in env::split_paths(&path) {
            let nvcc = dir.join("nvcc");
            if nvcc.exists() {
                return nvcc;
            }
        }
    }
    panic!(
        "flash-attn3: the `cuda` feature needs nvcc (CUDA >= 12.3 for sm_90a), found none in $NVCC, \
         $CUDA_HOME/bin or the PATH. Install a toolkit with scripts/install-cuda-toolkit.sh and export \
         the CUDA_HOME/PATH lines it prints."
    )
}
