// Shared by the build scripts of flash-attn3 and flash-llama, which `include!` it (a build
// dependency would have to be a crate of its own, for three small functions): finding nvcc,
// compiling kernels/ sources into sm_90a cubins in parallel, and watching the sources for changes.

/// nvcc from $NVCC, $CUDA_HOME/bin, $CUDA_PATH/bin or the PATH; panics with how to install one.
fn find_nvcc(crate_name: &str) -> std::path::PathBuf {
    use std::{env, path::PathBuf};
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
                "{crate_name}: the `cuda` feature needs nvcc (CUDA >= 12.3 for sm_90a), found none in $NVCC, \
                 $CUDA_HOME/bin, $CUDA_PATH/bin or the PATH. Install a toolkit with \
                 scripts/install-cuda-toolkit.sh and export the CUDA_HOME/PATH lines it prints."
            )
        })
}

/// Compiles each (source, cubin) pair with nvcc for sm_90a, all at once (one nvcc process per
/// source), `extra` flags after the common ones; panics naming the source that failed.
fn compile_cubins(crate_name: &str, jobs: &[(std::path::PathBuf, std::path::PathBuf)], extra: &[String]) {
    let nvcc = find_nvcc(crate_name);
    let children: Vec<_> = jobs
        .iter()
        .map(|(src, cubin)| {
            let child = std::process::Command::new(&nvcc)
                .args([
                    "-cubin",
                    "-gencode=arch=compute_90a,code=sm_90a",
                    "-O3",
                    "-std=c++17",
                    "-Xptxas=-warn-spills",
                ])
                .args(extra)
                .arg(src)
                .arg("-o")
                .arg(cubin)
                .spawn()
                .unwrap_or_else(|e| panic!("{crate_name}: could not run {} ({e})", nvcc.display()));
            (src, child)
        })
        .collect();
    for (src, mut child) in children {
        let status = child.wait().expect("waiting for nvcc");
        if !status.success() {
            panic!("{crate_name}: nvcc failed to compile {} ({status})", src.display());
        }
    }
}

/// Registers `dir` and every file under it, so that editing any header rebuilds the cubins.
fn watch(dir: &std::path::Path) {
    println!("cargo:rerun-if-changed={}", dir.display());
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
