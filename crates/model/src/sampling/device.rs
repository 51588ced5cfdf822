//! Picking each row's token where the logits are: [`sample_rows`] takes a (rows, vocab) block of
//! logits and one [`RowSampling`] per row and returns the (rows,) u32 tokens on the same device.
//! On a GPU that is one kernel (kernels/model/sampling.cu) and a decode step copies one u32 per
//! sequence to the host instead of a row of logits; the CPU runs the same algorithm here.
//!
//! The distribution is [`Sampler`](super::Sampler)'s (greedy, or temperature / top-k / top-p;
//! the repeat penalty needs the history and stays with the host sampler), drawn differently:
//! by rejection instead of a walk over the sorted vocabulary (the kernel's header says how), with
//! the uniform numbers of a counter-based generator on (seed, token index), so a sequence's
//! tokens do not depend on the batch or on the steps before. The CPU and the GPU make the same
//! draws, with the same sums in f64 in the same order; a token can differ only where the two
//! devices' exponentials (a few ulps apart) move a draw across a boundary between two tokens.

use candle_core::{bail, DType, Device, Result, Tensor};

use super::SamplingParams;

/// One row's sampling: the fields of [`SamplingParams`] that the device sampler uses, and the
/// index of the token being drawn (the kernel gets it as a 32-byte struct, `RowSampling`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowSampling {
    /// <= 0: greedy (the largest logit, the first on ties).
    pub temperature: f32,
    /// 0: no limit.
    pub top_k: u32,
    /// >= 1: no limit.
    pub top_p: f32,
    pub seed: u64,
    /// The sequence's token index (or any counter that differs per draw).
    pub counter: u64,
}

impl RowSampling {
    /// The row of a sequence sampled with `params`, drawing its token number `counter`; `None`
    /// where the params need the host sampler (a repeat penalty).
    pub fn new(params: &SamplingParams, counter: u64) -> Option<Self> {
        if params.repeat_penalty != 1.0 {
            return None;
        }
        Some(Self {
            temperature: if params.temperature > 0.0 {
                params.temperature as f32
            } else {
                0.0
            },
            top_k: params.top_k.min(u32::MAX as usize) as u32,
            top_p: params.top_p as f32,
            seed: params.seed,
            counter,
        })
    }

    /// A greedy row (for rows whose token nobody reads).
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            counter: 0,
        }
    }
}

