//! FP8 (e4m3) quantization of attention inputs, in the layout of the fp8 attention kernels.
//!
//! e4m3 has 3 mantissa bits and a range of ±448, so a tensor is divided into that range first and
//! the f32 `descale` factors travel with it: the attention multiplies them back into its scores
//! (q and k) and its output (v) instead of widening every element. Finer groups (per head, per
//! block of rows) keep one large value from costing every other value of the tensor its
//! resolution; the incoherent rotation (FA3 section 3.3) attacks the same outliers from the other
//! side, spreading each over its head's dims so that one scale fits them all.
//!
//! A tensor on a GPU is quantized there in one pass (kernels/fp8/quantize.cu; per head and per
//! tensor read it twice, since their scale needs the whole sequence first); a CPU tensor on the
//! host. Both give the same bits: the kernel repeats the host's f32 operations in the same order.
//! The one difference is non-finite input: the host returns an error, while the GPU (which would
//! need a device-to-host sync to know) gives the group holding it a NaN descale, so the attention
//! rows that use it come out NaN. Head dims the kernel does not take (above 256 or not a multiple
//! of 8) go through the host from a GPU tensor too.

use candle_core::{bail, DType, Device, Result, Tensor};
use rayon::prelude::*;

/// Largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;
/// Rows of one query block of the fp8 attention kernels (one consumer warpgroup's rows): per-block
/// Q scales cover this many query rows of one head.
pub const Q_BLOCK_ROWS: usize = 64;
/// Keys per block of the fp8 kernels: per-block K scales cover this many key rows of one kv head.
pub const K_BLOCK_ROWS: usize = 128;

/// Which elements share one scale: coarser groups cost less to apply, finer ones lose less to an
/// outlier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Granularity {
    /// One scale for the whole tensor.
    Tensor,
    /// One scale per (batch, head).
    Head,
    /// One scale per block of `rows` consecutive sequence positions of one (batch, head).
    Block(usize),
}

/// An e4m3 tensor and the f32 factors that turn it back into the values it stands for
/// (x ≈ data · descale).
///
/// `descale` has the shape the attention op takes: (batch, heads) for [`Granularity::Tensor`]
/// (every entry the same) and [`Granularity::Head`], (batch, heads, blocks) for
/// [`Granularity::Block`], and (1, heads) for varlen (total_tokens, heads, head_dim) data.
#[derive(Debug, Clone)]
pub struct Quantized {
    pub data: Tensor,
    pub descale: Tensor,
    /// The grouping `descale` was computed for: the number of blocks alone does not tell how many
    /// rows each covers, and the attention must check that it matches its own block size.
    pub granularity: Granularity,
}

/// How to quantize: the grouping of the scales and, optionally, the rotation applied first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quantizer {
    granularity: Granularity,
    incoherent: Option<u64>,
}

impl Quantizer {
    pub fn new(granularity: Granularity) -> Self {
        Self {
            granularity,
            incoherent: None,
        }
    }

    /// Rotate head_dim by the seeded random orthogonal matrix R before quantizing (FA3 section
    /// 3.3): apply to BOTH q and k with the same seed; q·kᵀ is unchanged in exact arithmetic while
    /// outliers spread. Never to v: its rotation would survive into the output.
    pub fn incoherent(self, seed: u64) -> Self {
        Self {
            incoherent: Some(seed),
            ..self
        }
    }

    /// Quantizes x, (batch, seqlen, heads, head_dim) or varlen (total_tokens, heads, head_dim),
    /// f32/f16/bf16 with any strides, to e4m3 with descale = amax / [`E4M3_MAX`] per group.
    pub fn quantize(&self, x: &Tensor) -> Result<Quantized> {
        const WHAT: &str = "quantize";
        check_float(x.dtype(), WHAT)?;
        let groups = Groups::new(x.dims(), self.granularity, WHAT)?;
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() && crate::cuda::quantize::supports(groups.head_dim) {
            let signs = self.incoherent.map(|seed| sign_words(seed, groups.head_dim));
            let (data, descale) = crate::cuda::quantize::run(x, &groups, signs.as_deref())?;
            return Ok(Quantized {
                data,
                descale,
                granularity: self.granularity,
            });
        }
        let mut values = host_f32(x)?;
        if values.iter().any(|v| !v.is_finite()) {
            bail!("flash-attn3: fp8 quantize: input has non-finite values")
        }
        if let Some(seed) = self.incoherent {
            rotate_rows(&mut values, groups.head_dim, seed);
        }
        let descale = groups.descales(&values);
        values
            .par_chunks_mut(groups.head_dim)
            .enumerate()
            .for_each(|(row, chunk)| {
                // Times the reciprocal, as the GPU kernel does (a multiply, not a division).
                let inv = 1.0 / descale[groups.index(row)];
                for v in chunk {
                    *v = (*v * inv).clamp(-E4M3_MAX, E4M3_MAX);
                }
            });
        // candle's f32 → e4m3 conversion rounds to nearest even; the values are already in range.
        let data = Tensor::from_vec(values, x.dims(), &Device::Cpu)?
            .to_dtype(DType::F8E4M3)?
            .to_device(x.device())?;
        let descale = Tensor::from_vec(descale, groups.descale_dims(), &Device::Cpu)?.to_device(x.device())?;
        Ok(Quantized {
            data,
            descale,
            granularity: self.granularity,
        })
    }
}

