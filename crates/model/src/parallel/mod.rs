//! Collective communication between ranks (one model replica or shard per rank), for data-,
//! tensor- and context-parallel runs.
//!
//! - [`Communicator`]: what the rest of the crate needs from a group of ranks: an all-reduce and a
//!   ring shift; [`Group`] is a shared handle of one.
//! - [`LocalGroup`]: ranks as threads of one process exchanging tensors through shared memory.
//!   It is exact and deterministic, runs on every device (CPU included), and stands in for NCCL
//!   in tests and CPU runs: the training loop cannot tell the two apart.
//! - `NcclCommunicator` (feature `nccl`): one rank per GPU through NCCL (cudarc's bindings, as
//!   candle's own multi-process example uses), on candle's stream of the rank's device.
//! - [`all_reduce_sum_bucketed`]: many tensors (a model's gradients) reduced in a few large
//!   collectives instead of one per tensor.
//! - [`tensor`]: tensor-parallel inference (each rank a slice of every layer).
//! - [`context`]: context-parallel (ring) attention (each rank a slice of the sequence).
//! - [`launch`]: one process per GPU rank (the launcher side and the rank side).

use std::sync::{Arc, Barrier, Mutex};

use candle_core::{bail, DType, Result, Tensor};

pub mod context;
pub mod launch;
#[cfg(feature = "nccl")]
mod nccl;
pub mod tensor;
#[cfg(feature = "nccl")]
pub use nccl::{NcclCommunicator, NcclId};

/// A group as a model holds it: shared by its clones and threads (tensor parallelism, ring
/// attention).
pub type Group = Arc<dyn Communicator + Send + Sync>;

/// A group of `world_size` ranks; every rank holds one of these and calls the collectives in the
/// same order as the others (a collective returns once every rank has joined it).
pub trait Communicator {
    /// This rank, from 0.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world_size(&self) -> usize;
    /// The element-wise sum over all ranks of `t` (same shape and dtype on every rank). Every
    /// rank receives the same values, bit for bit, so replicas that apply it stay identical.
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor>;
    /// Passes tensors one step around the ring of ranks: sends `t` to rank `rank + 1` and
    /// returns what rank `rank - 1` sent (modulo the group's size; same shape and dtype on every
    /// rank). Context parallelism moves key/value blocks this way.
    fn ring_shift(&self, t: &Tensor) -> Result<Tensor>;
    /// Starts summing each of `tensors` (one dtype) over all ranks and returns the sums, which
    /// the rank's later work may go on without: NCCL runs them on a stream of their own, so
    /// they overlap the kernels queued after them (a backward's remaining layers), and readers
    /// of the sums wait for them. Every started sum is complete after
    /// [`Communicator::finish_all_reduces`], which each rank calls before its next collective
    /// of another kind. Backends without a second queue (the default) sum at once, in buckets.
    fn start_all_reduce_sum(&self, tensors: &[Tensor]) -> Result<Vec<Tensor>> {
        all_reduce_sum_bucketed(self, tensors, DEFAULT_BUCKET_BYTES)
    }
    /// Makes the rank's own queue wait for every sum [`Communicator::start_all_reduce_sum`]
    /// started (it does not wait on the host).
    fn finish_all_reduces(&self) -> Result<()> {
        Ok(())
    }
}

/// The bucket of [`Communicator::start_all_reduce_sum`]'s default (a collective of this size
/// runs near the link's bandwidth).
pub const DEFAULT_BUCKET_BYTES: usize = 128 << 20;

/// A shared handle is the group it points to.
impl<C: Communicator + ?Sized> Communicator for Arc<C> {
    fn rank(&self) -> usize {
        self.as_ref().rank()
    }

    fn world_size(&self) -> usize {
        self.as_ref().world_size()
    }

    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        self.as_ref().all_reduce_sum(t)
    }

    fn ring_shift(&self, t: &Tensor) -> Result<Tensor> {
        self.as_ref().ring_shift(t)
    }

    fn start_all_reduce_sum(&self, tensors: &[Tensor]) -> Result<Vec<Tensor>> {
        self.as_ref().start_all_reduce_sum(tensors)
    }

    fn finish_all_reduces(&self) -> Result<()> {
        self.as_ref().finish_all_reduces()
    }
}

/// The dtype shared by `tensors` (at least one), or an error naming the collective `what`.
pub(crate) fn one_dtype(what: &str, tensors: &[Tensor]) -> Result<DType> {
    let dtype = tensors[0].dtype();
    match tensors.iter().find(|t| t.dtype() != dtype) {
        Some(t) => bail!("{what}: tensors of two dtypes ({dtype:?} and {:?})", t.dtype()),
        None => Ok(dtype),
    }
}

