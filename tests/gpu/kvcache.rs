//! `flash_attn_with_kvcache` on the GPU (flash_attn3::kvcache): every call runs twice on the same
//! bf16 values, on the GPU and on the CPU path, which tests/cpu_kvcache.rs checks against an
//! f64 model of the cache. The caches after the call must hold the same bits (the append copies
//! values and turns k_new with the same f32 arithmetic on both devices), the outputs agree to
//! bf16 tolerance (both are f32 computations rounded once) and the LSE to 1e-3.
//!
//! Covered (bf16, f16 in two cases): contiguous caches with cache_batch_idx permutations, paged
//! caches of every page size with shuffled pages and a prefix page shared by two sequences, append
//! with and without rotary (interleaved or not), zero-length sequences, GQA with and without
//! pack-GQA, causal, windows and softcap, split-KV forced to 1, 3 and 16, head dims 64 / 128 /
//! 256, keys over many blocks, varlen queries (cu_seqlens_q), the single-query decode kernel
//! (`Tuning::decode_kernel`) against the forward kernel on the same calls, an appending call
//! captured into a CUDA graph (the append kernel and the forward overlapping it); then the device's
//! defined outcome for bad indices (the sequence reads as empty, a status bit is set) and the host
//! errors.

use candle_core::cuda_backend::cudarc::driver::{sys, CudaGraph, DriverError};
use candle_core::{DType, Device, Result, Tensor};
use flash_attn3::kvcache::{PAGE_SIZES, STATUS_BATCH_IDX_PAST_CACHE, STATUS_KEYS_PAST_CACHE, STATUS_PAGE_PAST_POOL};
use flash_attn3::{FlashAttn, Tuning};
use flash_attn3_tests::{assert_close, assert_err, random_paged_layout, rotary_tables, to_f64_vec, Opts, TestRng};

use super::{gpu, poison, LSE_TOL, OUT_TOL};

/// The sizes and cache layout of one call.
#[derive(Debug, Clone)]
struct Spec {
    seqlen_q: usize,
    seqlen_new: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
    dv: usize,
    /// Keys each sequence holds before the call.
    lens: Vec<usize>,
    /// Paged: (page size, page table (batch, max_pages), max_pages).
    paged: Option<(usize, Vec<u32>, usize)>,
    /// Contiguous: each sequence's cache row.
    batch_idx: Option<Vec<u32>>,
    /// The caches' first two dims.
    cache_dims: (usize, usize),
    /// q, the caches and the new rows: bf16 (`Spec::new`) or f16.
    dtype: DType,
}

impl Spec {
    /// A layout for `lens` (+ seqlen_new keys each): a contiguous cache with spare rows and a
    /// shuffled cache_batch_idx, or shuffled pages with sequences 0 and 1 sharing their first
    /// page when both already hold one.
    #[allow(clippy::too_many_arguments)]
    fn new(
        rng: &mut TestRng,
        page_size: Option<usize>,
        lens: Vec<usize>,
        seqlen_q: usize,
        seqlen_new: usize,
        heads: usize,
        kv_heads: usize,
        d: usize,
        dv: usize,
    ) -> Self {
        let batch = lens.len();
        let keys: Vec<usize> = lens.iter().map(|l| l + seqlen_new).collect();
        let (paged, batch_idx, cache_dims) = match page_size {
            None => {
                let capacity = keys.iter().copied().max().unwrap() + rng.range(0, 40);
                let rows = batch + rng.range(0, 2);
                let idx = rng.permutation(rows)[..batch].to_vec();
                (None, Some(idx), (rows, capacity.max(1)))
            }
            Some(ps) => {
                let l = random_paged_layout(rng, &lens, &keys, ps);
                (Some((ps, l.table, l.max_pages)), None, (l.num_pages, ps))
            }
        };
        Self {
            seqlen_q,
            seqlen_new,
            heads,
            kv_heads,
            d,
            dv,
            lens,
            paged,
            batch_idx,
            cache_dims,
            dtype: DType::BF16,
        }
    }

    fn batch(&self) -> usize {
        self.lens.len()
    }
}

/// The tensors of one call on one device.
struct Inputs {
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    lens: Tensor,
    page_table: Option<Tensor>,
    batch_idx: Option<Tensor>,
    /// cos, sin (positions, rotary_dim / 2) f32, interleaved.
    rotary: Option<(Tensor, Tensor, bool)>,
}

impl Inputs {
    fn random(rng: &mut TestRng, s: &Spec, rotary: Option<(usize, bool)>) -> Result<Self> {
        let cpu = Device::Cpu;
        let (b, hk) = (s.batch(), s.kv_heads);
        let (slots, rows) = s.cache_dims;
        let bf16 = s.dtype;
        let u32s = |v: &[u32], shape: (usize, usize)| Tensor::from_vec(v.to_vec(), shape, &cpu);
        let lens: Vec<u32> = s.lens.iter().map(|&l| l as u32).collect();
        let max_keys = s.lens.iter().map(|l| l + s.seqlen_new).max().unwrap();
        let rotary = match rotary {
            Some((rd, interleaved)) => {
                let (cos, sin) = rotary_tables(max_keys + s.seqlen_q + rng.range(0, 5), rd)?;
                Some((cos, sin, interleaved))
            }
            None => None,
        };
        Ok(Self {
            q: rng.randn((b, s.seqlen_q, s.heads, s.d), bf16, &cpu)?,
            k_cache: rng.randn((slots, rows, hk, s.d), bf16, &cpu)?,
            v_cache: rng.randn((slots, rows, hk, s.dv), bf16, &cpu)?,
            k_new: rng.randn((b, s.seqlen_new, hk, s.d), bf16, &cpu)?,
            v_new: rng.randn((b, s.seqlen_new, hk, s.dv), bf16, &cpu)?,
            lens: Tensor::new(lens.as_slice(), &cpu)?,
            page_table: match &s.paged {
                Some((_, table, max_pages)) => Some(u32s(table, (b, *max_pages))?),
                None => None,
            },
            batch_idx: match &s.batch_idx {
                Some(idx) => Some(u32s(idx, (1, b))?.flatten_all()?),
                None => None,
            },
            rotary,
        })
    }

    fn to_device(&self, dev: &Device) -> Result<Self> {
        let t = |x: &Tensor| x.to_device(dev);
        let opt = |x: &Option<Tensor>| x.as_ref().map(t).transpose();
        Ok(Self {
            q: t(&self.q)?,
            k_cache: t(&self.k_cache)?,
            v_cache: t(&self.v_cache)?,
            k_new: t(&self.k_new)?,
            v_new: t(&self.v_new)?,
            lens: t(&self.lens)?,
            page_table: opt(&self.page_table)?,
            batch_idx: opt(&self.batch_idx)?,
            rotary: match &self.rotary {
                Some((c, s, i)) => Some((t(c)?, t(s)?, *i)),
                None => None,
            },
        })
    }

    /// The call (appending when seqlen_new > 0), output and LSE; `status` for GPU calls.
    fn call(&self, attn: &FlashAttn, append: bool, status: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        let mut call = self.cache_call(attn);
        if append {
            call = call.append(&self.k_new, &self.v_new);
        }
        if let Some((cos, sin, interleaved)) = &self.rotary {
            call = call.rotary(cos, sin, *interleaved);
        }
        if let Some(st) = status {
            call = call.status(st);
        }
        call.forward_with_lse(&self.q)
    }

