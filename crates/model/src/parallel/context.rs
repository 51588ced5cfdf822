//! Context parallelism: attention over a sequence split across ranks, each holding one
//! consecutive chunk of the queries, keys and values (ring attention).
//!
//! The key/value chunks travel around the ring of ranks ([`Communicator::ring_shift`]); at each
//! of the N steps a rank attends its queries to the chunk it holds with flash-attn3 and merges
//! the partial result into its running output through the log-sum-exps, exactly (in f32). With
//! a causal mask, chunk j is visible to rank r's queries in full when j < r, causally when
//! j = r, and not at all when j > r (those steps only pass the chunk on).
//!
//! The backward runs the same ring: with the merged output and log-sum-exp, flash-attn3's
//! backward of each (queries, chunk) pair gives that pair's exact share of dq, dk and dv (its
//! softmax is normalised by the global log-sum-exp). dq stays on the rank; the dk and dv
//! accumulators travel with their chunk and, after one more step, are back on its rank.
//!
//! Memory per rank is that of its own chunk plus one chunk in flight, whatever the sequence's
//! length: a sequence N times longer than one GPU can attend over fits on N GPUs.

use candle_core::{bail, DType, Result, Tensor};
use flash_attn3::FlashAttn;

use super::Communicator;

/// Ring attention with one scale and, optionally, a causal mask over the whole sequence.
#[derive(Debug, Clone, Copy)]
pub struct RingAttention {
    scale: f32,
    causal: bool,
}

impl RingAttention {
    pub fn new(scale: f32) -> Self {
        Self { scale, causal: false }
    }

    /// Causal over the whole sequence (chunk r holds positions r·chunk ..).
    pub fn causal(self, causal: bool) -> Self {
        Self { causal, ..self }
    }

    /// Whether rank `rank`'s queries see chunk `chunk`, and the mask that pair needs.
    fn pair(&self, rank: usize, chunk: usize) -> Option<FlashAttn> {
        match (self.causal, chunk.cmp(&rank)) {
            (true, std::cmp::Ordering::Greater) => None,
            (true, std::cmp::Ordering::Equal) => Some(FlashAttn::new(self.scale).causal(true)),
            _ => Some(FlashAttn::new(self.scale)),
        }
    }

    fn check(comm: &dyn Communicator, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
        let (_, sq, _, _) = q.dims4()?;
        let (b, sk, hk, _) = k.dims4()?;
        let (bv, sv, hv, _) = v.dims4()?;
        if sq != sk || (b, sk, hk) != (bv, sv, hv) {
            bail!(
                "ring attention: each rank holds one chunk of the sequence, so q, k and v need the same chunk length; got q {:?}, k {:?}, v {:?}",
                q.dims(),
                k.dims(),
                v.dims()
            )
        }
        if comm.world_size() == 0 {
            bail!("ring attention over an empty group")
        }
        Ok(())
    }

    /// This rank's output (batch, chunk, heads, head_dim_v) in q's dtype and log-sum-exp
    /// (batch, heads, chunk, f32) over the whole sequence's keys. Every rank must call it with
    /// its own chunk (all chunks of one length), in the same order as the group's other calls.
    pub fn forward_with_lse(
        &self,
        comm: &dyn Communicator,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        Self::check(comm, q, k, v)?;
        let (rank, world) = (comm.rank(), comm.world_size());
        let (mut k, mut v) = (k.clone(), v.clone());
        let mut acc: Option<(Tensor, Tensor)> = None; // (out f32, lse)
        for step in 0..world {
            let chunk = (rank + world - step) % world;
            if let Some(attn) = self.pair(rank, chunk) {
                let (o, l) = attn.forward_with_lse(q, &k, &v)?;
                let o = o.to_dtype(DType::F32)?;
                acc = Some(match acc {
                    None => (o, l),
                    Some((out, lse)) => merge(&out, &lse, &o, &l)?,
                });
            }
            if step + 1 < world {
                k = comm.ring_shift(&k)?;
                v = comm.ring_shift(&v)?;
            }
        }
        // The rank's own chunk (step 0) is always visible: acc is set.
        let (out, lse) = acc.expect("the diagonal chunk is always attended");
        Ok((out.to_dtype(q.dtype())?, lse))
    }