/// Convenience: quantize(x, granularity) without rotation.
pub fn quantize(x: &Tensor, granularity: Granularity) -> Result<Quantized> {
    Quantizer::new(granularity).quantize(x)
}

/// data · descale as f32 (with the descale broadcast as the attention applies it); for tests and
/// references. For a rotated quantization this gives back the ROTATED values: R is not undone
/// because the attention never undoes it either.
pub fn dequantize(q: &Quantized) -> Result<Tensor> {
    const WHAT: &str = "dequantize";
    if q.data.dtype() != DType::F8E4M3 {
        bail!(
            "flash-attn3: fp8 dequantize: data must be f8e4m3, got {:?}",
            q.data.dtype()
        )
    }
    if q.descale.dtype() != DType::F32 {
        bail!(
            "flash-attn3: fp8 dequantize: descale must be f32, got {:?}",
            q.descale.dtype()
        )
    }
    let groups = Groups::new(q.data.dims(), q.granularity, WHAT)?;
    let want = groups.descale_dims();
    if q.descale.dims() != want.as_slice() {
        bail!(
            "flash-attn3: fp8 dequantize: descale has shape {:?}, data {:?} with {:?} needs {want:?}",
            q.descale.dims(),
            q.data.dims(),
            q.granularity
        )
    }
    let mut values = host_f32(&q.data)?;
    let descale = host_f32(&q.descale)?;
    values
        .par_chunks_mut(groups.head_dim)
        .enumerate()
        .for_each(|(row, chunk)| {
            let d = descale[groups.index(row)];
            for v in chunk {
                *v *= d;
            }
        });
    Tensor::from_vec(values, q.data.dims(), &Device::Cpu)?.to_device(q.data.device())
}

/// The rotation itself, applied to an f32/f16/bf16 tensor's last dim, result f32: so callers can
/// build references of rotated inputs.
pub fn rotate(x: &Tensor, seed: u64) -> Result<Tensor> {
    check_float(x.dtype(), "rotate")?;
    if x.rank() == 0 {
        bail!("flash-attn3: fp8 rotate: needs at least one dim to rotate, got a scalar")
    }
    let mut values = host_f32(x)?;
    let d = x.dims()[x.rank() - 1];
    if d > 0 {
        rotate_rows(&mut values, d, seed);
    }
    Tensor::from_vec(values, x.dims(), &Device::Cpu)?.to_device(x.device())
}

fn check_float(dtype: DType, what: &str) -> Result<()> {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => Ok(()),
        _ => bail!("flash-attn3: fp8 {what}: unsupported dtype {dtype:?}: x must be f32, f16 or bf16"),
    }
}

/// The elements in logical order as f32, on the host: every layout and dtype becomes one case.
fn host_f32(x: &Tensor) -> Result<Vec<f32>> {
    x.to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()
}

/// The groups of one quantization. Varlen input is one batch whose sequence is all the tokens, so
/// that rows map to scales by one formula; its descale is (1, heads) all the same.
pub(crate) struct Groups {
    pub seqlen: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// Sequence positions per scale: the whole sequence unless per block.
    pub rows: usize,
    /// Scales per (batch, head).
    pub blocks: usize,
    pub batch: usize,
    varlen: bool,
    pub granularity: Granularity,
}