    /// `attn` against these caches, with their page table or cache rows.
    fn cache_call<'a>(&'a self, attn: &FlashAttn) -> flash_attn3::KvCacheAttn<'a> {
        let mut call = attn.kv_cache(&self.k_cache, &self.v_cache, &self.lens);
        if let Some(pt) = &self.page_table {
            call = call.page_table(pt);
        }
        if let Some(idx) = &self.batch_idx {
            call = call.cache_batch_idx(idx);
        }
        call
    }
}

/// Runs `host`'s call on the GPU `dev` (on a copy of its tensors, allocator memory poisoned) with
/// `gpu_attn` and on the CPU with `cpu_attn`; checks the GPU status word and that both caches
/// hold the same bits afterwards. Returns the GPU's (out, lse) and the CPU's.
#[allow(clippy::type_complexity)]
fn run_on_both(
    dev: &Device,
    host: &Inputs,
    gpu_attn: &FlashAttn,
    cpu_attn: &FlashAttn,
    append: bool,
    what: &str,
) -> Result<((Tensor, Tensor), (Tensor, Tensor))> {
    let device = host.to_device(dev)?;
    let status = Tensor::zeros(1, DType::U32, dev)?;
    poison(dev, 1 << 22)?;
    let got = device.call(gpu_attn, append, Some(&status))?;
    let want = host.call(cpu_attn, append, None)?;
    assert_eq!(status.to_vec1::<u32>()?, [0], "{what}: status");
    assert_same_caches(&device, host, what)?;
    Ok((got, want))
}

/// Panics, naming `what`, unless the GPU call's caches (`device`) hold the CPU call's values
/// (`host`) after the calls, NaN where the other has NaN.
fn assert_same_caches(device: &Inputs, host: &Inputs, what: &str) -> Result<()> {
    for (name, got, want) in [
        ("k_cache", &device.k_cache, &host.k_cache),
        ("v_cache", &device.v_cache, &host.v_cache),
    ] {
        // (Mismatches counted, not printed whole: a cache holds up to millions of values.)
        let (g, w) = (to_f64_vec(got)?, to_f64_vec(want)?);
        let differ: Vec<usize> = (0..g.len())
            .filter(|&i| g[i] != w[i] && !(g[i].is_nan() && w[i].is_nan()))
            .collect();
        if let Some(&i) = differ.first() {
            panic!(
                "{what}: {name} after the call: {} of {} values differ, the first at flat index {i} (shape {:?}): GPU {}, CPU {}",
                differ.len(),
                g.len(),
                got.dims(),
                g[i],
                w[i]
            );
        }
    }
    Ok(())
}

/// `call` captured into a CUDA graph on `dev`'s stream (it runs nothing yet): its result, whose
/// memory the graph owns, and the graph. Panics, naming `what`, if the capture fails.
fn capture<T>(dev: &Device, what: &str, call: impl FnOnce() -> Result<T>) -> Result<(T, CudaGraph)> {
    let stream = dev.as_cuda_device()?.cuda_stream();
    dev.synchronize()?;
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(driver_err)?;
    let out = call();
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
    match (out, graph) {
        (Ok(out), Ok(Some(graph))) => Ok((out, graph)),
        (out, graph) => panic!("{what}: capture failed: {:?} / {:?}", out.err(), graph.err()),
    }
}

/// Launches `graph` `times` times, then waits for the device.
fn replay(dev: &Device, graph: &CudaGraph, times: usize) -> Result<()> {
    for _ in 0..times {
        graph.launch().map_err(driver_err)?;
    }
    dev.synchronize()
}

fn driver_err(e: DriverError) -> candle_core::Error {
    candle_core::Error::Msg(format!("{e:?}"))
}

/// Runs `s` on the GPU and on the CPU with the same values and compares (module docs).
fn check(rng: &mut TestRng, s: &Spec, opts: Opts, rotary: Option<(usize, bool)>, splits: usize) -> Result<()> {
    let what = format!(
        "{s:?} opts {opts:?} rotary {rotary:?} splits {splits} seed {}",
        rng.seed()
    );
    let host = Inputs::random(rng, s, rotary)?;
    let attn = opts.builder().num_splits(splits);
    let ((out, lse), (want, want_lse)) = run_on_both(&gpu()?, &host, &attn, &opts.builder(), s.seqlen_new > 0, &what)?;
    assert_close(&out, &want, OUT_TOL, &format!("{what}: out"))?;
    assert_close(&lse, &want_lse, LSE_TOL, &format!("{what}: lse"))?;
    Ok(())
}

#[test]
fn kvcache_contiguous_every_option() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-kvcache-contiguous");
    for (d, kv_heads, group) in [(128, 2, 4), (64, 1, 8), (256, 2, 1), (128, 3, 2)] {
        let heads = kv_heads * group;
        for (append, opts, rotary) in [
            (false, Opts::new(0.125), None),
            (true, Opts::new(0.1).causal(), None),
            (true, Opts::new(0.09).causal(), Some((d, false))),
            (
                true,
                Opts::new(0.11).window(Some(300), Some(0)).softcap(8.0),
                Some((d / 2, true)),
            ),
            (true, Opts::new(0.08), Some((32, false))),
        ] {
            let batch = rng.range(1, 4);
            let lens: Vec<usize> = (0..batch)
                .map(|b| if b == 1 { 0 } else { rng.range(1, 1500) })
                .collect();
            let new = if append { rng.range(1, 5) } else { 0 };
            let sq = if append { new } else { rng.range(1, 4) };
            let s = Spec::new(&mut rng, None, lens, sq, new, heads, kv_heads, d, d);
            check(&mut rng, &s, opts, rotary, 0)?;
        }
    }
    Ok(())
}

#[test]
fn kvcache_paged_every_page_size() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-kvcache-paged");
    for page_size in PAGE_SIZES {
        for (d, append, opts, rotary) in [
            (128, false, Opts::new(0.125), None),
            (128, true, Opts::new(0.1).causal(), Some((128, false))),
            (64, true, Opts::new(0.12).window(Some(200), Some(0)), None),
            (256, true, Opts::new(0.06), Some((64, true))),
            // d192 (key blocks of 112: boxes of 16 rows at every page size, a block's V from the
            // V thread), d96 (64-byte rows, 64B swizzle) and d80 (the d96 kernel, its missing
            // columns zero-filled by TMA).
            (192, false, Opts::new(0.07).causal(), None),
            (96, true, Opts::new(0.1), None),
            (80, false, Opts::new(0.11), None),
            // d112 and d48 on the d128 and d64 kernels (at pages of 16 and 32 their `_pw` kernels),
            // the missing columns zero-filled by TMA.
            (112, true, Opts::new(0.09).causal(), None),
            (48, false, Opts::new(0.14), None),
        ] {
            let kv_heads = rng.pick(&[1, 2]);
            let heads = kv_heads * rng.pick(&[1, 4, 8]);
            let batch = rng.range(1, 4);
            let lens: Vec<usize> = (0..batch).map(|_| rng.range(0, 1200)).collect();
            let new = if append { rng.range(1, 4) } else { 0 };
            let sq = if append { new } else { rng.range(1, 3) };
            let s = Spec::new(&mut rng, Some(page_size), lens, sq, new, heads, kv_heads, d, d);
            check(&mut rng, &s, opts, rotary, 0)?;
        }
    }
    Ok(())
}

