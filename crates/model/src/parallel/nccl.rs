//! [`Communicator`] over NCCL: one rank per GPU, collectives on candle's stream of the rank's
//! device, so they are ordered with the rank's kernels without any extra synchronisation.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::nccl::safe::{group_end, group_start, Comm, Id, ReduceOp};
use candle_core::cuda_backend::{cudarc, CudaDevice};
use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, DType, Device, Layout, Result, Shape, Tensor};

use super::Communicator;

fn nccl_err(what: &str, e: cudarc::nccl::result::NcclError) -> candle_core::Error {
    candle_core::Error::Msg(format!("NCCL {what} failed: {e:?}"))
}

/// The token that names one group: made once (by rank 0, or by the thread that spawns the
/// ranks) and handed to every rank before [`NcclCommunicator::new`].
#[derive(Debug, Clone, Copy)]
pub struct NcclId(Id);

impl NcclId {
    pub fn new() -> Result<Self> {
        Id::new().map(NcclId).map_err(|e| {
            nccl_err(
                "ncclGetUniqueId (is libnccl.so.2 on the library path? PyTorch's wheel nvidia-nccl has it)",
                e,
            )
        })
    }

    /// The id as 256 hex digits, to hand to rank processes (environment, command line, file).
    pub fn to_hex(&self) -> String {
        self.0.internal().iter().map(|&b| format!("{:02x}", b as u8)).collect()
    }

    /// The id written by [`NcclId::to_hex`].
    pub fn from_hex(hex: &str) -> Result<Self> {
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| hex.get(i..i + 2).and_then(|d| u8::from_str_radix(d, 16).ok()))
            .collect::<Option<_>>()
            .unwrap_or_default();
        let Ok(internal) = <[u8; 128]>::try_from(bytes) else {
            bail!("an NCCL id is 256 hex digits, got {hex:?}")
        };
        Ok(NcclId(Id::uninit(internal.map(|b| b as std::ffi::c_char))))
    }
}

/// One rank of an NCCL group, on candle's stream of its GPU.
pub struct NcclCommunicator {
    /// NCCL allows a communicator to be used from any thread but not from two at once: the
    /// mutex serialises the calls, which makes the handle `Send + Sync` (a model holding it can
    /// move between threads, as the server's models do).
    comm: Mutex<Comm>,
}

// SAFETY: the raw communicator inside `Comm` is only used under the mutex, one call at a time,
// which is what NCCL requires of multi-threaded use; the stream it holds is `Send + Sync`.
unsafe impl Send for NcclCommunicator {}
unsafe impl Sync for NcclCommunicator {}

impl NcclCommunicator {
    /// Joins the group `id` as `rank` of `world_size` on `device` (a CUDA device). Blocks until
    /// every rank has joined, so the ranks must call it concurrently.
    pub fn new(device: &Device, rank: usize, world_size: usize, id: NcclId) -> Result<Self> {
        let Device::Cuda(dev) = device else {
            bail!("NcclCommunicator::new: {device:?} is not a CUDA device")
        };
        if rank >= world_size {
            bail!("NcclCommunicator::new: rank {rank} of a group of {world_size}")
        }
        let comm =
            Comm::from_rank(dev.cuda_stream(), rank, world_size, id.0).map_err(|e| nccl_err("ncclCommInitRank", e))?;
        Ok(Self { comm: Mutex::new(comm) })
    }
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.comm.lock().unwrap().rank()
    }

    fn world_size(&self) -> usize {
        self.comm.lock().unwrap().world_size()
    }

    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        self.run(t, Collective::AllReduceSum)
    }

    fn ring_shift(&self, t: &Tensor) -> Result<Tensor> {
        self.run(t, Collective::RingShift)
    }
}

impl NcclCommunicator {
    fn run(&self, t: &Tensor, kind: Collective) -> Result<Tensor> {
        let comm = self.comm.lock().unwrap();
        if comm.world_size() == 1 {
            return Ok(t.clone());
        }
        t.contiguous()?.apply_op1_no_bwd(&CollectiveOp { comm: &comm, kind })
    }
}

/// What a [`CollectiveOp`] does.
#[derive(Debug, Clone, Copy)]
enum Collective {
    /// ncclAllReduce(sum).
    AllReduceSum,
    /// ncclSend to the next rank and ncclRecv from the previous one, in one NCCL group (so that
    /// neither blocks the other).
    RingShift,
}

impl Collective {
    fn name(self) -> &'static str {
        match self {
            Collective::AllReduceSum => "NCCL all-reduce",
            Collective::RingShift => "NCCL ring shift",
        }
    }
}

/// A collective of a contiguous tensor into a new one, as a candle op so that the result is an
/// ordinary tensor on the same device.
struct CollectiveOp<'a> {
    comm: &'a Comm,
    kind: Collective,
}

impl CollectiveOp<'_> {
    fn run<T>(&self, storage: &CudaStorage, layout: &Layout) -> Result<CudaStorage>
    where
        T: candle_core::cuda_backend::CudaDType + cudarc::nccl::safe::NcclType + cudarc::driver::DeviceRepr,
    {
        let dev: CudaDevice = storage.device().clone();
        let n = layout.shape().elem_count();
        let start = layout.start_offset();
        let src = storage.as_cuda_slice::<T>()?.slice(start..start + n);
        // SAFETY: every element is written by the collective before anything reads it.
        let mut dst = unsafe { dev.alloc::<T>(n) }?;
        match self.kind {
            Collective::AllReduceSum => {
                self.comm
                    .all_reduce(&src, &mut dst, &ReduceOp::Sum)
                    .map_err(|e| nccl_err("ncclAllReduce", e))?;
            }
            Collective::RingShift => {
                let (rank, world) = (self.comm.rank(), self.comm.world_size());
                let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
                group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
                let sent = self.comm.send(&src, next as i32).map_err(|e| nccl_err("ncclSend", e));
                let received = self
                    .comm
                    .recv(&mut dst, prev as i32)
                    .map_err(|e| nccl_err("ncclRecv", e));
                group_end().map_err(|e| nccl_err("ncclGroupEnd", e))?;
                sent?;
                received?;
            }
        }
        Ok(CudaStorage::wrap_cuda_slice(dst, dev))
    }
}

impl CustomOp1 for CollectiveOp<'_> {
    fn name(&self) -> &'static str {
        match self.kind {
            Collective::AllReduceSum => "nccl-all-reduce-sum",
            Collective::RingShift => "nccl-ring-shift",
        }
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!(
            "{} of a CPU tensor: move it to the rank's GPU (or use LocalGroup on the CPU)",
            self.kind.name()
        )
    }

    fn cuda_fwd(&self, storage: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        let what = self.kind.name();
        if !layout.is_contiguous() {
            bail!("{what}: the tensor must be contiguous")
        }
        let out = match storage.dtype() {
            DType::F32 => self.run::<f32>(storage, layout)?,
            DType::BF16 => self.run::<half::bf16>(storage, layout)?,
            DType::F16 => self.run::<half::f16>(storage, layout)?,
            d => bail!("{what}: unsupported dtype {d:?} (f32, bf16 or f16)"),
        };
        Ok((out, layout.shape().clone()))
    }
}
