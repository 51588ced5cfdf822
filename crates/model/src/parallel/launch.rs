//! One process per GPU rank, as torchrun does: the launcher starts the running program once per
//! rank with the same arguments and the rank and group id in the environment, then watches them;
//! each rank process joins the group and does its share.
//!
//! Processes rather than threads: threads of one process share the CUDA driver's locks while
//! they launch candle's many small kernels (measured: data-parallel training on 4 H200s reached
//! 0.61 of 4x one GPU's tokens/s with a thread per GPU, 0.76 with a process per GPU).

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};

/// The rank of a rank process (unset in the launcher and in single-process runs).
pub const RANK_ENV: &str = "FLASH_LLAMA_RANK";
/// The group's id (an NCCL unique id, hex) in a rank process.
pub const GROUP_ID_ENV: &str = "FLASH_LLAMA_GROUP_ID";

/// This process's rank if it is a rank process started by [`launch_ranks`].
pub fn rank_from_env() -> Result<Option<usize>> {
    match std::env::var(RANK_ENV) {
        Ok(r) => Ok(Some(
            r.parse().with_context(|| format!("{RANK_ENV}={r:?} is not a rank"))?,
        )),
        Err(_) => Ok(None),
    }
}

/// Whether this process prints: single-process runs and rank 0 do, other ranks only report
/// their errors.
pub fn is_main_process() -> bool {
    !matches!(rank_from_env(), Ok(Some(r)) if r != 0)
}

/// Runs this program's command line again as ranks 0..world, each with [`RANK_ENV`] and
/// [`GROUP_ID_ENV`] = `group_id` set, and waits for all. If one fails, the others are stopped
/// (they would wait for it in their next collective) and the error names it.
pub fn launch_ranks(world: usize, group_id: &str) -> Result<()> {
    let exe = std::env::current_exe().context("locating this executable to start the ranks")?;
    let mut children: Vec<(usize, Child)> = Vec::new();
    let stop_all = |children: &mut Vec<(usize, Child)>| {
        for (_, c) in children.iter_mut() {
            let _ = c.kill();
        }
    };
    for rank in 0..world {
        let spawned = Command::new(&exe)
            .args(std::env::args_os().skip(1))
            .env(RANK_ENV, rank.to_string())
            .env(GROUP_ID_ENV, group_id)
            // Every rank computes the same results: rank 0's output is the program's.
            .stdout(if rank == 0 { Stdio::inherit() } else { Stdio::null() })
            .spawn()
            .with_context(|| format!("starting rank {rank} ({})", exe.display()));
        match spawned {
            Ok(c) => children.push((rank, c)),
            Err(e) => {
                stop_all(&mut children);
                return Err(e);
            }
        }
    }
    let mut failed = None;
    while !children.is_empty() {
        let mut i = 0;
        while i < children.len() {
            match children[i].1.try_wait()? {
                None => i += 1,
                Some(status) => {
                    let (rank, _) = children.swap_remove(i);
                    if !status.success() && failed.is_none() {
                        failed = Some((rank, status));
                        stop_all(&mut children);
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    match failed {
        Some((rank, status)) => bail!("rank {rank} of {world} failed ({status}); the other ranks were stopped"),
        None => Ok(()),
    }
}

/// The launcher side on GPUs: a new NCCL group of `world` ranks, one process each (an error
/// if the machine has fewer GPUs).
#[cfg(feature = "nccl")]
pub fn launch_gpu_ranks(world: usize) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::CudaContext;
    let count = CudaContext::device_count().map_err(|e| anyhow::anyhow!("counting the GPUs: {e:?}"))? as usize;
    if count < world {
        bail!("{world} GPU ranks: this machine has {count} GPU(s)")
    }
    launch_ranks(world, &super::NcclId::new()?.to_hex())
}

/// The rank side on GPUs: this process's rank, its GPU (`cuda:rank`) and its handle of the NCCL
/// group named in the environment (joining blocks until every rank has joined).
#[cfg(feature = "nccl")]
pub fn join_gpu_group(world: usize) -> Result<(usize, candle_core::Device, super::NcclCommunicator)> {
    let rank = rank_from_env()?.context("not a rank process (no FLASH_LLAMA_RANK)")?;
    if rank >= world {
        bail!("rank {rank} of a group of {world}")
    }
    let id = std::env::var(GROUP_ID_ENV).with_context(|| format!("{GROUP_ID_ENV} is not set"))?;
    let device = candle_core::Device::new_cuda(rank)?;
    let comm = super::NcclCommunicator::new(&device, rank, world, super::NcclId::from_hex(&id)?)?;
    Ok((rank, device, comm))
}