/// Split-KV forced to 1, 3 and 16 shares on long caches, paged and contiguous; a query block
/// longer than the appended keys (seqlen_q > seqlen_new, causal from the cache's end).
#[test]
fn kvcache_split_counts_and_long_caches() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-kvcache-splits");
    for splits in [1, 3, 16] {
        for page_size in [None, Some(16), Some(64), Some(256)] {
            let lens = vec![rng.range(3000, 9000), rng.range(100, 3000)];
            let s = Spec::new(&mut rng, page_size, lens, 1, 1, 16, 2, 128, 128);
            check(&mut rng, &s, Opts::new(0.1).causal(), Some((128, false)), splits)?;
        }
    }
    let lens = vec![rng.range(500, 2000); 3];
    let s = Spec::new(&mut rng, Some(32), lens, 9, 2, 8, 8, 128, 128);
    check(&mut rng, &s, Opts::new(0.1).causal(), None, 0)?;
    Ok(())
}

/// The single-query decode kernel (kernels/kvcache/decode.cu, `Tuning::decode_kernel`) against
/// the CPU path, and the forward kernel on the same calls: d64 and d128, bf16 and f16, groups of
/// 1 to 16 q heads (odd ones too; at d128 the kernel takes up to 8, so the 16-row case runs the
/// forward kernel), contiguous caches with cache_batch_idx and pages of 16 / 64 / 256, sequences
/// of 0 and 1 keys, causal, a window, softcap, append with rotary; short caches (1 to 8 shares, a
/// warp's slice in one step or a few) and, forced, long ones (many steps a warp).
#[test]
fn kvcache_decode_kernel_every_option() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-kvcache-decode");
    let cases = [
        (64, 8, 4, DType::BF16),
        (128, 4, 8, DType::BF16),
        (64, 2, 16, DType::F16),
        (128, 3, 5, DType::BF16),
        (64, 4, 1, DType::F16),
        (128, 1, 16, DType::F16),
        (64, 3, 7, DType::BF16),
    ];
    for (i, (d, kv_heads, group, dtype)) in cases.into_iter().enumerate() {
        for page_size in [None, Some(16), Some(64), Some(256)] {
            for (max_len, forced) in [(120, false), (900, false), (5000, true)] {
                let batch = rng.range(1, 5);
                let lens: Vec<usize> = (0..batch)
                    .map(|b| match b {
                        1 => 0,
                        2 => 1,
                        _ => rng.range(1, max_len),
                    })
                    .collect();
                let (opts, append, rotary) = match (i + lens[0]) % 4 {
                    0 => (Opts::new(0.125), false, None),
                    1 => (Opts::new(0.1).causal(), true, Some((d, false))),
                    2 => (Opts::new(0.09).window(Some(rng.range(0, 200)), Some(0)), false, None),
                    _ => (Opts::new(0.11).softcap(6.0), true, Some((d / 2, true))),
                };
                let new = append as usize;
                let mut s = Spec::new(&mut rng, page_size, lens, 1, new, kv_heads * group, kv_heads, d, d);
                s.dtype = dtype;
                for choice in [Some(true), Some(false)] {
                    if choice == Some(false) && forced {
                        continue; // the forward kernel on long caches: the other tests
                    }
                    let tuning = Tuning {
                        decode_kernel: choice,
                        ..Default::default()
                    };
                    check(&mut rng, &s, opts.tuned(tuning), rotary, 0)?;
                }
            }
        }
    }
    Ok(())
}

/// 16-bit decode on the forward kernel's one-warpgroup instantiations (two CTAs per SM; the host's
/// rule in cuda/forward.rs `decode_on_one_warpgroup`): d64 over pages of 16 and 32 and caches of
/// more than 2,048 keys, and enough contiguous (sequence, kv head) tiles to fill both CTA slots of
/// every SM; d128 (64-key blocks) over pages of 16 with enough tiles. Each also with
/// `Tuning::decode_one_cta_per_sm` (the two-warpgroup kernel), against the CPU path: 1 and 2
/// queries (4 and 8 packed rows), append with rotary, windows, softcap.
#[test]
fn kvcache_decode_on_one_warpgroup() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-kvcache-x1");
    let many = |rng: &mut TestRng, n: usize, max: usize| -> Vec<usize> {
        (0..n).map(|b| if b == 3 { 0 } else { rng.range(1, max) }).collect()
    };
    // (head dim, kv heads, page size, lens, seqlen_q)
    let cases = [
        (64, 8, Some(16), vec![2100, 0, 1, rng.range(1, 2100)], 1),
        (64, 8, Some(32), vec![rng.range(1, 3000), 2500], 2),
        (64, 8, None, many(&mut rng, 40, 700), 1),
        (128, 4, Some(16), many(&mut rng, 60, 1000), 1),
    ];
    for (i, (d, kv_heads, page_size, lens, seqlen_q)) in cases.into_iter().enumerate() {
        let (opts, rotary) = match i {
            0 | 3 => (Opts::new(0.1).causal(), Some((64, false))),
            1 => (
                Opts::new(0.09).causal().window(Some(rng.range(0, 900)), Some(0)),
                Some((32, true)),
            ),
            _ => (Opts::new(0.11).causal().softcap(6.0), Some((64, false))),
        };
        let s = Spec::new(&mut rng, page_size, lens, seqlen_q, 1, 32, kv_heads, d, d);
        for one_cta_per_sm in [false, true] {
            let tuning = Tuning {
                decode_kernel: Some(false),
                decode_one_cta_per_sm: one_cta_per_sm,
                ..Default::default()
            };
            check(&mut rng, &s, opts.tuned(tuning), rotary, 0)?;
        }
    }
    Ok(())
}

/// The decode kernel where a call's shares are halved to fit one CTA per SM (cuda/decode.rs
/// `plan`): the 1B shape's d64, 32/8 heads at batch 8 (two shares), 16 and 32 (one), short
/// caches contiguous and in pages of 16, with the per-call choice (batch 8 takes the kernel) and
/// forced, against the CPU path.
#[test]
fn kvcache_decode_kernel_on_halved_shares() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-kvcache-decode-halved");
    for batch in [8, 16, 32] {
        for page_size in [None, Some(16)] {
            let lens: Vec<usize> = (0..batch)
                .map(|b| match b {
                    1 => 0,
                    2 => 1,
                    _ => rng.range(1, 1000),
                })
                .collect();
            let (opts, append, rotary) = match batch {
                8 => (Opts::new(0.125).causal(), true, Some((64, false))),
                16 => (Opts::new(0.125), false, None),
                _ => (Opts::new(0.1).softcap(6.0), false, None),
            };
            let mut s = Spec::new(&mut rng, page_size, lens, 1, append as usize, 32, 8, 64, 64);
            s.dtype = DType::BF16;
            for choice in [None, Some(true)] {
                let tuning = Tuning {
                    decode_kernel: choice,
                    ..Default::default()
                };
                check(&mut rng, &s, opts.tuned(tuning), rotary, 0)?;
            }
        }
    }
    Ok(())
}

