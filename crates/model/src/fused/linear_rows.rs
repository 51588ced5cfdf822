//! [`linear_rows`]: a linear layer over the 2-64 rows of a batched decode step, on the tensor
//! cores (wgmma), reading the weight once, in one launch whose first weight loads overlap the
//! kernel before (kernels/model/linear_rows.cu; measured against cuBLAS in
//! docs/kernels/model-fused.md, "linear_rows").

use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

/// Most rows (tokens) one call takes: the kernel's widest form holds 8 tiles of 8 tokens.
pub const LINEAR_ROWS_MAX_TOKENS: usize = 64;
/// The kernel streams k in chunks of this many elements (kChunk).
const CHUNK: usize = 64;
/// Outputs (rows of the weight) of one CTA (kBlockRows).
const BLOCK_ROWS: usize = 128;

/// Whether [`linear_rows`] takes `x` (m, k) and `w` (n, k): CUDA tensors of one dtype (bf16 or
/// f16), 2 to [`LINEAR_ROWS_MAX_TOKENS`] rows, k a positive multiple of 64, n at most 65,535
/// blocks of 128 (the grid's y), both contiguous and starting on 16 bytes. Shape checks only, on
/// the host.
pub fn linear_rows_fits(x: &Tensor, w: &Tensor) -> bool {
    let (Ok((m, k)), Ok((n, wk))) = (x.dims2(), w.dims2()) else {
        return false;
    };
    let dtype = x.dtype();
    x.device().is_cuda()
        && matches!(dtype, DType::BF16 | DType::F16)
        && (2..=LINEAR_ROWS_MAX_TOKENS).contains(&m)
        && n > 0
        && n.div_ceil(BLOCK_ROWS) <= 65_535
        && k == wk
        && k > 0
        && k % CHUNK == 0
        && super::vector_ready(x, dtype, x)
        && super::vector_ready(w, dtype, x)
}

/// `x · wᵀ (+ bias)` for `x` (m, k) and a linear layer's `w` (n, k) (and `bias` (n)): (m, n), in
/// one launch, with f32 accumulation and one rounding per output, when [`linear_rows_fits`] holds
/// (an error otherwise).
pub fn linear_rows(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    if !linear_rows_fits(x, w) {
        bail!(
            "flash-llama linear_rows: x {:?} ({:?}, strides {:?}, {:?}) and w {:?} ({:?}) need bf16 or f16 on one GPU, 2-{LINEAR_ROWS_MAX_TOKENS} rows, a shared k that is a multiple of {CHUNK}, at most 65,535 x {BLOCK_ROWS} outputs, and contiguous tensors starting on 16 bytes",
            x.shape(),
            x.dtype(),
            x.stride(),
            x.device().location(),
            w.shape(),
            w.dtype()
        )
    }
    super::check_bias(bias, w.dim(0)?, x)?;
    x.apply_op2_no_bwd(w, &LinearRows { bias: bias.cloned() })
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct LinearRows {
    /// Shares the caller's storage; read inside the launch.
    bias: Option<Tensor>,
}

impl CustomOp2 for LinearRows {
    fn name(&self) -> &'static str {
        "linear-rows"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        Err(super::cuda_only("linear_rows"))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        // Shapes, dtypes and alignment checked by `linear_rows`.
        let out = cuda::linear_rows((x, xl), (w, wl), self.bias.as_ref())?;
        Ok((out, Shape::from((xl.dims()[0], wl.dims()[0]))))
    }
}

/// The tile count of the kernel for `m` tokens: 1, 2, 4 or 8 tiles of 8.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn tiles(m: usize) -> usize {
    m.div_ceil(8).next_power_of_two()
}