/// Each row's token from `logits` (rows, vocab; f32, f16 or bf16) by its [`RowSampling`]:
/// (rows,) u32 on the logits' device. NaN logits are never chosen.
pub fn sample_rows(logits: &Tensor, rows: &[RowSampling]) -> Result<Tensor> {
    let (n, vocab) = logits.dims2()?;
    if n != rows.len() {
        bail!(
            "sample_rows: {n} rows of logits and {} rows of sampling parameters",
            rows.len()
        )
    }
    if vocab == 0 || vocab > i32::MAX as usize {
        bail!("sample_rows: rows of {vocab} logits")
    }
    if let Some((i, r)) = rows
        .iter()
        .enumerate()
        .find(|(_, r)| !r.temperature.is_finite() || r.top_p.is_nan())
    {
        bail!(
            "sample_rows: row {i} has temperature {} and top_p {}",
            r.temperature,
            r.top_p
        )
    }
    if !matches!(logits.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        bail!("sample_rows: logits must be f32, f16 or bf16, got {:?}", logits.dtype())
    }
    match logits.device() {
        Device::Cpu => {
            let all = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            let tokens: Vec<u32> = all.iter().zip(rows).map(|(l, r)| sample_row(l, r)).collect();
            Tensor::new(tokens, &Device::Cpu)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::sample_rows(&logits.contiguous()?, rows),
        d => bail!("sample_rows: no sampler on {d:?}"),
    }
}

/// A uniform number in [0, 1) for draw `round` of token `counter` (the kernel's `uniform01`).
fn uniform01(seed: u64, counter: u64, round: u32) -> f64 {
    let mut z = seed.wrapping_add(
        0x9E37_79B9_7F4A_7C15u64.wrapping_mul(counter.wrapping_mul(64).wrapping_add(u64::from(round) + 1)),
    );
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// Rounds of rejection before the first token in walk order is taken (`kMaxRounds`).
const MAX_ROUNDS: u32 = 48;

/// i before j in walk order (weight descending, then index ascending).
fn ahead(wi: f32, i: usize, wj: f32, j: usize) -> bool {
    wi > wj || (wi == wj && i < j)
}

/// The kernel's threads per row (`kSampleThreads`): thread t owns tokens t, t + 512, ...; the
/// draw walks thread 0's tokens, then thread 1's, ... ("draw order").
const THREADS_PER_ROW: usize = 512;

/// The CPU's copy of the kernel's algorithm for one row: the same order of draws and sums.
fn sample_row(logits: &[f32], r: &RowSampling) -> u32 {
    let first = super::argmax(logits);
    if r.temperature <= 0.0 || r.top_k == 1 || logits.iter().all(|l| l.is_nan()) {
        return first;
    }
    let max = logits[first as usize];
    // The kernel's arithmetic: times the f32 reciprocal of the temperature.
    let inv_temperature = 1.0 / r.temperature;
    let w: Vec<f32> = logits
        .iter()
        .map(|&l| {
            if l.is_nan() {
                0.0
            } else {
                ((l - max) * inv_temperature).exp()
            }
        })
        .collect();
    let k = r.top_k as usize;
    let total: f64 = w.iter().map(|&x| f64::from(x)).sum();
    let kept_total = if k > 0 && k < w.len() && r.top_p < 1.0 {
        let mut sorted = w.clone();
        sorted.sort_unstable_by(|a, b| b.total_cmp(a));
        let wk = sorted[k - 1];
        let above = sorted.iter().take_while(|&&x| x > wk).count();
        let mass: f64 = sorted[..above].iter().map(|&x| f64::from(x)).sum();
        mass + (k - above) as f64 * f64::from(wk)
    } else {
        total
    };
    let mass_limit = if r.top_p < 1.0 {
        f64::from(r.top_p) * kept_total
    } else {
        f64::INFINITY
    };
    let owned = |t: usize| (t..w.len()).step_by(THREADS_PER_ROW);
    let mut pivot: Option<(f32, usize)> = None;
    let candidate =
        |pivot: Option<(f32, usize)>, i: usize| w[i] > 0.0 && pivot.is_none_or(|(pw, pi)| ahead(w[i], i, pw, pi));
    for round in 0..MAX_ROUNDS {
        let sums: Vec<f64> = (0..THREADS_PER_ROW)
            .map(|t| owned(t).filter(|&i| candidate(pivot, i)).map(|i| f64::from(w[i])).sum())
            .collect();
        let mass: f64 = sums.iter().sum();
        let target = uniform01(r.seed, r.counter, round) * mass;
        // The thread whose tokens hold the target (the last one with candidates if rounding put
        // the target past the end), then the token inside them.
        let (mut acc, mut owner, mut last) = (0.0, None, None);
        for (t, &s) in sums.iter().enumerate() {
            if s > 0.0 {
                last = Some(t);
                if target < acc + s {
                    owner = Some(t);
                    break;
                }
            }
            acc += s;
        }
        let Some(owner) = owner.or(last) else { break };
        let mut left = target - acc;
        let mut chosen = None;
        for i in owned(owner) {
            if !candidate(pivot, i) {
                continue;
            }
            chosen = Some(i);
            if left < f64::from(w[i]) {
                break;
            }
            left -= f64::from(w[i]);
        }
        let Some(j) = chosen else { break };
        let (count, mass_ahead) = (0..w.len())
            .filter(|&i| ahead(w[i], i, w[j], j))
            .fold((0usize, 0f64), |(c, m), i| (c + 1, m + f64::from(w[i])));
        if (k == 0 || count < k) && mass_ahead < mass_limit {
            return j as u32;
        }
        pivot = Some((w[j], j));
    }
    first
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::CudaDType;
    use candle_core::{CudaStorage, Layout, Result, Shape, Tensor};

    use super::RowSampling;
    use crate::fused::cuda::{addr, by_dtype, err, function_in, suffix};

    static CUBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/sampling.cubin"));
    /// Threads per row (`kSampleThreads`).
    const THREADS: u32 = 512;

    pub(super) fn sample_rows(logits: &Tensor, rows: &[RowSampling]) -> Result<Tensor> {
        logits.apply_op1_no_bwd(&SampleRows { rows: rows.to_vec() })
    }

    struct SampleRows {
        rows: Vec<RowSampling>,
    }

    impl candle_core::CustomOp1 for SampleRows {
        fn name(&self) -> &'static str {
            "flash-llama-sample-rows"
        }

        fn cpu_fwd(&self, _: &candle_core::CpuStorage, _: &Layout) -> Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("sample_rows: the CUDA op got CPU logits")
        }

        fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            by_dtype!(OP, s.dtype(), launch(self, s, l))
        }
    }

    const OP: &str = "sample_rows";

    /// One block per row of the logits (T: their element type).
    fn launch<T: CudaDType>(op: &SampleRows, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let dev = s.device.clone();
        let (rows, vocab) = l.shape().dims2()?;
        let la = addr::<T>(s, l, OP, "the logits")?;
        let stream = dev.cuda_stream();
        // SAFETY: the kernel writes one token per row.
        let mut out = unsafe { dev.alloc::<u32>(rows.max(1))? };
        if rows > 0 {
            // The parameters as the kernel's 32-byte structs (four u64 words each).
            let words: Vec<u64> = op
                .rows
                .iter()
                .flat_map(|r| {
                    [
                        u64::from(r.temperature.to_bits()) | (u64::from(r.top_k) << 32),
                        u64::from(r.top_p.to_bits()),
                        r.seed,
                        r.counter,
                    ]
                })
                .collect();
            let params = stream
                .clone_htod(&words)
                .map_err(|e| err("sample_rows parameters", e))?;
            let func = function_in(CUBIN, &dev, format!("sample_rows_{}", suffix(s.dtype(), OP)?))?;
            let (pa, _p) = params.device_ptr(&stream);
            let (oa, _o) = out.device_ptr_mut(&stream);
            let vocab = vocab as i32;
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = stream.launch_builder(&func);
            b.arg(&la).arg(&pa).arg(&oa).arg(&vocab);
            // SAFETY: contiguous logits of rows x vocab elements, one parameter struct and one
            // output per row.
            unsafe { b.launch(cfg) }.map_err(|e| err("sample_rows launch", e))?;
        }
        Ok((u32::wrap_cuda_slice(out, dev), Shape::from(rows)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(temperature: f32, top_k: u32, top_p: f32, seed: u64, counter: u64) -> RowSampling {
        RowSampling {
            temperature,
            top_k,
            top_p,
            seed,
            counter,
        }
    }

    // That draws follow the kept distribution (temperature, top-k, top-p) is checked by the
    // integration tests on the CPU and the GPU with one check (tests/common/sampling.rs).

    #[test]
    fn greedy_rows_and_top_k_1_take_the_first_largest_and_draws_repeat() -> Result<()> {
        let logits = Tensor::new(&[[0.5f32, 3.0, f32::NAN, 3.0, -1.0], [f32::NAN; 5]], &Device::Cpu)?;
        let tokens = sample_rows(&logits, &[row(0.0, 0, 1.0, 1, 1), row(0.8, 0, 0.9, 1, 1)])?;
        assert_eq!(tokens.to_vec1::<u32>()?, vec![1, 0]);
        let tokens = sample_rows(&logits, &[row(5.0, 1, 1.0, 9, 3), row(0.0, 0, 1.0, 0, 0)])?;
        assert_eq!(tokens.to_vec1::<u32>()?, vec![1, 0]);
        // The same (seed, counter): the same token; NaN never drawn.
        let block = Tensor::new(&[0.5f32, 3.0, f32::NAN, 3.0, -1.0], &Device::Cpu)?
            .unsqueeze(0)?
            .repeat((64, 1))?;
        let rows: Vec<RowSampling> = (0..64).map(|i| row(1.5, 0, 1.0, 7, i / 2)).collect();
        let t = sample_rows(&block, &rows)?.to_vec1::<u32>()?;
        for pair in t.chunks(2) {
            assert_eq!(pair[0], pair[1], "{t:?}");
        }
        assert!(t.iter().all(|&x| x != 2), "{t:?}");
        assert!(
            t.iter().any(|&x| x != t[0]),
            "64 draws at temperature 1.5 all gave {}",
            t[0]
        );
        Ok(())
    }

    #[test]
    fn bad_input_is_an_error() -> Result<()> {
        let logits = Tensor::zeros((2, 5), DType::F32, &Device::Cpu)?;
        assert!(sample_rows(&logits, &[RowSampling::greedy()]).is_err());
        assert!(sample_rows(&logits.flatten_all()?, &[RowSampling::greedy()]).is_err());
        assert!(sample_rows(
            &Tensor::zeros((1, 0), DType::F32, &Device::Cpu)?,
            &[RowSampling::greedy()]
        )
        .is_err());
        assert!(sample_rows(&logits.to_dtype(DType::U32)?, &[RowSampling::greedy(); 2]).is_err());
        let nan_t = row(f32::NAN, 0, 1.0, 0, 0);
        assert!(sample_rows(&logits, &[nan_t, RowSampling::greedy()]).is_err());
        let with_penalty = SamplingParams {
            repeat_penalty: 1.1,
            ..SamplingParams::default()
        };
        assert!(RowSampling::new(&with_penalty, 0).is_none());
        Ok(())
    }
}