/// Small, for compute-sanitizer (memcheck, racecheck): the decode kernel over pages of 16 with
/// append, several shares merged in a cluster, a sequence without keys.
#[test]
fn kvcache_decode_small_for_sanitizer() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-kvcache-decode-sanitizer");
    let s = Spec::new(&mut rng, Some(16), vec![130, 0, 60], 1, 1, 8, 2, 64, 64);
    let tuning = Tuning {
        decode_kernel: Some(true),
        ..Default::default()
    };
    check(
        &mut rng,
        &s,
        Opts::new(0.1).causal().tuned(tuning),
        Some((64, false)),
        0,
    )
}

/// A contiguous cache's `cache_batch_idx` past the cache (2^31, past i32 too) with no status
/// word, so no append kernel checks it first: both kernels read that sequence's keys as zeros (as
/// TMA reads past a map), so its output is 0 and its LSE ln(keys); the other sequence matches
/// the CPU path; nothing faults.
#[test]
fn kvcache_decode_slot_past_the_cache_reads_zeros() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-kvcache-decode-slot");
    let dev = gpu()?;
    let cpu = Device::Cpu;
    let (keys, kv_heads, group, d) = (300usize, 2, 4, 64);
    let q = rng.randn((2, 1, kv_heads * group, d), DType::BF16, &cpu)?;
    let k = rng.randn((2, keys, kv_heads, d), DType::BF16, &cpu)?;
    let v = rng.randn((2, keys, kv_heads, d), DType::BF16, &cpu)?;
    let lens = Tensor::new(&[keys as u32, keys as u32], &cpu)?;
    let want = FlashAttn::new(0.125)
        .kv_cache(&k, &v, &lens)
        .cache_batch_idx(&Tensor::new(&[1u32, 0], &cpu)?)
        .forward(&q)?;
    let idx = Tensor::new(&[1u32, 1 << 31], &dev)?;
    let (qd, kd, vd, ld) = (
        q.to_device(&dev)?,
        k.to_device(&dev)?,
        v.to_device(&dev)?,
        lens.to_device(&dev)?,
    );
    for kernel in [Some(true), Some(false)] {
        let what = format!("decode kernel {kernel:?}, seed {}", rng.seed());
        let tuning = Tuning {
            decode_kernel: kernel,
            ..Default::default()
        };
        poison(&dev, 1 << 22)?;
        let (out, lse) = FlashAttn::new(0.125)
            .tuning(tuning)
            .kv_cache(&kd, &vd, &ld)
            .cache_batch_idx(&idx)
            .forward_with_lse(&qd)?;
        assert_close(&out.get(0)?, &want.get(0)?, OUT_TOL, &what)?;
        let past = to_f64_vec(&out.get(1)?)?;
        assert!(
            past.iter().all(|&x| x == 0.0),
            "{what}: the sequence past the cache is not 0"
        );
        for l in to_f64_vec(&lse.get(1)?)? {
            assert!(
                (l - (keys as f64).ln()).abs() < 1e-3,
                "{what}: LSE {l}, want ln({keys})"
            );
        }
    }
    Ok(())
}

/// Varlen queries (`KvCacheAttn::varlen_q`: a serving step's prefill chunks beside single decode
/// tokens, in one call): sequences with 0, 1 or many queries over contiguous caches and pages of
/// 16 and 64, d64 and d128, GQA with and without pack-GQA, causal / window + softcap / none,
/// split-KV chosen per call and forced to 3; GPU against the CPU path on the same values.
#[test]
fn kvcache_varlen_queries() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-kvcache-varlen-q");
    for page_size in [None, Some(16), Some(64)] {
        for (d, heads, kv_heads, opts, splits) in [
            (128, 32, 4, Opts::new(0.1).causal(), 0),
            (64, 9, 3, Opts::new(0.12).causal(), 3),
            (128, 8, 8, Opts::new(0.09).window(Some(100), Some(0)).softcap(7.0), 0),
            (64, 8, 2, Opts::new(0.11), 0),
        ] {
            let batch = rng.range(2, 6);
            let lens: Vec<usize> = (0..batch).map(|_| rng.range(0, 1500)).collect();
            let q_lens: Vec<usize> = lens
                .iter()
                .map(|&l| match rng.range(0, 3) {
                    0 => 0,
                    1 => l.min(1),
                    _ => rng.range(0, l + 1).min(300),
                })
                .collect();
            let s = Spec::new(&mut rng, page_size, lens, 1, 0, heads, kv_heads, d, d);
            check_varlen(&mut rng, &s, &q_lens, opts, splits)?;
        }
    }
    Ok(())
}

/// One small varlen-query call of each cache kind, for compute-sanitizer.
#[test]
fn kvcache_varlen_small_for_sanitizer() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-kvcache-varlen-sanitizer");
    for page_size in [None, Some(16)] {
        let s = Spec::new(&mut rng, page_size, vec![70, 0, 200], 1, 0, 8, 2, 128, 128);
        check_varlen(&mut rng, &s, &[5, 0, 1], Opts::new(0.1).causal(), 0)?;
    }
    Ok(())
}

/// Runs `s`'s caches with `q_lens[b]` queries for sequence b (packed) on the GPU and on the CPU
/// with the same values, and compares.
fn check_varlen(rng: &mut TestRng, s: &Spec, q_lens: &[usize], opts: Opts, splits: usize) -> Result<()> {
    let total_q: usize = q_lens.iter().sum();
    if total_q == 0 {
        return Ok(());
    }
    let dev = gpu()?;
    let what = format!(
        "{s:?} q_lens {q_lens:?} opts {opts:?} splits {splits} seed {}",
        rng.seed()
    );
    let host = Inputs::random(rng, s, None)?;
    let device = host.to_device(&dev)?;
    let q = rng.randn((total_q, s.heads, s.d), DType::BF16, &Device::Cpu)?;
    let run = |x: &Inputs, q: &Tensor, attn: &FlashAttn| -> Result<(Tensor, Tensor)> {
        let cu = flash_attn3::SeqOffsets::from_lengths(q_lens.iter().copied(), q.device())?;
        x.cache_call(attn).varlen_q(&cu).forward_with_lse(q)
    };
    poison(&dev, 1 << 22)?;
    let (out, lse) = run(&device, &q.to_device(&dev)?, &opts.builder().num_splits(splits))?;
    let (want, want_lse) = run(&host, &q, &opts.builder())?;
    assert_eq!(out.dims(), &[total_q, s.heads, s.dv], "{what}: out shape");
    assert_close(&out, &want, OUT_TOL, &format!("{what}: out"))?;
    assert_close(&lse, &want_lse, LSE_TOL, &format!("{what}: lse"))?;
    Ok(())
}