/// Into how many parts (a cluster of CTAs, 1-8) the kernel splits k: the fewest that give every
/// SM a CTA, while each part keeps at least two chunks of k. A 2048 × 2048 weight (16 blocks of
/// 128 rows) splits in 8 on a 132-SM GPU, gate/up's 16,384 rows in 2.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn split(n: usize, k: usize, sms: usize) -> usize {
    let (blocks, chunks) = (n.div_ceil(BLOCK_ROWS), k / CHUNK);
    let mut split = 1;
    while split < 8 && blocks * split < sms && chunks / (split * 2) >= 2 {
        split *= 2;
    }
    split
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::collections::{HashMap, HashSet};
    use std::sync::{Mutex, OnceLock};

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{sys, CudaFunction, DevicePtrMut, DeviceRepr, LaunchConfig};
    use candle_core::cuda_backend::{CudaDType, CudaDevice, DeviceId};
    use candle_core::{bail, CudaStorage, Layout, Result, Tensor};

    use super::super::cuda::{
        addr, arg, by_dtype, err, function_in, held_addr, launch_overlapping, same_dtype, suffix, OverlapInCapture,
    };

    static CUBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/linear_rows.cubin"));

    /// Threads of a CTA (kThreads: one warpgroup) and its pipeline's stages (kStages).
    const THREADS: u32 = 128;
    const STAGES: usize = 4;

    pub(super) fn linear_rows(
        x: (&CudaStorage, &Layout),
        w: (&CudaStorage, &Layout),
        bias: Option<&Tensor>,
    ) -> Result<CudaStorage> {
        by_dtype!("linear_rows", x.0.dtype(), linear_rows_t(x, w, bias))
    }

    /// The device's multiprocessor count, cached per device.
    fn sm_count(dev: &CudaDevice) -> Result<usize> {
        static COUNTS: OnceLock<Mutex<HashMap<DeviceId, usize>>> = OnceLock::new();
        let mut counts = COUNTS.get_or_init(Default::default).lock().unwrap();
        if let Some(&n) = counts.get(&dev.id()) {
            return Ok(n);
        }
        let n = dev
            .cuda_stream()
            .context()
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| err("multiprocessor count", e))?;
        let n = n.max(1) as usize;
        counts.insert(dev.id(), n);
        Ok(n)
    }

    /// The kernel `name` with its dynamic shared memory raised to `smem` bytes (once per device
    /// and kernel).
    fn kernel(dev: &CudaDevice, name: String, smem: u32) -> Result<CudaFunction> {
        static RAISED: OnceLock<Mutex<HashSet<(DeviceId, String)>>> = OnceLock::new();
        let func = function_in(CUBIN, dev, name.clone())?;
        let mut raised = RAISED.get_or_init(Default::default).lock().unwrap();
        if raised.insert((dev.id(), name)) {
            func.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(|e| err("linear_rows shared memory", e))?;
        }
        Ok(func)
    }

    fn linear_rows_t<T: CudaDType + DeviceRepr>(
        x: (&CudaStorage, &Layout),
        w: (&CudaStorage, &Layout),
        bias: Option<&Tensor>,
    ) -> Result<CudaStorage> {
        const OP: &str = "linear_rows";
        let dtype = x.0.dtype();
        same_dtype(OP, dtype, &[("the weight", w.0.dtype())])?;
        let dev = x.0.device.clone();
        let (m, k) = (x.1.dims()[0], x.1.dims()[1]);
        let n = w.1.dims()[0];
        let (xa, wa) = (addr::<T>(x.0, x.1, OP, "x")?, addr::<T>(w.0, w.1, OP, "the weight")?);
        if (xa | wa) % 16 != 0 {
            bail!("flash-llama {OP}: x and the weight must start on 16 bytes")
        }
        let bias_g = bias.map(|b| b.storage_and_layout());
        let ba = match &bias_g {
            None => 0u64,
            Some((storage, layout)) => held_addr::<T>((storage, layout), &dev, dtype, OP, "the bias")?,
        };
        let tiles = super::tiles(m);
        let split = super::split(n, k, sm_count(&dev)?);
        // kStages stages of BLOCK_ROWS w rows and 8 * tiles x rows, 128 bytes each.
        let smem = (STAGES * (super::BLOCK_ROWS + 8 * tiles) * 128) as u32;
        let func = kernel(&dev, format!("linear_rows_{}_{tiles}", suffix(dtype, OP)?), smem)?;
        let stream = dev.cuda_stream();
        // Captured into a CUDA graph, the output's allocation must not stand between the kernel
        // before and this launch (as linear_vector's).
        let capture = OverlapInCapture::detach(&stream)?;
        // SAFETY: the kernel writes all m * n elements.
        let mut out = unsafe { dev.alloc::<T>(m * n)? };
        if let Some(capture) = capture {
            capture.attach(&stream)?;
        }
        {
            let (ya, _guard) = out.device_ptr_mut(&stream);
            let cfg = LaunchConfig {
                grid_dim: (split as u32, n.div_ceil(super::BLOCK_ROWS) as u32, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: smem,
            };
            let (m_i, n_i, k_i) = (m as i32, n as i32, k as i32);
            let mut args = [arg(&xa), arg(&wa), arg(&ba), arg(&ya), arg(&m_i), arg(&n_i), arg(&k_i)];
            // SAFETY: the arguments of the kernel's signature, in order (kernels/model/
            // linear_rows.cu): contiguous x (m x k) and w (n x k), 16-byte aligned, k a multiple
            // of 64 and m at most 8 * tiles (checked by `linear_rows`); a bias of n if any; an
            // output of m x n. The kernel reads only w before its `griddepcontrol.wait`; the
            // grid's x is one cluster of `split` CTAs.
            unsafe { launch_overlapping(&stream, &func, cfg, Some(split as u32), &mut args) }?;
        }
        drop(bias_g);
        Ok(T::wrap_cuda_slice(out, dev))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_cover_the_tokens() {
        assert_eq!([2, 8, 9, 16, 17, 32, 33, 64].map(tiles), [1, 1, 2, 2, 4, 4, 8, 8]);
    }

    #[test]
    fn split_fills_the_sms_and_keeps_two_chunks_a_part() {
        // The 1B shape on 132 SMs: o, down and q/k/v split in 8, gate/up in 2, the head not.
        assert_eq!(split(2048, 2048, 132), 8);
        assert_eq!(split(2048, 8192, 132), 8);
        assert_eq!(split(3072, 2048, 132), 8);
        assert_eq!(split(16384, 2048, 132), 2);
        assert_eq!(split(128_256, 2048, 132), 1);
        // A short k (SmolLM2-135M's 576): 9 chunks in at most 4 parts of 2-3.
        assert_eq!(split(576, 576, 132), 4);
    }

    #[test]
    fn linear_rows_is_an_error_on_the_cpu() {
        let x = Tensor::zeros((4, 64), DType::BF16, &candle_core::Device::Cpu).unwrap();
        let w = Tensor::zeros((8, 64), DType::BF16, &candle_core::Device::Cpu).unwrap();
        assert!(!linear_rows_fits(&x, &w));
        let e = linear_rows(&x, &w, None).unwrap_err().to_string();
        assert!(e.contains("linear_rows"), "{e}");
    }
}