/// Sums `tensors` over all ranks, packed into buckets of at most `bucket_bytes` (each tensor
/// whole, one collective per bucket): one large all-reduce runs near the link's bandwidth where
/// hundreds of small ones would pay their latency each. Returns the sums in `tensors`' order and
/// shapes. All tensors must have one dtype and device.
pub fn all_reduce_sum_bucketed<C: Communicator + ?Sized>(
    comm: &C,
    tensors: &[Tensor],
    bucket_bytes: usize,
) -> Result<Vec<Tensor>> {
    if comm.world_size() == 1 || tensors.is_empty() {
        return Ok(tensors.to_vec());
    }
    let dtype = one_dtype("all_reduce_sum_bucketed", tensors)?;
    let mut out = Vec::with_capacity(tensors.len());
    let mut start = 0;
    while start < tensors.len() {
        // The bucket: tensors[start..end], at least one tensor, at most bucket_bytes unless one
        // tensor alone is larger.
        let mut end = start + 1;
        let mut bytes = tensors[start].elem_count() * dtype.size_in_bytes();
        while end < tensors.len() {
            let next = tensors[end].elem_count() * dtype.size_in_bytes();
            if bytes + next > bucket_bytes {
                break;
            }
            bytes += next;
            end += 1;
        }
        let flat: Vec<Tensor> = tensors[start..end]
            .iter()
            .map(|t| t.flatten_all())
            .collect::<Result<_>>()?;
        let summed = comm.all_reduce_sum(&Tensor::cat(&flat, 0)?)?;
        let mut offset = 0;
        for t in &tensors[start..end] {
            let n = t.elem_count();
            out.push(summed.narrow(0, offset, n)?.reshape(t.shape())?);
            offset += n;
        }
        start = end;
    }
    Ok(out)
}

/// Sums one f32 value over all ranks (losses, counts), read back to the host.
pub fn all_reduce_scalar(comm: &dyn Communicator, value: f32, like: &Tensor) -> Result<f32> {
    if comm.world_size() == 1 {
        return Ok(value);
    }
    let t = Tensor::new(&[value], like.device())?;
    comm.all_reduce_sum(&t)?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()
        .map(|v| v[0])
}

/// Ranks that are threads of one process, meeting in shared memory. [`LocalGroup::new`] makes
/// the handles of all ranks; move one into each rank's thread.
///
/// An all-reduce deposits each rank's tensor, waits for all of them, and has every rank add the
/// deposits in rank order, so each gets the same bits (the sum is computed once per rank:
/// redundant work, nothing shared to race on).
///
/// On a GPU the ranks share one device, but not one stream: candle queues each thread's work on
/// that thread's own stream. The collectives order the ranks' work themselves; a tensor handed
/// between threads otherwise (inputs made before the ranks start, results read after) needs
/// `Device::synchronize` on the thread that wrote it first.
pub struct LocalGroup {
    rank: usize,
    shared: Arc<LocalShared>,
}

struct LocalShared {
    world_size: usize,
    barrier: Barrier,
    slots: Mutex<Vec<Option<Tensor>>>,
}

impl LocalGroup {
    /// The handles of a group of `world_size` ranks, rank 0 first.
    pub fn new(world_size: usize) -> Result<Vec<LocalGroup>> {
        if world_size == 0 {
            bail!("a group needs at least one rank")
        }
        let shared = Arc::new(LocalShared {
            world_size,
            barrier: Barrier::new(world_size),
            slots: Mutex::new(vec![None; world_size]),
        });
        Ok((0..world_size)
            .map(|rank| LocalGroup {
                rank,
                shared: shared.clone(),
            })
            .collect())
    }
}

impl Communicator for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        self.exchange(t, "all_reduce_sum", |parts| {
            let mut sum = parts[0].to_device(t.device())?;
            for p in &parts[1..] {
                sum = (sum + p.to_device(t.device())?)?;
            }
            Ok(sum)
        })
    }

    fn ring_shift(&self, t: &Tensor) -> Result<Tensor> {
        let world = self.shared.world_size;
        // A copy: the sender may keep using its tensor.
        self.exchange(t, "ring_shift", |parts| {
            parts[(self.rank + world - 1) % world].to_device(t.device())?.copy()
        })
    }
}