/// Read-only calls over strided cache views (k and v heads interleaved in one buffer, as
/// flash-llama's contiguous cache holds them, read by its CUDA-graph decode): the GPU reads the
/// views as they are (TMA with the views' strides) and agrees with the CPU path, which
/// tests/cpu_kvcache.rs checks against dense copies. Head dims 64 and 128, GQA with and without
/// pack-GQA, causal and not, seqlen_q 1 and 4, a sequence without keys, split-KV chosen per call,
/// forced to 1 and to 3; the same through a page table (flash-llama's paged cache).
#[test]
fn kvcache_strided_views() -> Result<()> {
    let dev = gpu()?;
    let mut rng = TestRng::fresh("gpu-kvcache-strided");
    let cpu = Device::Cpu;
    for (d, heads, kv_heads, seqlen_q, causal, splits) in [
        (64, 8, 2, 1, false, 0),
        (128, 32, 4, 1, true, 3),
        (128, 8, 8, 4, true, 1),
        (64, 6, 3, 1, false, 0),
    ] {
        let what = format!(
            "d {d}, heads {heads}/{kv_heads}, seqlen_q {seqlen_q}, causal {causal}, splits {splits}, seed {}",
            rng.seed()
        );
        let (batch, rows) = (3, 300);
        let kv = rng.randn((batch, rows, 2 * kv_heads, d), DType::BF16, &cpu)?;
        let q = rng.randn((batch, seqlen_q, heads, d), DType::BF16, &cpu)?;
        let lens = Tensor::new(&[37u32, 0, 300], &cpu)?;
        let attn = FlashAttn::new(1.0 / (d as f32).sqrt()).causal(causal);
        // The call on `dev` over the strided k and v views of `kv` (copied to `dev`), through
        // `table` for a paged cache: its output and LSE, and the cache it read.
        let call =
            |kv: &Tensor, table: Option<&Tensor>, dev: &Device, splits: usize| -> Result<(Tensor, Tensor, Tensor)> {
                let kv = kv.to_device(dev)?;
                let (k, v) = (kv.narrow(2, 0, kv_heads)?, kv.narrow(2, kv_heads, kv_heads)?);
                let (lens, q) = (lens.to_device(dev)?, q.to_device(dev)?);
                let table = table.map(|t| t.to_device(dev)).transpose()?;
                let mut cache = attn.clone().num_splits(splits).kv_cache(&k, &v, &lens);
                if let Some(table) = &table {
                    cache = cache.page_table(table);
                }
                let (out, lse) = cache.forward_with_lse(&q)?;
                Ok((out, lse, kv))
            };
        // The GPU against the CPU path: the sequence without keys reads as empty, the cache is
        // untouched.
        let check = |kv: &Tensor, table: Option<&Tensor>, what: &str| -> Result<()> {
            let (want, want_lse, _) = call(kv, table, &cpu, 0)?;
            poison(&dev, 1 << 22)?;
            let (out, lse, kv_dev) = call(kv, table, &dev, splits)?;
            assert_close(&out, &want, OUT_TOL, &format!("{what}: out"))?;
            assert_close(&lse, &want_lse, LSE_TOL, &format!("{what}: lse"))?;
            assert_eq!(
                out.get(1)?.abs()?.sum_all()?.to_dtype(DType::F32)?.to_scalar::<f32>()?,
                0.0,
                "{what}"
            );
            assert_eq!(to_f64_vec(&kv_dev)?, to_f64_vec(kv)?, "{what}: the cache changed");
            Ok(())
        };
        check(&kv, None, &what)?;
        // The same shapes as a paged cache's strided views (flash-llama's paged cache): pages of
        // 16 (the `_pw` kernels at d64 / d128) and 64, shuffled in the pool.
        for page in [16, 64] {
            let per_seq = rows.div_ceil(page);
            let pages = batch * per_seq;
            let table = Tensor::from_vec(rng.permutation(pages), (batch, per_seq), &cpu)?;
            let pool = rng.randn((pages, page, 2 * kv_heads, d), DType::BF16, &cpu)?;
            check(&pool, Some(&table), &format!("{what}, pages of {page}"))?;
        }
    }
    Ok(())
}

/// An append into strided cache views (k and v heads interleaved in one buffer, contiguous and
/// paged: flash-llama's caches) from strided q, k_new and v_new (views of one fused projection's
/// rows, (batch, 1, heads + 2 kv heads, d)), with rotary: the decode kernel's fused append and
/// the append kernel + forward kernel, against the CPU path on the same views; the caches after
/// the call hold the same bits on both devices.
#[test]
fn kvcache_strided_views_append() -> Result<()> {
    let dev = gpu()?;
    let mut rng = TestRng::fresh("gpu-kvcache-strided-append");
    let cpu = Device::Cpu;
    for (d, heads, kv_heads, interleaved) in [(64, 32, 8, false), (128, 16, 4, true), (64, 6, 3, false)] {
        let (batch, rows) = (3, 300);
        let lens = Tensor::new(&[37u32, 0, 298], &cpu)?;
        let qkv = rng.randn((batch, 1, heads + 2 * kv_heads, d), DType::BF16, &cpu)?;
        let (cos, sin) = rotary_tables(rows, d)?;
        // The call on `dev` over the strided views of a copy of `kv`, through `table` for a paged
        // cache: its output and LSE, and the cache after it.
        let call =
            |kv: &Tensor, table: Option<&Tensor>, dev: &Device, tuning: Tuning| -> Result<(Tensor, Tensor, Tensor)> {
                // (A copy: on the CPU `to_device` shares the storage, which the append writes.)
                let kv = kv.to_device(dev)?.copy()?;
                let (k, v) = (kv.narrow(2, 0, kv_heads)?, kv.narrow(2, kv_heads, kv_heads)?);
                let qkv = qkv.to_device(dev)?;
                let q = qkv.narrow(2, 0, heads)?;
                let (k_new, v_new) = (
                    qkv.narrow(2, heads, kv_heads)?,
                    qkv.narrow(2, heads + kv_heads, kv_heads)?,
                );
                let (lens, cos, sin) = (lens.to_device(dev)?, cos.to_device(dev)?, sin.to_device(dev)?);
                let table = table.map(|t| t.to_device(dev)).transpose()?;
                let attn = FlashAttn::new(1.0 / (d as f32).sqrt()).causal(true).tuning(tuning);
                let mut call = attn
                    .kv_cache(&k, &v, &lens)
                    .append(&k_new, &v_new)
                    .rotary(&cos, &sin, interleaved);
                if let Some(table) = &table {
                    call = call.page_table(table);
                }
                let (out, lse) = call.forward_with_lse(&q)?;
                Ok((out, lse, kv))
            };
        let check = |kv: &Tensor, table: Option<&Tensor>, what: &str| -> Result<()> {
            let (want, want_lse, want_kv) = call(kv, table, &cpu, Tuning::default())?;
            for decode_kernel in [Some(true), Some(false)] {
                let what = format!("{what}, decode kernel {decode_kernel:?}");
                let tuning = Tuning {
                    decode_kernel,
                    ..Default::default()
                };
                poison(&dev, 1 << 22)?;
                let (out, lse, kv_dev) = call(kv, table, &dev, tuning)?;
                assert_close(&out, &want, OUT_TOL, &format!("{what}: out"))?;
                assert_close(&lse, &want_lse, LSE_TOL, &format!("{what}: lse"))?;
                assert_eq!(
                    to_f64_vec(&kv_dev)?,
                    to_f64_vec(&want_kv)?,
                    "{what}: the caches after the append"
                );
                assert_ne!(to_f64_vec(&kv_dev)?, to_f64_vec(kv)?, "{what}: nothing appended");
            }
            Ok(())
        };
        let what = format!(
            "d {d}, heads {heads}/{kv_heads}, interleaved {interleaved}, seed {}",
            rng.seed()
        );
        let kv = rng.randn((batch, rows, 2 * kv_heads, d), DType::BF16, &cpu)?;
        check(&kv, None, &what)?;
        for page in [16, 64] {
            let per_seq = rows.div_ceil(page);
            let pages = batch * per_seq;
            let table = Tensor::from_vec(rng.permutation(pages), (batch, per_seq), &cpu)?;
            let pool = rng.randn((pages, page, 2 * kv_heads, d), DType::BF16, &cpu)?;
            check(&pool, Some(&table), &format!("{what}, pages of {page}"))?;
        }
    }
    Ok(())
}