impl Groups {
    fn new(dims: &[usize], granularity: Granularity, what: &str) -> Result<Self> {
        let (batch, seqlen, heads, head_dim, varlen) = match *dims {
            [b, s, h, d] => (b, s, h, d, false),
            [t, h, d] => (1, t, h, d, true),
            _ => bail!(
                "flash-attn3: fp8 {what}: x must be (batch, seqlen, heads, head_dim) or varlen \
                 (total_tokens, heads, head_dim), got shape {dims:?}"
            ),
        };
        if dims.contains(&0) {
            bail!("flash-attn3: fp8 {what}: empty tensor of shape {dims:?}")
        }
        let rows = match granularity {
            Granularity::Block(0) => bail!("flash-attn3: fp8 {what}: Block(0): a block needs at least one row"),
            Granularity::Block(_) if varlen => bail!(
                "flash-attn3: fp8 {what}: per-block scales need fixed-length (batch, seqlen, heads, head_dim) \
                 input, got varlen shape {dims:?}"
            ),
            Granularity::Block(rows) => rows,
            Granularity::Tensor | Granularity::Head => seqlen,
        };
        Ok(Self {
            seqlen,
            heads,
            head_dim,
            rows,
            blocks: seqlen.div_ceil(rows),
            batch,
            varlen,
            granularity,
        })
    }

    pub fn descale_dims(&self) -> Vec<usize> {
        match (self.granularity, self.varlen) {
            (_, true) => vec![1, self.heads],
            (Granularity::Block(_), false) => vec![self.batch, self.heads, self.blocks],
            _ => vec![self.batch, self.heads],
        }
    }

    /// The descale entry of row `row` of head_dim values (rows in (batch, seqlen, heads) order).
    fn index(&self, row: usize) -> usize {
        let head = row % self.heads;
        let pos = (row / self.heads) % self.seqlen;
        let b = row / (self.heads * self.seqlen);
        (b * self.heads + head) * self.blocks + pos / self.rows
    }

    /// amax / E4M3_MAX for every entry of the descale, from the (possibly rotated) values.
    fn descales(&self, values: &[f32]) -> Vec<f32> {
        let row_amax: Vec<f32> = values
            .par_chunks(self.head_dim)
            .map(|row| row.iter().fold(0f32, |m, v| m.max(v.abs())))
            .collect();
        let mut amax = vec![0f32; self.batch * self.heads * self.blocks];
        for (row, m) in row_amax.into_iter().enumerate() {
            let slot = &mut amax[self.index(row)];
            *slot = slot.max(m);
        }
        if self.granularity == Granularity::Tensor {
            let all = amax.iter().fold(0f32, |m, &v| m.max(v));
            amax.fill(all);
        }
        amax.into_iter()
            .map(|m| {
                let d = m / E4M3_MAX;
                // A subnormal scale (amax below ~5e-36) would be too coarse to divide by; such a group
                // is zero for any purpose of attention, and descale 1 keeps its data exactly 0.
                if d.is_normal() {
                    d
                } else {
                    1.0
                }
            })
            .collect()
    }
}

/// Applies R to every row of `d` values: signs, then a Walsh–Hadamard transform per block of `b`
/// (the largest power of two dividing `d`, so any head dim works), then 1/sqrt(b) to keep it
/// orthogonal. O(d log d) per row instead of a d × d product.
fn rotate_rows(values: &mut [f32], d: usize, seed: u64) {
    let signs = signs(seed, d);
    let b = 1usize << d.trailing_zeros();
    let inv_norm = 1.0 / (b as f32).sqrt();
    values.par_chunks_mut(d).for_each(|row| {
        for (v, s) in row.iter_mut().zip(&signs) {
            *v *= s;
        }
        for block in row.chunks_exact_mut(b) {
            fwht(block);
            for v in block {
                *v *= inv_norm;
            }
        }
    });
}

/// ±1 per dim: -1 where dim i's bit of [`sign_words`] is set.
fn signs(seed: u64, d: usize) -> Vec<f32> {
    let words = sign_words(seed, d);
    (0..d)
        .map(|i| {
            if (words[i / 64] >> (i % 64)) & 1 == 1 {
                -1.0
            } else {
                1.0
            }
        })
        .collect()
}

/// The sign bits of R, 64 dims per word, from splitmix64: a fixed function of the seed, so q and
/// k rotated apart (even on different machines, or one on the GPU) meet the same R.
fn sign_words(seed: u64, d: usize) -> Vec<u64> {
    let mut state = seed;
    (0..d.div_ceil(64))
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        })
        .collect()
}

/// In-place unnormalised Walsh–Hadamard transform (Sylvester order) of a power-of-two length.
fn fwht(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    while h < n {
        for start in (0..n).step_by(2 * h) {
            let (lo, hi) = x[start..start + 2 * h].split_at_mut(h);
            for (a, b) in lo.iter_mut().zip(hi) {
                let (x0, x1) = (*a, *b);
                *a = x0 + x1;
                *b = x0 - x1;
            }
        }
        h *= 2;
    }
}