    /// The gradients (dq, dk, dv) of this rank's chunks, from its inputs, the output and
    /// log-sum-exp of [`RingAttention::forward_with_lse`] and the loss's gradient with respect
    /// to the output. Collective like the forward.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        comm: &dyn Communicator,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        lse: &Tensor,
        grad_out: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        Self::check(comm, q, k, v)?;
        let (rank, world) = (comm.rank(), comm.world_size());
        let (mut k_held, mut v_held) = (k.clone(), v.clone());
        let mut dk_acc = k.zeros_like()?.to_dtype(DType::F32)?;
        let mut dv_acc = v.zeros_like()?.to_dtype(DType::F32)?;
        let mut dq = q.zeros_like()?.to_dtype(DType::F32)?;
        for step in 0..world {
            let chunk = (rank + world - step) % world;
            if let Some(attn) = self.pair(rank, chunk) {
                let (dq_part, dk_part, dv_part) = attn.backward(q, &k_held, &v_held, out, lse, grad_out)?;
                dq = (dq + dq_part.to_dtype(DType::F32)?)?;
                dk_acc = (dk_acc + dk_part.to_dtype(DType::F32)?)?;
                dv_acc = (dv_acc + dv_part.to_dtype(DType::F32)?)?;
            }
            if step + 1 < world {
                k_held = comm.ring_shift(&k_held)?;
                v_held = comm.ring_shift(&v_held)?;
            }
            // The accumulators travel with their chunk; the last shift brings them home.
            dk_acc = comm.ring_shift(&dk_acc)?;
            dv_acc = comm.ring_shift(&dv_acc)?;
        }
        Ok((
            dq.to_dtype(q.dtype())?,
            dk_acc.to_dtype(k.dtype())?,
            dv_acc.to_dtype(v.dtype())?,
        ))
    }
}

/// Two partial attention results over disjoint key sets merged into one: the log-sum-exps add
/// (in log space) and the outputs are averaged with weights exp(lse_i − lse). `out`s are
/// (batch, seq, heads, d) f32, `lse`s (batch, heads, seq) f32, all finite.
fn merge(out_a: &Tensor, lse_a: &Tensor, out_b: &Tensor, lse_b: &Tensor) -> Result<(Tensor, Tensor)> {
    let m = lse_a.maximum(lse_b)?;
    let lse = (&m + ((lse_a - &m)?.exp()? + (lse_b - &m)?.exp()?)?.log()?)?;
    // (batch, heads, seq) -> (batch, seq, heads, 1) to scale the outputs' rows.
    let weight = |l: &Tensor| -> Result<Tensor> { (l - &lse)?.exp()?.transpose(1, 2)?.unsqueeze(3) };
    let out = (out_a.broadcast_mul(&weight(lse_a)?)? + out_b.broadcast_mul(&weight(lse_b)?)?)?;
    Ok((out, lse))
}

/// [`RingAttention`] as a differentiable op: `loss.backward()` through its output runs the
/// ring backward (the group's ranks must all run their backward, as they ran the forward).
/// q, k, v: this rank's chunks (batch, chunk, heads or kv_heads, head_dim).
pub fn ring_attention(ring: RingAttention, group: &super::Group, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    // The forward runs here, on tensors (it needs flash-attn3's calls and the collectives); the
    // custom op only hands its result to candle's graph and brings the backward.
    let (out, lse) = ring.forward_with_lse(group.as_ref(), &q.detach(), &k.detach(), &v.detach())?;
    q.apply_op3_arc(
        &k,
        &v,
        std::sync::Arc::new(Box::new(RingOp {
            ring,
            group: group.clone(),
            out: std::sync::Mutex::new(Some(out)),
            lse,
        })),
    )
}

struct RingOp {
    ring: RingAttention,
    group: super::Group,
    /// The precomputed output until the op's forward hands a copy of it to the graph; then
    /// dropped (the backward reads the graph's copy), so a layer holds its output once.
    out: std::sync::Mutex<Option<Tensor>>,
    lse: Tensor,
}

impl RingOp {
    /// A copy of the precomputed output's storage (the op's "forward", run once).
    fn output(&self) -> Result<(candle_core::Storage, candle_core::Shape)> {
        let Some(out) = self.out.lock().unwrap().take() else {
            bail!("internal error: the ring attention op's forward ran twice")
        };
        let (storage, layout) = out.storage_and_layout();
        Ok((storage.try_clone(layout)?, out.shape().clone()))
    }
}

impl candle_core::CustomOp3 for RingOp {
    fn name(&self) -> &'static str {
        "ring-attention"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        match self.output()? {
            (candle_core::Storage::Cpu(s), shape) => Ok((s, shape)),
            _ => bail!("ring attention: the output is not on the CPU"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &candle_core::Layout,
        _: &candle_core::CudaStorage,
        _: &candle_core::Layout,
        _: &candle_core::CudaStorage,
        _: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        match self.output()? {
            (candle_core::Storage::Cuda(s), shape) => Ok((s, shape)),
            _ => bail!("ring attention: the output is not on the GPU"),
        }
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dq, dk, dv) = self.ring.backward(
            self.group.as_ref(),
            q,
            k,
            v,
            &res.contiguous()?,
            &self.lse,
            &grad_res.contiguous()?,
        )?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}