/// `appends_in_kernel` says where a GPU call appends inside its attention kernel: the 1B
/// model's shape (d64, 32/8 heads, 640 keys) at batch 1 and 8 with one new key; not with two
/// new keys, at batch 32 (the forward kernel), without an append, nor with the decode kernel
/// turned off.
#[test]
fn kvcache_appends_in_kernel_where_the_decode_kernel_runs() -> Result<()> {
    let dev = gpu()?;
    let bf16 = |dims: &[usize]| Tensor::zeros(dims, DType::BF16, &dev);
    let fused = |batch: usize, new: usize, append: bool, decode_kernel: Option<bool>| -> Result<bool> {
        let (k, v) = (bf16(&[batch, 640, 8, 64])?, bf16(&[batch, 640, 8, 64])?);
        let (kn, vn) = (bf16(&[batch, new, 8, 64])?, bf16(&[batch, new, 8, 64])?);
        let lens = Tensor::new(vec![100u32; batch].as_slice(), &dev)?;
        let attn = FlashAttn::new(0.125).causal(true).tuning(Tuning {
            decode_kernel,
            ..Default::default()
        });
        let mut call = attn.kv_cache(&k, &v, &lens);
        if append {
            call = call.append(&kn, &vn);
        }
        call.appends_in_kernel(&bf16(&[batch, 1, 32, 64])?)
    };
    assert!(fused(1, 1, true, None)?);
    assert!(fused(8, 1, true, None)?);
    assert!(!fused(1, 2, true, None)?, "two new keys");
    assert!(!fused(32, 1, true, None)?, "batch 32");
    assert!(!fused(1, 1, false, None)?, "no append");
    assert!(!fused(1, 1, true, Some(false))?, "the decode kernel off");
    Ok(())
}

/// f16 caches: the same kernels' other element type (append, rotary and attention); pages of 32
/// at d128 and of 16 at d64 run the f16 `_pw` kernels (their page warp).
#[test]
fn kvcache_f16() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-kvcache-f16");
    for (page_size, d) in [(None, 128), (Some(32), 128), (Some(16), 64)] {
        let mut s = Spec::new(&mut rng, page_size, vec![700, 33], 2, 2, 8, 2, d, d);
        s.dtype = DType::F16;
        check(&mut rng, &s, Opts::new(0.1).causal(), Some((d, false)), 0)?;
    }
    Ok(())
}

/// Small, for compute-sanitizer (memcheck, racecheck): paged calls with append and rotary, d128
/// and d64.
#[test]
fn kvcache_small_for_sanitizer() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-kvcache-sanitizer");
    let s = Spec::new(&mut rng, Some(16), vec![70, 0, 200], 2, 2, 8, 2, 128, 128);
    check(&mut rng, &s, Opts::new(0.1).causal(), Some((64, false)), 0)?;
    // d64 on the small-page kernel (one share: no cluster merge; its page warp), the longest
    // sequence's 6 key blocks round the K/V ring three times.
    let s = Spec::new(&mut rng, Some(16), vec![70, 0, 650], 2, 2, 8, 2, 64, 64);
    check(&mut rng, &s, Opts::new(0.1).causal(), Some((64, false)), 1)
}

/// Bad indices on the device: the sequence reads as empty (output 0, LSE -inf), the status
/// word gets its bit, the other sequences are unaffected and nothing faults.
#[test]
fn kvcache_bad_indices_read_as_empty() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-kvcache-bad-indices");
    let dev = gpu()?;
    // d128 runs the append kernel and the forward kernel; d64 with the decode kernel forced, its
    // fused append (the checks inside the decode kernel).
    for (d, decode_kernel) in [(128, None), (64, Some(true))] {
        for (case, want_bit) in [
            ("page past the pool", STATUS_PAGE_PAST_POOL),
            ("keys past the cache", STATUS_KEYS_PAST_CACHE),
            ("cache_batch_idx past the cache", STATUS_BATCH_IDX_PAST_CACHE),
        ] {
            let case = format!("{case}, d{d}, decode kernel {decode_kernel:?}");
            let page_size = (want_bit != STATUS_BATCH_IDX_PAST_CACHE).then_some(16);
            let s = Spec::new(&mut rng, page_size, vec![40, 50, 30], 1, 1, 8, 2, d, d);
            let host = Inputs::random(&mut rng, &s, None)?;
            let mut device = host.to_device(&dev)?;
            // Sequence 1 goes bad.
            match want_bit {
                STATUS_PAGE_PAST_POOL => {
                    let (_, table, max_pages) = s.paged.as_ref().unwrap();
                    let mut table = table.clone();
                    table[max_pages + 2] = 1_000_000;
                    device.page_table = Some(Tensor::from_vec(table, (3, *max_pages), &dev)?);
                }
                STATUS_KEYS_PAST_CACHE => {
                    let (_, _, max_pages) = s.paged.as_ref().unwrap();
                    device.lens = Tensor::new(&[40u32, (max_pages * 16) as u32, 30], &dev)?;
                }
                _ => {
                    let mut idx = s.batch_idx.clone().unwrap();
                    idx[1] = 77;
                    device.batch_idx = Some(Tensor::new(idx.as_slice(), &dev)?);
                }
            }
            let status = Tensor::zeros(1, DType::U32, &dev)?;
            let attn = FlashAttn::new(0.1).causal(true).tuning(Tuning {
                decode_kernel,
                ..Default::default()
            });
            let (out, lse) = device.call(&attn, true, Some(&status))?;
            assert_eq!(status.to_vec1::<u32>()?, [want_bit], "{case}: status");
            let (want, want_lse) = host.call(&attn, true, None)?;
            for b in [0, 2] {
                let what = format!("{case}: sequence {b}, seed {}", rng.seed());
                assert_close(&out.get(b)?, &want.get(b)?, OUT_TOL, &what)?;
                assert_close(&lse.get(b)?, &want_lse.get(b)?, LSE_TOL, &what)?;
            }
            let empty = to_f64_vec(&out.get(1)?)?;
            assert!(
                empty.iter().all(|&x| x == 0.0),
                "{case}: the bad sequence's output is not 0"
            );
            let empty_lse = to_f64_vec(&lse.get(1)?)?;
            assert!(
                empty_lse.iter().all(|&x| x == f64::NEG_INFINITY),
                "{case}: the bad sequence's LSE is not -inf"
            );
        }
    }
    Ok(())
}

/// Host-side errors of GPU calls: f32 (the GPU kernels take 16 bits and e4m3), a status of the
/// wrong shape.
#[test]
fn kvcache_gpu_errors() -> Result<()> {
    let dev = gpu()?;
    let q = Tensor::zeros((1, 1, 4, 64), DType::F32, &dev)?;
    let k = Tensor::zeros((1, 32, 2, 64), DType::F32, &dev)?;
    let lens = Tensor::new(&[3u32], &dev)?;
    assert_err(
        FlashAttn::new(0.1).kv_cache(&k, &k, &lens).forward(&q),
        &["bf16, f16 and f8e4m3", "F32"],
    );
    let (q, k) = (q.to_dtype(DType::BF16)?, k.to_dtype(DType::BF16)?);
    let status = Tensor::zeros(2, DType::U32, &dev)?;
    assert_err(
        FlashAttn::new(0.1).kv_cache(&k, &k, &lens).status(&status).forward(&q),
        &["status", "[1]"],
    );
    Ok(())
}

