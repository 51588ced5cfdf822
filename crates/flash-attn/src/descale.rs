//! FP8 (e4m3) attention calls: the descales a caller gives ([`crate::FlashAttn::descale`]),
//! checked against the call's shapes and read in place (the kernels index them by strides).
//!
//! A descale turns an e4m3 value back into the value it stands for (x = e4m3 · descale). The
//! kernels fold q's and k's into the softmax scale and v's into the output normalisation, so a
//! descale is constant over the rows one kernel tile touches at once:
//! - q: (batch, kv_heads) as FA3 takes them, (batch, heads), or per block of
//!   [`Q_BLOCK_ROWS`] query rows (batch, heads, ceil(seqlen_q / 64)),
//! - k: (batch, kv_heads), or per block of [`K_BLOCK_ROWS`] keys (batch, kv_heads, ceil(seqlen_k / 128)),
//! - v: (batch, kv_heads),
//!
//! where batch may be 1 (shared by every sequence) and per-block forms need fixed-length inputs.
//! [`crate::fp8::quantize`] returns its descales in these shapes.

use candle_core::{bail, DType, Device, Result, Tensor};

use crate::fp8::{K_BLOCK_ROWS, Q_BLOCK_ROWS};
use crate::params::Dims;

/// The descales as the builder holds them: absent means 1.0.
#[derive(Debug, Clone, Default)]
pub(crate) struct Descales {
    pub q: Option<Tensor>,
    pub k: Option<Tensor>,
    pub v: Option<Tensor>,
}

/// An fp8 call's descales as the kernels read them: the caller's tensors, reshaped (a view, no
/// copy) to q (batch or 1, heads or kv_heads, q_blocks.max(1)), k (batch or 1, kv_heads,
/// k_blocks.max(1)), v (batch or 1, kv_heads), absent meaning 1.0. The kernels index them with
/// the strides below, so a call launches nothing for its descales, and a call captured in a CUDA
/// graph holds no buffer made during the capture (a broadcast copy made there would be freed
/// after it while the replays still read it).
#[derive(Debug, Clone)]
pub(crate) struct Fp8Call {
    pub q_descale: Option<Tensor>,
    pub k_descale: Option<Tensor>,
    pub v_descale: Option<Tensor>,
    /// q's descale is one per kv head, shared by the q heads of its group (FA3's form).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub q_per_kv_head: bool,
    /// Per-block descales: blocks per (batch, head); 0 means one per (batch, head).
    pub q_blocks: usize,
    pub k_blocks: usize,
    /// bf16 or f16.
    pub out_dtype: DType,
}