impl LocalGroup {
    /// Deposits `t`; once every rank's deposit is in, runs `take` on them all (in rank order)
    /// and returns its result after every rank has taken. An error on every rank if the
    /// deposits differ in shape or dtype (`what` names the collective).
    ///
    /// On a GPU, candle queues each thread's work on a stream of that thread's own (CUDA's
    /// per-thread default stream), so the ranks' streams are not ordered with each other: each
    /// rank finishes its stream's work before depositing (the others read `t`) and after
    /// `take` (the others may then drop or overwrite their deposits).
    fn exchange<R>(&self, t: &Tensor, what: &str, take: impl FnOnce(&[Tensor]) -> Result<R>) -> Result<R> {
        let s = &self.shared;
        if s.world_size == 1 {
            return take(std::slice::from_ref(t));
        }
        // Every rank passes both barriers whatever fails, or the others would wait forever.
        let ready = t.device().synchronize();
        s.slots.lock().unwrap()[self.rank] = Some(t.clone());
        s.barrier.wait();
        let parts: Vec<Tensor> = s.slots.lock().unwrap().iter().flatten().cloned().collect();
        let result = ready.and_then(|()| {
            if let Some(p) = parts.iter().find(|p| p.shape() != t.shape() || p.dtype() != t.dtype()) {
                bail!(
                    "{what}: rank {} has {:?} {:?}, another rank {:?} {:?}",
                    self.rank,
                    t.dtype(),
                    t.shape(),
                    p.dtype(),
                    p.shape()
                )
            }
            let r = take(&parts)?;
            t.device().synchronize()?;
            Ok(r)
        });
        // Nobody deposits the next collective's tensor before every rank has taken this one's.
        s.barrier.wait();
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn run_ranks<T: Send>(world: usize, f: impl Fn(LocalGroup) -> T + Sync) -> Vec<T> {
        let groups = LocalGroup::new(world).unwrap();
        std::thread::scope(|s| {
            let handles: Vec<_> = groups.into_iter().map(|g| s.spawn(|| f(g))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn local_all_reduce_sums_and_every_rank_gets_the_same_bits() {
        let out = run_ranks(3, |g| {
            let r = g.rank() as f32;
            let t = Tensor::new(&[[1.0f32 + r, 0.1 * r], [r * r, -r]], &Device::Cpu).unwrap();
            // Two collectives in a row: the second must not see the first's deposits.
            let a = g.all_reduce_sum(&t).unwrap().to_vec2::<f32>().unwrap();
            let b = g.all_reduce_sum(&(t * 2.0).unwrap()).unwrap().to_vec2::<f32>().unwrap();
            (a, b)
        });
        let expect = vec![vec![6.0f32, 0.1 + 0.2], vec![5.0, -3.0]];
        for (a, b) in &out {
            for (row, e) in a.iter().zip(&expect) {
                for (x, y) in row.iter().zip(e) {
                    assert!((x - y).abs() < 1e-6, "{a:?} vs {expect:?}");
                }
            }
            assert_eq!(b[0][0], 12.0);
            assert_eq!(a, &out[0].0, "ranks disagree");
        }
    }

    #[test]
    fn bucketed_all_reduce_keeps_order_and_shapes() {
        let out = run_ranks(2, |g| {
            let r = g.rank() as f32 + 1.0;
            let ts = vec![
                Tensor::full(r, (2, 3), &Device::Cpu).unwrap(),
                Tensor::full(10.0 * r, 5, &Device::Cpu).unwrap(),
                Tensor::full(100.0 * r, (1, 2, 2), &Device::Cpu).unwrap(),
            ];
            // 24 bytes per bucket: the 6-element tensor alone, then the 5 (a bucket each).
            all_reduce_sum_bucketed(&g, &ts, 24).unwrap()
        });
        for sums in out {
            assert_eq!(sums[0].dims(), &[2, 3]);
            assert_eq!(sums[1].dims(), &[5]);
            assert_eq!(sums[2].dims(), &[1, 2, 2]);
            assert_eq!(sums[0].flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![3.0; 6]);
            assert_eq!(sums[1].to_vec1::<f32>().unwrap(), vec![30.0; 5]);
            assert_eq!(sums[2].flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![300.0; 4]);
        }
    }

    #[test]
    fn bucketed_all_reduce_of_two_dtypes_is_an_error_on_every_rank() {
        let out = run_ranks(2, |g| {
            let ts = vec![
                Tensor::ones(3, DType::F32, &Device::Cpu).unwrap(),
                Tensor::ones(3, DType::BF16, &Device::Cpu).unwrap(),
            ];
            // Checked before any collective: no rank waits for the other.
            all_reduce_sum_bucketed(&g, &ts, 1 << 20).unwrap_err().to_string()
        });
        for e in out {
            assert!(
                e.contains("all_reduce_sum_bucketed: tensors of two dtypes (F32 and BF16)"),
                "{e}"
            );
        }
    }

    #[test]
    fn ring_shift_passes_to_the_next_rank() {
        let out = run_ranks(3, |g| {
            let t = Tensor::full(g.rank() as f32, 4, &Device::Cpu).unwrap();
            let once = g.ring_shift(&t).unwrap();
            let twice = g.ring_shift(&once).unwrap();
            (once.to_vec1::<f32>().unwrap()[0], twice.to_vec1::<f32>().unwrap()[0])
        });
        assert_eq!(out, vec![(2.0, 1.0), (0.0, 2.0), (1.0, 0.0)]);
    }

    #[test]
    fn mismatched_shapes_are_an_error_on_every_rank() {
        let out = run_ranks(2, |g| {
            let t = Tensor::zeros(2 + g.rank(), DType::F32, &Device::Cpu).unwrap();
            g.all_reduce_sum(&t).map(|_| ()).map_err(|e| e.to_string())
        });
        for r in out {
            assert!(r.unwrap_err().contains("another rank"));
        }
    }
}