/// FP8 (e4m3) q, caches and new rows with descales, contiguous and paged: the GPU call (its
/// kernel transposes V tiles in shared memory, kernels/flash_fwd/transpose_v.cuh) against the
/// CPU path on the same bytes (exact f32 on the dequantised values, which tests/cpu_kvcache.rs
/// checks): the caches bit-equal after the append, the output to the fp8 bound of
/// tests/gpu/fp8.rs, the LSE to LSE_TOL. Head dims 64, 128, 256, GQA, zero-length sequences,
/// splits chosen per call and forced to 3, tiles of at most 64 rows (one computing warpgroup, the
/// other transposing) and of more.
#[test]
fn kvcache_fp8_contiguous_and_paged() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-kvcache-fp8");
    let cases = [
        Fp8Case {
            page: None,
            lens: vec![37, 0, 300],
            sq: 1,
            sn: 1,
            h: 8,
            hk: 2,
            d: 128,
            causal: true,
        },
        Fp8Case {
            page: Some(16),
            lens: vec![100, 513, 5],
            sq: 4,
            sn: 2,
            h: 8,
            hk: 1,
            d: 64,
            causal: true,
        },
        Fp8Case {
            page: Some(64),
            lens: vec![260, 31],
            sq: 3,
            sn: 0,
            h: 4,
            hk: 4,
            d: 256,
            causal: false,
        },
        Fp8Case {
            page: Some(256),
            lens: vec![1000, 7, 129],
            sq: 1,
            sn: 3,
            h: 16,
            hk: 2,
            d: 128,
            causal: true,
        },
        Fp8Case {
            page: None,
            lens: vec![2000],
            sq: 1,
            sn: 1,
            h: 8,
            hk: 8,
            d: 64,
            causal: false,
        },
        // 72 query rows per tile: both consumer warpgroups compute (every case above has at most
        // 64, so the second one transposes V: FwdParams::solo_consumer).
        Fp8Case {
            page: Some(64),
            lens: vec![90, 200],
            sq: 72,
            sn: 72,
            h: 4,
            hk: 2,
            d: 64,
            causal: true,
        },
    ];
    for case in &cases {
        for splits in [0, 3] {
            check_fp8(&mut rng, case, splits)?;
        }
    }
    Ok(())
}

/// d64 fp8 decode (a sequence's query rows within one warpgroup's 64) runs on the one-warpgroup
/// kernel at two CTAs per SM (`flash_fwd_d64x1_e4m3_tv`) by default, and on the two-warpgroup
/// kernel (its second warpgroup transposing V) with `Tuning::decode_one_cta_per_sm`: both against
/// the CPU path. Enough tiles that a CTA claims several (320 at batch 40 with 8 kv heads, over at
/// most 2 x 132 CTAs), few tiles over long paged caches (split per call), 64 rows exactly (4
/// queries x 16 q heads) with three shares.
#[test]
fn kvcache_fp8_d64_decode_one_and_two_ctas_per_sm() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-kvcache-fp8-d64-decode");
    let two_wgs = Tuning {
        decode_one_cta_per_sm: true,
        ..Tuning::default()
    };
    for tuning in [Tuning::default(), two_wgs] {
        let many_tiles = Fp8Case {
            page: None,
            lens: (0..40).map(|_| rng.range(0, 700)).collect(),
            sq: 1,
            sn: 1,
            h: 32,
            hk: 8,
            d: 64,
            causal: true,
        };
        check_fp8_tuned(&mut rng, &many_tiles, 0, tuning)?;
        let long_paged = Fp8Case {
            page: Some(64),
            lens: vec![rng.range(3000, 9000), rng.range(1, 3000), 0],
            sq: 2,
            sn: 2,
            h: 16,
            hk: 2,
            d: 64,
            causal: true,
        };
        check_fp8_tuned(&mut rng, &long_paged, 0, tuning)?;
        let full_warpgroup = Fp8Case {
            page: Some(256),
            lens: vec![rng.range(500, 2500), rng.range(500, 2500)],
            sq: 4,
            sn: 4,
            h: 16,
            hk: 1,
            d: 64,
            causal: false,
        };
        check_fp8_tuned(&mut rng, &full_warpgroup, 3, tuning)?;
    }
    Ok(())
}

/// Small fp8 cases for compute-sanitizer: pages of 16 with an append at d128, and a contiguous
/// d64 cache (the `_tv` kernels, the second one with its deeper rings, and the e4m3 append).
#[test]
fn kvcache_fp8_small_for_sanitizer() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-kvcache-fp8-small");
    let paged = Fp8Case {
        page: Some(16),
        lens: vec![40, 3],
        sq: 2,
        sn: 2,
        h: 4,
        hk: 2,
        d: 128,
        causal: true,
    };
    check_fp8(&mut rng, &paged, 0)?;
    let contiguous = Fp8Case {
        page: None,
        lens: vec![700, 5],
        sq: 1,
        sn: 1,
        h: 8,
        hk: 2,
        d: 64,
        causal: true,
    };
    check_fp8(&mut rng, &contiguous, 0)
}

/// The sizes of one fp8 kvcache check.
struct Fp8Case {
    page: Option<usize>,
    lens: Vec<usize>,
    sq: usize,
    sn: usize,
    h: usize,
    hk: usize,
    d: usize,
    causal: bool,
}

fn check_fp8(rng: &mut TestRng, c: &Fp8Case, splits: usize) -> Result<()> {
    check_fp8_tuned(rng, c, splits, Tuning::default())
}

/// [`check_fp8`] with the GPU call scheduled by `tuning`.
fn check_fp8_tuned(rng: &mut TestRng, c: &Fp8Case, splits: usize, tuning: Tuning) -> Result<()> {
    let dev = gpu()?;
    let mut s = Spec::new(rng, c.page, c.lens.clone(), c.sq, c.sn, c.h, c.hk, c.d, c.d);
    s.dtype = DType::F8E4M3;
    let b = s.batch();
    // Descales in [0.75, 1.25): per (batch, head) for q, per (batch, kv head) for k and v.
    let mut descale = |heads: usize| -> Result<Tensor> {
        let v: Vec<f32> = (0..b * heads).map(|_| 0.75 + 0.5 * rng.uniform() as f32).collect();
        Tensor::from_vec(v, (b, heads), &Device::Cpu)
    };
    let (dq, dk, dv) = (descale(c.h)?, descale(c.hk)?, descale(c.hk)?);
    let mut opts = Opts::new(1.0 / (c.d as f64).sqrt());
    if c.causal {
        opts = opts.causal();
    }
    let what = format!(
        "fp8 {s:?} causal {} splits {splits} {tuning:?} seed {}",
        c.causal,
        rng.seed()
    );
    let host = Inputs::random(rng, &s, None)?;
    let on = |dev: &Device| -> Result<FlashAttn> {
        Ok(opts.builder().num_splits(splits).tuning(tuning).descale(
            Some(&dq.to_device(dev)?),
            Some(&dk.to_device(dev)?),
            Some(&dv.to_device(dev)?),
        ))
    };
    let ((out, lse), (want, want_lse)) = run_on_both(&dev, &host, &on(&dev)?, &on(&Device::Cpu)?, c.sn > 0, &what)?;
    assert_eq!(out.dtype(), DType::BF16, "{what}: out dtype");
    // The bound's magnitudes: the values times the largest descale (1.25).
    let scaled = |x: &Tensor| x.to_dtype(DType::F32)? * 1.25;
    let sq = scaled(&host.q)?;
    let sk = scaled(&host.k_cache)?;
    let sv = scaled(&host.v_cache)?;
    let out_cpu = out.to_device(&Device::Cpu)?;
    super::fp8::assert_fp8_close(&out_cpu, &want, (&sq, &sk, &sv), opts.scale, &format!("{what}: out"))?;
    assert_close(&lse, &want_lse, LSE_TOL, &format!("{what}: lse"))
}