impl Fp8Call {
    /// Checks the descales and the output dtype of an fp8 call with these shapes.
    pub fn new(
        descales: &Descales,
        out_dtype: Option<DType>,
        dims: &Dims,
        varlen: bool,
        device: &Device,
    ) -> Result<Self> {
        for (name, d) in [("q/k", dims.head_dim), ("v", dims.head_dim_v)] {
            if d % 16 != 0 {
                bail!("flash-attn3: fp8 attention needs head dims that are multiples of 16, got {name} head dim {d}")
            }
        }
        let out_dtype = match out_dtype.unwrap_or(DType::BF16) {
            dt @ (DType::BF16 | DType::F16) => dt,
            dt => bail!("flash-attn3: the output of fp8 attention is bf16 or f16, got out_dtype {dt:?}"),
        };
        let (batch, heads, kv_heads) = (dims.batch, dims.heads, dims.kv_heads);
        let q_blocks = dims.seqlen_q.div_ceil(Q_BLOCK_ROWS);
        let k_blocks = dims.seqlen_k.div_ceil(K_BLOCK_ROWS);
        // (A caller's strided descale is copied here; a contiguous one, the usual case, is not.)
        let compact = |t: &Tensor, shape: (usize, usize, usize)| t.contiguous()?.reshape(shape);

        let (q_descale, q_per_block, q_per_kv_head) = match &descales.q {
            None => (None, false, false),
            Some(t) => {
                let b = check_descale("q", t, batch, device)?;
                match t.dims()[1..] {
                    [h] if h == kv_heads => (Some(compact(t, (b, kv_heads, 1))?), false, true),
                    [h] if h == heads => (Some(compact(t, (b, heads, 1))?), false, false),
                    [h, n] if h == heads && n == q_blocks && !varlen => (Some(compact(t, (b, h, n))?), true, false),
                    _ => bail!(
                        "flash-attn3: q_descale must be (batch, kv_heads) = ({batch}, {kv_heads}), (batch, heads) = ({batch}, {heads}) or, per block of {Q_BLOCK_ROWS} queries of a fixed-length call, (batch, heads, ceil(seqlen_q / {Q_BLOCK_ROWS})) = ({batch}, {heads}, {q_blocks}); batch may be 1; got {:?}",
                        t.dims()
                    ),
                }
            }
        };
        let (k_descale, k_per_block) = match &descales.k {
            None => (None, false),
            Some(t) => {
                let b = check_descale("k", t, batch, device)?;
                match t.dims()[1..] {
                    [h] if h == kv_heads => (Some(compact(t, (b, kv_heads, 1))?), false),
                    [h, n] if h == kv_heads && n == k_blocks && !varlen => (Some(compact(t, (b, h, n))?), true),
                    _ => bail!(
                        "flash-attn3: k_descale must be (batch, kv_heads) = ({batch}, {kv_heads}) or, per block of {K_BLOCK_ROWS} keys of a fixed-length call, (batch, kv_heads, ceil(seqlen_k / {K_BLOCK_ROWS})) = ({batch}, {kv_heads}, {k_blocks}); batch may be 1; got {:?}",
                        t.dims()
                    ),
                }
            }
        };
        let v_descale = match &descales.v {
            None => None,
            Some(t) => {
                let b = check_descale("v", t, batch, device)?;
                if t.dims()[1..] != [kv_heads] {
                    bail!(
                        "flash-attn3: v_descale must be (batch, kv_heads) = ({batch}, {kv_heads}) (batch may be 1): the output's scale is one per kv head; got {:?}",
                        t.dims()
                    )
                }
                Some(t.contiguous()?.reshape((b, kv_heads))?)
            }
        };
        Ok(Self {
            q_descale,
            k_descale,
            v_descale,
            q_per_kv_head,
            q_blocks: if q_per_block { q_blocks } else { 0 },
            k_blocks: if k_per_block { k_blocks } else { 0 },
            out_dtype,
        })
    }

