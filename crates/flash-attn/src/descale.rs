//! FP8 (e4m3) attention calls: the descales a caller gives ([`crate::FlashAttn::descale`]),
//! checked against the call's shapes and brought into the one layout every path reads.
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

/// An fp8 call's descales in the layout the kernels read: contiguous f32 on the inputs' device,
/// q (batch, heads, q_blocks.max(1)), k (batch, kv_heads, k_blocks.max(1)), v (batch, kv_heads).
#[derive(Debug, Clone)]
pub(crate) struct Fp8Call {
    pub q_descale: Tensor,
    pub k_descale: Tensor,
    pub v_descale: Tensor,
    /// Per-block descales: blocks per (batch, head); 0 means one per (batch, head).
    pub q_blocks: usize,
    pub k_blocks: usize,
    /// Every q head of a GQA group has the same descale, so a tile may hold the whole group
    /// (pack-GQA): true for FA3's (batch, kv_heads) form.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub q_shared_by_group: bool,
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
        let ones = |shape: &[usize]| Tensor::ones(shape, DType::F32, device);

        let (q_descale, q_per_block, q_shared_by_group) = match &descales.q {
            None => (ones(&[batch, heads, 1])?, false, true),
            Some(t) => {
                let b = check_descale("q", t, batch, device)?;
                let t = t.clone();
                match t.dims()[1..] {
                    [h] if h == kv_heads => {
                        let group = heads / kv_heads;
                        let t = t.reshape((b, kv_heads, 1))?.broadcast_as((b, kv_heads, group))?;
                        (t.reshape((b, heads, 1))?, false, true)
                    }
                    [h] if h == heads => (t.reshape((b, heads, 1))?, false, false),
                    [h, n] if h == heads && n == q_blocks && !varlen => (t, true, false),
                    _ => bail!(
                        "flash-attn3: q_descale must be (batch, kv_heads) = ({batch}, {kv_heads}), (batch, heads) = ({batch}, {heads}) or, per block of {Q_BLOCK_ROWS} queries of a fixed-length call, (batch, heads, ceil(seqlen_q / {Q_BLOCK_ROWS})) = ({batch}, {heads}, {q_blocks}); batch may be 1; got {:?}",
                        t.dims()
                    ),
                }
            }
        };
        let (k_descale, k_per_block) = match &descales.k {
            None => (ones(&[batch, kv_heads, 1])?, false),
            Some(t) => {
                let b = check_descale("k", t, batch, device)?;
                let t = t.clone();
                match t.dims()[1..] {
                    [h] if h == kv_heads => (t.reshape((b, kv_heads, 1))?, false),
                    [h, n] if h == kv_heads && n == k_blocks && !varlen => (t, true),
                    _ => bail!(
                        "flash-attn3: k_descale must be (batch, kv_heads) = ({batch}, {kv_heads}) or, per block of {K_BLOCK_ROWS} keys of a fixed-length call, (batch, kv_heads, ceil(seqlen_k / {K_BLOCK_ROWS})) = ({batch}, {kv_heads}, {k_blocks}); batch may be 1; got {:?}",
                        t.dims()
                    ),
                }
            }
        };
        let v_descale = match &descales.v {
            None => ones(&[batch, kv_heads])?,
            Some(t) => {
                let b = check_descale("v", t, batch, device)?;
                let t = t.clone();
                if t.dims()[1..] != [kv_heads] {
                    bail!(
                        "flash-attn3: v_descale must be (batch, kv_heads) = ({batch}, {kv_heads}) (batch may be 1): the output's scale is one per kv head; got {:?}",
                        t.dims()
                    )
                }
                t.reshape((b, kv_heads))?
            }
        };
        let expand = |t: Tensor| -> Result<Tensor> {
            let mut shape = t.dims().to_vec();
            shape[0] = batch;
            t.broadcast_as(shape)?.contiguous()
        };
        Ok(Self {
            q_descale: expand(q_descale)?,
            k_descale: expand(k_descale)?,
            v_descale: expand(v_descale)?,
            q_blocks: if q_per_block { q_blocks } else { 0 },
            k_blocks: if k_per_block { k_blocks } else { 0 },
            q_shared_by_group,
            out_dtype,
        })
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
        let qf = per_token(&self.q_descale, dims.heads, self.q_blocks, Q_BLOCK_ROWS, cu_q)?;
        let kf = per_token(&self.k_descale, dims.kv_heads, self.k_blocks, K_BLOCK_ROWS, cu_k)?;
        let vf = per_token(&self.v_descale, dims.kv_heads, 0, 1, cu_k)?;
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