/// An fp8 cache call as flash-llama's decode makes it: q descale per (sequence, kv head), so a
/// tile holds a whole GQA group (pack-GQA), k and v descales per (sequence, kv head), one query
/// per sequence, eager against the CPU path and then captured in a CUDA graph and replayed (as
/// the model's graph decode does), which must give the eager call's bits.
#[test]
fn kvcache_fp8_group_descale_eager_and_graph() -> Result<()> {
    let dev = gpu()?;
    let mut rng = TestRng::fresh("gpu-kvcache-fp8-group");
    let (b, h, hk, d) = (3, 16, 2, 128);
    let lens = [700usize, 1, 2049];
    let sk = 2100;
    let e4m3 = |x: Tensor| -> Result<Tensor> { x.to_dtype(DType::F8E4M3) };
    let mut normal = |shape: &[usize]| -> Result<Tensor> {
        let x: Vec<f32> = (0..shape.iter().product()).map(|_| rng.normal() as f32).collect();
        Tensor::from_vec(x, shape, &Device::Cpu)
    };
    let q = e4m3(normal(&[b, 1, h, d])?)?;
    let k = e4m3(normal(&[b, sk, hk, d])?)?;
    let v = e4m3(normal(&[b, sk, hk, d])?)?;
    let mut descale = || -> Result<Tensor> {
        let x: Vec<f32> = (0..b * hk).map(|_| 0.75 + 0.5 * rng.uniform() as f32).collect();
        Tensor::from_vec(x, (b, hk), &Device::Cpu)
    };
    let (dq, dk, dv) = (descale()?, descale()?, descale()?);
    let lens_u32: Vec<u32> = lens.iter().map(|&l| l as u32).collect();
    let scale = 1.0 / (d as f32).sqrt();
    let call = |dev: &Device| -> Result<Tensor> {
        let attn = FlashAttn::new(scale).causal(true).descale(
            Some(&dq.to_device(dev)?),
            Some(&dk.to_device(dev)?),
            Some(&dv.to_device(dev)?),
        );
        let lens = Tensor::new(lens_u32.as_slice(), dev)?;
        let (q, k, v) = (q.to_device(dev)?, k.to_device(dev)?, v.to_device(dev)?);
        attn.kv_cache(&k, &v, &lens).forward(&q)
    };
    let want = call(&Device::Cpu)?;
    // The bound's magnitudes: the values times the largest descale (1.25), each q head with its
    // group's descale.
    let scaled = |x: &Tensor| x.to_dtype(DType::F32)? * 1.25;
    let what = format!("fp8 cache, q descale per kv head, lens {lens:?}, seed {}", rng.seed());
    eprintln!("{what}: CPU reference done");
    let eager = call(&dev)?.to_device(&Device::Cpu)?;
    eprintln!("{what}: eager GPU call done");
    super::fp8::assert_fp8_close(&eager, &want, (&scaled(&q)?, &scaled(&k)?, &scaled(&v)?), scale, &what)?;

    // The same call captured and replayed: its inputs (descales included) made before capture.
    let attn = FlashAttn::new(scale).causal(true).descale(
        Some(&dq.to_device(&dev)?),
        Some(&dk.to_device(&dev)?),
        Some(&dv.to_device(&dev)?),
    );
    let (lens_d, qd, kd, vd) = (
        Tensor::new(lens_u32.as_slice(), &dev)?,
        q.to_device(&dev)?,
        k.to_device(&dev)?,
        v.to_device(&dev)?,
    );
    let (out, graph) = capture(&dev, &what, || attn.kv_cache(&kd, &vd, &lens_d).forward(&qd))?;
    eprintln!("{what}: captured");
    replay(&dev, &graph, 3)?;
    eprintln!("{what}: replayed");
    let replayed = out.to_device(&Device::Cpu)?;
    let (a, g) = (to_f64_vec(&eager)?, to_f64_vec(&replayed)?);
    let differ = a.iter().zip(&g).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
    assert_eq!(
        differ,
        0,
        "{what}: {differ} of {} graph-replayed values differ from the eager call's",
        a.len()
    );
    Ok(())
}

/// An appending call on the forward kernel captured into a CUDA graph and replayed: the append
/// kernel, then the forward launched to overlap it (a programmatic dependent launch whose edge the
/// capture keeps, cuda/forward.rs `FwdExtras::before_launch`). Replayed twice (the second
/// replay writes the same rows again), the caches hold the CPU path's bits and the output agrees
/// with the CPU's; contiguous and paged, one and three new tokens with rotary, split-KV by the
/// per-call choice and forced.
#[test]
fn kvcache_append_then_forward_in_a_graph() -> Result<()> {
    let dev = gpu()?;
    let mut rng = TestRng::fresh("gpu-kvcache-append-graph");
    let cases = [
        (None, 1, vec![700, 0, 2049], 0),
        (Some(16), 1, vec![33, 1500, 5], 0),
        (Some(64), 3, vec![200, 64, 1000], 3),
        (None, 3, vec![1, 4000], 0),
    ];
    for (page_size, new, lens, splits) in cases {
        let s = Spec::new(&mut rng, page_size, lens, new, new, 8, 2, 128, 128);
        let what = format!("{s:?} splits {splits}, captured, seed {}", rng.seed());
        let host = Inputs::random(&mut rng, &s, Some((128, false)))?;
        let opts = Opts::new(0.09).causal();
        let tuning = Tuning {
            decode_kernel: Some(false),
            ..Default::default()
        };
        let attn = opts.tuned(tuning).builder().num_splits(splits);
        let (device, eager) = (host.to_device(&dev)?, host.to_device(&dev)?);
        let (want, want_lse) = host.call(&opts.builder(), true, None)?;
        // An eager call first (a thread's first call on a device sets up the scheduler's
        // counters, which a capture cannot).
        let (eager_out, _) = eager.call(&attn, true, None)?;
        assert_close(&eager_out, &want, OUT_TOL, &format!("{what}: eager out"))?;

        // Nothing runs during the capture: the caches still hold the old rows after it.
        let ((out, lse), graph) = capture(&dev, &what, || device.call(&attn, true, None))?;
        replay(&dev, &graph, 2)?;
        assert_same_caches(&device, &host, &what)?;
        assert_close(&out, &want, OUT_TOL, &format!("{what}: out"))?;
        assert_close(&lse, &want_lse, LSE_TOL, &format!("{what}: lse"))?;
    }
    Ok(())
}