    /// Every q head of a GQA group has the same descale, so a tile may hold the whole group
    /// (pack-GQA): q's descale absent or one per kv head.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn q_shared_by_group(&self) -> bool {
        self.q_descale.is_none() || self.q_per_kv_head
    }

    /// Elements between two sequences' descales in `t`: 0 where one value serves every sequence
    /// (absent, or a first dimension of 1).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn batch_stride(t: Option<&Tensor>) -> usize {
        match t {
            Some(t) if t.dim(0).unwrap_or(1) > 1 => t.elem_count() / t.dims()[0],
            _ => 0,
        }
    }

    /// One descale tensor in the (batch, heads, blocks.max(1)) shape the CPU path reads: `t`
    /// broadcast over the batch, over the group's q heads where it holds one per kv head, ones
    /// where absent.
    fn expanded(t: Option<&Tensor>, batch: usize, heads: usize, group: usize, blocks: usize) -> Result<Tensor> {
        let blocks = blocks.max(1);
        let Some(t) = t else {
            return Tensor::ones((batch, heads, blocks), DType::F32, &Device::Cpu);
        };
        let t = t.to_device(&Device::Cpu)?;
        let t = t.reshape((t.dim(0)?, (), blocks))?;
        let t = match t.dim(1)? {
            h if h == heads => t,
            kv => t.unsqueeze(2)?.broadcast_as((t.dim(0)?, kv, group, blocks))?.reshape((
                t.dim(0)?,
                kv * group,
                blocks,
            ))?,
        };
        t.broadcast_as((batch, heads, blocks))?.contiguous()
    }

    /// The dequantised inputs in f32 (x = e4m3 · descale, exact): the CPU path runs the f32
    /// attention on them, which makes it the reference of every fp8 kernel case.
    /// `cu_q` / `cu_k`: the sequences' token offsets (fixed-length calls: b · seqlen).
    pub fn dequantize(
        &self,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        dims: &Dims,
        cu_q: &[usize],
        cu_k: &[usize],
    ) -> Result<(Tensor, Tensor, Tensor)> {
        // Per token and head: (tokens, heads) factors from the (batch, heads, blocks) descales.
        let per_token = |descale: &Tensor, heads: usize, blocks: usize, rows: usize, cu: &[usize]| -> Result<Tensor> {
            let descale = descale
                .reshape((dims.batch, heads, blocks.max(1)))?
                .to_device(&Device::Cpu)?;
            let values = descale.to_vec3::<f32>()?;
            let tokens = cu[cu.len() - 1];
            let mut out = Vec::with_capacity(tokens * heads);
            for (b, w) in cu.windows(2).enumerate() {
                for i in 0..w[1] - w[0] {
                    let block = if blocks > 0 { i / rows } else { 0 };
                    out.extend((0..heads).map(|h| values[b][h][block]));
                }
            }
            Tensor::from_vec(out, (tokens, heads, 1), &Device::Cpu)
        };
        let scale = |x: &Tensor, factors: Tensor| -> Result<Tensor> {
            let x32 = x.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
            let flat = x32.reshape(((), x32.dim(x32.rank() - 2)?, x32.dim(x32.rank() - 1)?))?;
            flat.broadcast_mul(&factors)?.reshape(x.shape())?.to_device(x.device())
        };
        let group = dims.heads / dims.kv_heads;
        let qd = Self::expanded(self.q_descale.as_ref(), dims.batch, dims.heads, group, self.q_blocks)?;
        let kd = Self::expanded(self.k_descale.as_ref(), dims.batch, dims.kv_heads, 1, self.k_blocks)?;
        let vd = Self::expanded(self.v_descale.as_ref(), dims.batch, dims.kv_heads, 1, 0)?;
        let qf = per_token(&qd, dims.heads, self.q_blocks, Q_BLOCK_ROWS, cu_q)?;
        let kf = per_token(&kd, dims.kv_heads, self.k_blocks, K_BLOCK_ROWS, cu_k)?;
        let vf = per_token(&vd, dims.kv_heads, 0, 1, cu_k)?;
        Ok((scale(q, qf)?, scale(k, kf)?, scale(v, vf)?))
    }
}

/// A descale tensor's dtype, device and leading (batch) dimension; returns that batch.
fn check_descale(name: &str, t: &Tensor, batch: usize, device: &Device) -> Result<usize> {
    if t.dtype() != DType::F32 {
        bail!("flash-attn3: {name}_descale must be f32, got {:?}", t.dtype())
    }
    if !t.device().same_device(device) {
        bail!(
            "flash-attn3: {name}_descale must be on the device of q ({:?}), got {:?}{}",
            device.location(),
            t.device().location(),
            crate::params::same_gpu_note(device, t.device())
        )
    }
    if !matches!(t.rank(), 2 | 3) {
        bail!(
            "flash-attn3: {name}_descale must have rank 2 (batch, heads) or 3 (batch, heads, blocks), got shape {:?}",
            t.dims()
        )
    }
    let b = t.dim(0)?;
    if b != batch && b != 1 {
        bail!(
            "flash-attn3: {name}_descale's first dimension must be the batch ({batch}) or 1, got shape {:?}",
            t.dims()
        )
    }
    Ok(b)
}
