//! GPU forward benchmark over the FlashAttention-3 paper's grid: bf16, 16k tokens per batch
//! (batch = 16384 / seqlen), hidden 2048 (heads = 2048 / head_dim), head dim 64/128/256,
//! seqlen 512..16k, causal and not; FLOPs 4·b·h·s²·d, halved when causal. Plus decode-like
//! shapes (decode_shapes.txt: seqlen_q 1 or 16 against 8k-128k keys, GQA, d128), reported as time
//! and K/V bytes read per second, with split-KV chosen per call and off.
//!
//! Timing: 3 warm-up calls, then as many calls as fit in ~200 ms (at least 5), bracketed by
//! device synchronisations; the mean per call is reported. Each call includes the op's host
//! work (validation, TMA descriptor encoding, output allocation) like a user's call would.
//! BENCH_TIMING=events times as the anchor scripts do instead (median of 20 calls each between
//! two CUDA events and a synchronisation, after 5 warm-ups): the GPU idles between calls, so the
//! host work before each launch counts, and the clocks sit higher than under a sustained load
//! (fp8 calls on an H200 run into the power cap: docs/benchmarks.md). Compare ours and an anchor
//! under the same method (scripts/fp8_anchors.py TIMING_MODE=sustained is this default).
//! BENCH_HOST=1 prints, per sustained timing, the host's time to queue one call against the call.
//! BENCH_SETTLE_MS=n (sustained timing) first runs each cell back to back for n ms, so that every
//! cell is timed at the GPU's steady state under load (the power cap's clock on an H200) rather
//! than after whatever ran before it; scripts/anchors_timed.py and scripts/fp8_anchors.py take
//! SETTLE_MS the same way (docs/benchmarks.md, session 57: a cell's first repeat ran 7-11% faster
//! than its steady state).
//! The GPU's memory pool keeps freed memory (flash_attn3::retain_freed_device_memory);
//! BENCH_POOL_RELEASE=1 keeps CUDA's default, under which every synchronisation hands it back.
//!
//! Env: BENCH_SEQS="512,1024", BENCH_HDIMS="64,128", BENCH_CAUSAL="0" (or "1", default both),
//! BENCH_DECODE=0 to skip the decode rows, BENCH_TUNING (below, `tuning`) for a `Tuning` other than
//! the per-call defaults,
//! BENCH_PASSES="fwd,bwd" (default fwd): `bwd` adds the backward over the same grid, timed as
//! `out.backward()` of a kept forward (dO = ones; the op's backward plus candle's gradient
//! bookkeeping), FLOPs 2.5 × the forward's (the FA3 paper's convention), and the op alone through
//! `FlashAttn::backward` (second table): the anchors time torch.autograd.grad, which returns the
//! op's gradients without candle's bookkeeping (the root's ones_like, a zeros_like per input that
//! the op's gradient is added into). `fp8` runs the grid with e4m3 inputs; `quantize` times the
//! GPU fp8 quantizer against candle's copy and the fp8 forward. BENCH_FP8_ACC_DIR=dir first runs
//! the FA3-paper accuracy protocol on the inputs scripts/fp8_anchors.py stored there.
//! `kvcache` times `flash_attn_with_kvcache` on the decode grid of kvcache_shapes() (contiguous
//! and paged caches, pages of 16 / 64 / 256 in shuffled order) next to the device's copy
//! bandwidth; scripts/kvcache_anchor.py times FA3 on the same shapes. Its diagnostics:
//! BENCH_PAGE_SIZES="16,32,64" (three other page sizes), BENCH_PAGES_IN_ORDER=1 (each sequence's
//! pages in order in the pool), BENCH_KV_SPLITS=N (N key shares in every call instead of the
//! per-call choice), BENCH_KV_SHAPES="1:1:1024,8:1:1024" (only these batch:seqlen_q:seqlen_k).
//! `kvcache_fp8` times fp8 (e4m3) caches against bf16 ones on a few decode shapes.
//! Graph-replayed columns: BENCH_GRAPH_CALLS=n puts n calls in each graph and reports the time per
//! call (a call that is not its graph's first node, as in a decode step).

use candle_core::Var;

use std::io::Write;
use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor};
use flash_attn3::fp8::{self, Granularity, Quantizer};
use flash_attn3::{FlashAttn, Tuning};

/// BENCH_TUNING="pack_gqa=0|1,d64_rows=128|192,direct_store,per_tile,dynamic_tiles=0|1,l2_section=N,
/// fp8_d128_keys=128|256,fp8_vt=kernel|prepass,global_combine,decode_one_cta,decode_kernel=0|1": the
/// `Tuning` of every call of the benchmark (unset: chosen per call), for comparisons.
fn tuning() -> Tuning {
    let mut t = Tuning::default();
    for item in std::env::var("BENCH_TUNING").unwrap_or_default().split(',') {
        let (key, value) = item.split_once('=').unwrap_or((item, ""));
        let num = value.parse::<usize>().ok();
        match key.trim() {
            "" => {}
            "pack_gqa" => t.pack_gqa = Some(value == "1"),
            "d64_rows" => t.d64_tile_rows = num,
            "direct_store" => t.direct_store = true,
            "per_tile" => t.per_tile = true,
            "dynamic_tiles" => t.dynamic_tiles = Some(value == "1"),
            "l2_section" => t.l2_section = num,
            "fp8_d128_keys" => t.fp8_d128_block_n = num,
            "fp8_vt" => t.fp8_vt_in_kernel = Some(value == "kernel"),
            "global_combine" => t.global_combine = true,
            "decode_one_cta" => t.decode_one_cta_per_sm = true,
            "decode_kernel" => t.decode_kernel = Some(value == "1"),
            other => panic!("BENCH_TUNING: unknown item {other:?}"),
        }
    }
    t
}

/// A call of the benchmark: `FlashAttn::new(scale)` with BENCH_TUNING's tuning.
fn attn(softmax_scale: f32) -> FlashAttn {
    FlashAttn::new(softmax_scale).tuning(tuning())
}

fn list(var: &str, default: &[usize]) -> Vec<usize> {
    match std::env::var(var) {
        Ok(s) if !s.trim().is_empty() => s.split(',').filter_map(|x| x.trim().parse().ok()).collect(),
        _ => default.to_vec(),
    }
}

/// Seconds per call of `f`: by default the mean of back-to-back calls filling ~0.2 s (sustained
/// load); BENCH_TIMING=events: the median of 20 calls each timed alone by CUDA events after 5
/// warm-up calls, the anchor scripts' method (scripts/fp8_anchors.py `t_events`), so that ours
/// and an anchor can be compared under the same load pattern.
fn time(dev: &Device, f: impl FnMut() -> Result<Tensor>) -> Result<f64> {
    if std::env::var("BENCH_TIMING").is_ok_and(|v| v == "events") {
        time_events(dev, f)
    } else {
        time_sustained(dev, f)
    }
}

fn time_events(dev: &Device, mut f: impl FnMut() -> Result<Tensor>) -> Result<f64> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
    let stream = dev.as_cuda_device()?.cuda_stream();
    let event = || {
        stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(candle_core::Error::wrap)
    };
    for _ in 0..5 {
        f()?;
    }
    dev.synchronize()?;
    let mut times = Vec::with_capacity(20);
    for _ in 0..20 {
        let start = event()?;
        f()?;
        let end = event()?;
        times.push(start.elapsed_ms(&end).map_err(candle_core::Error::wrap)? as f64 / 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn time_sustained(dev: &Device, mut f: impl FnMut() -> Result<Tensor>) -> Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    dev.synchronize()?;
    let settle = std::env::var("BENCH_SETTLE_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    let settle_start = Instant::now();
    while settle_start.elapsed().as_millis() < settle as u128 {
        // Synchronising every few calls keeps the queue short, so the loop ends on time.
        for _ in 0..4 {
            f()?;
        }
        dev.synchronize()?;
    }
    let probe = Instant::now();
    f()?;
    dev.synchronize()?;
    let one = probe.elapsed().as_secs_f64();
    let reps = ((0.2 / one.max(1e-6)) as usize).clamp(5, 200);
    let start = Instant::now();
    for _ in 0..reps {
        f()?;
    }
    let issued = start.elapsed().as_secs_f64();
    dev.synchronize()?;
    let secs = start.elapsed().as_secs_f64() / reps as f64;
    if std::env::var_os("BENCH_HOST").is_some() {
        // The host's time to queue one call against the call's time: near 1, the GPU waits on the host.
        eprintln!(
            "host: {:.1} us to queue a call of {:.1} us",
            issued / reps as f64 * 1e6,
            secs * 1e6
        );
    }
    Ok(secs)
}

fn seq_label(s: usize) -> String {
    if s >= 1024 {
        format!("{}k", s / 1024)
    } else {
        s.to_string()
    }
}

/// The backward over the paper grid: TFLOP/s per (head dim, mask) row.
fn backward_grid(dev: &Device, seqs: &[usize], hdims: &[usize]) -> Result<()> {
    let mut table = Vec::new();
    for &d in hdims {
        for causal in list("BENCH_CAUSAL", &[0, 1]).into_iter().map(|c| c != 0) {
            let mut row = Vec::new();
            for &s in seqs {
                let (b, h) = (16384 / s, 2048 / d);
                let var = |dev: &Device| -> Result<Var> {
                    Var::from_tensor(&Tensor::randn(0f32, 1., (b, s, h, d), dev)?.to_dtype(DType::BF16)?)
                };
                let (q, k, v) = (var(dev)?, var(dev)?, var(dev)?);
                let attn = attn(1.0 / (d as f32).sqrt()).causal(causal);
                let (out, lse) = attn.forward_with_lse(q.as_tensor(), k.as_tensor(), v.as_tensor())?;
                let secs = time(dev, || {
                    let grads = out.backward()?;
                    match grads.get(q.as_tensor()) {
                        Some(g) => Ok(g.clone()),
                        None => candle_core::bail!("no gradient for q"),
                    }
                });
                let secs = match secs {
                    Ok(secs) => secs,
                    Err(e) => {
                        println!("ours         bwd d={d:>3} causal={} s={s:>5}: FAILED {e}", causal as u8);
                        row.push(None);
                        continue;
                    }
                };
                // The op alone (FlashAttn::backward, dO = ones as above): what torch.autograd.grad
                // (the anchors) times. `backward()` adds candle's gradient bookkeeping: the root's
                // ones_like, then per input a zeros_like that the op's gradient is added into.
                let dout = out.ones_like()?;
                let (qt, kt, vt) = (q.as_tensor(), k.as_tensor(), v.as_tensor());
                let op_secs = time(dev, || Ok(attn.backward(qt, kt, vt, &out, &lse, &dout)?.0))?;
                let flops = 2.5 * 4.0 * (b * h * s * s * d) as f64 / if causal { 2.0 } else { 1.0 };
                let tflops = flops / secs / 1e12;
                let op_tflops = flops / op_secs / 1e12;
                println!(
                    "ours         bwd d={d:>3} causal={} s={s:>5} b={b:>2} h={h:>2}: {:>8.3} ms {tflops:>7.1} TFLOP/s; \
                     op alone {:.3} ms {op_tflops:.1} TFLOP/s",
                    causal as u8,
                    secs * 1e3,
                    op_secs * 1e3
                );
                row.push(Some((tflops, op_tflops)));
            }
            table.push((d, causal, row));
        }
    }
    for (title, pick) in [
        ("TFLOP/s (16k tokens, hidden 2048; FLOPs 2.5 x forward)", 0),
        (
            "TFLOP/s of the op alone (FlashAttn::backward, as torch.autograd.grad times it)",
            1,
        ),
    ] {
        println!("\nGPU backward, bf16, {title}");
        print!("| head dim | mask |");
        for s in seqs {
            print!(" {} |", seq_label(*s));
        }
        println!();
        println!("|---|---|{}", "---|".repeat(seqs.len()));
        for (d, causal, row) in &table {
            print!("| {d} | {} |", if *causal { "causal" } else { "full" });
            for t in row {
                match t {
                    Some(t) => print!(" {:.0} |", if pick == 0 { t.0 } else { t.1 }),
                    None => print!(" - |"),
                }
            }
            println!();
        }
    }
    Ok(())
}

/// Decode-like shapes (d128, bf16): K/V bytes read per second, with split-KV chosen per call
/// (`auto`) and off (`num_splits(1)`). Rows: (batch, seqlen_q, q heads, kv heads, seqlen_k).
/// scripts/decode_anchor.py times FA3 on the same shapes.
/// The decode-like shapes (batch, seqlen_q, q heads, kv heads, seqlen_k), from the file that
/// scripts/decode_anchor.py reads too.
fn decode_shape_list() -> Vec<(usize, usize, usize, usize, usize)> {
    include_str!("decode_shapes.txt")
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        .map(|l| {
            let f: Vec<usize> = l
                .split_whitespace()
                .map(|x| x.parse().expect("decode_shapes.txt: a number"))
                .collect();
            assert_eq!(f.len(), 5, "decode_shapes.txt: five numbers per line: {l}");
            (f[0], f[1], f[2], f[3], f[4])
        })
        .collect()
}

fn decode_shapes(dev: &Device) -> Result<()> {
    println!("\nDecode-like, d128, bf16: time per call (us) and K+V read (TB/s)");
    println!("| batch | seqlen_q | heads q/kv | seqlen_k | causal | auto: us | TB/s | num_splits(1): us | TB/s |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let d = 128;
    for (b, sq, h, hk, sk) in decode_shape_list() {
        let k = Tensor::randn(0f32, 1., (b, sk, hk, d), dev)?.to_dtype(DType::BF16)?;
        let v = Tensor::randn(0f32, 1., (b, sk, hk, d), dev)?.to_dtype(DType::BF16)?;
        let q = Tensor::randn(0f32, 1., (b, sq, h, d), dev)?.to_dtype(DType::BF16)?;
        let causals: Vec<bool> = if sq == 1 { vec![false] } else { vec![false, true] };
        for causal in causals {
            let bytes = (2 * b * sk * hk * d * 2) as f64;
            let attn = attn(1.0 / (d as f32).sqrt()).causal(causal);
            let auto = time(dev, || attn.forward(&q, &k, &v))?;
            let one = time(dev, || attn.clone().num_splits(1).forward(&q, &k, &v))?;
            println!(
                "| {b} | {sq} | {h}/{hk} | {sk} | {} | {:.1} | {:.2} | {:.1} | {:.2} |",
                causal as u8,
                auto * 1e6,
                bytes / auto / 1e12,
                one * 1e6,
                bytes / one / 1e12
            );
        }
    }
    Ok(())
}

/// The decode grid of the kvcache benchmark (batch, seqlen_q, seqlen_k): batch 1 / 8 / 32 / 128,
/// seqlen_q 1 and 4, seqlen_k 1k..128k with at most 1M cached tokens per call (2 GiB of K+V at
/// 4 kv heads of d128). scripts/kvcache_anchor.py has the same list.
fn kvcache_shapes() -> Vec<(usize, usize, usize)> {
    // BENCH_KV_SHAPES="batch:seqlen_q:seqlen_k,...": only these (a diagnostic, e.g. with a
    // FA3_TRACE build).
    if let Ok(list) = std::env::var("BENCH_KV_SHAPES") {
        return list
            .split(',')
            .map(|shape| {
                let v: Vec<usize> = shape
                    .split(':')
                    .map(|x| x.trim().parse().expect("BENCH_KV_SHAPES: batch:seqlen_q:seqlen_k"))
                    .collect();
                assert!(v.len() == 3, "BENCH_KV_SHAPES: batch:seqlen_q:seqlen_k, got {shape:?}");
                (v[0], v[1], v[2])
            })
            .collect();
    }
    let mut shapes = Vec::new();
    for b in [1, 8, 32, 128] {
        for sq in [1, 4] {
            for sk in [1024, 8192, 32768, 131072] {
                if b * sk <= 1 << 20 {
                    shapes.push((b, sq, sk));
                }
            }
        }
    }
    shapes
}

/// GPU time per call of `f`: one call (BENCH_GRAPH_CALLS: that many) captured into a CUDA graph
/// on candle's stream (cudarc's stream capture), then replayed back to back, so the host's work
/// per call drops out (how a serving engine runs its decode step). None, with the reason
/// printed, if the capture fails.
fn graph_time(dev: &Device, f: impl Fn() -> Result<Tensor>) -> Result<Option<f64>> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let stream = dev.as_cuda_device()?.cuda_stream();
    f()?; // kernels loaded, allocator warm
    dev.synchronize()?;
    let err = |e| candle_core::Error::Msg(format!("{e:?}"));
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(err)?;
    // BENCH_GRAPH_CALLS=n: n calls one after the other in the graph, the time per call (a call
    // that is not its graph's first node: in a decode step none is).
    let calls = std::env::var("BENCH_GRAPH_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1usize)
        .max(1);
    let mut out = f();
    for _ in 1..calls {
        if out.is_ok() {
            out = f();
        }
    }
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
    let (out, graph) = match (out, graph) {
        (Ok(out), Ok(Some(graph))) => (out, graph),
        (out, graph) => {
            println!("(graph capture failed: {:?} / {:?})", out.err(), graph.err());
            return Ok(None);
        }
    };
    // The output lives in the graph's memory, which the graph frees at its next launch.
    std::mem::forget(out);
    for _ in 0..3 {
        graph.launch().map_err(err)?;
    }
    dev.synchronize()?;
    let reps = 50;
    let start = Instant::now();
    for _ in 0..reps {
        graph.launch().map_err(err)?;
    }
    dev.synchronize()?;
    Ok(Some(start.elapsed().as_secs_f64() / (reps * calls) as f64))
}

/// `flash_attn_with_kvcache` without append (the attention over the cache; FA3's decode kernel
/// is timed the same way): 32 q heads on 4 kv heads (GQA 8), d128, bf16, every sequence at
/// seqlen_k keys; causal for seqlen_q > 1. Contiguous, then paged with pages of 16, 64 and 256
/// tokens (BENCH_PAGE_SIZES) in a shuffled pool (BENCH_PAGES_IN_ORDER: in order); K+V bytes read
/// per second, and paged / contiguous time.
fn kvcache_table(dev: &Device) -> Result<()> {
    // One stream: cudarc's per-tensor event tracking only costs host time here, and its event
    // waits would not be capturable (graph_time).
    // SAFETY: every tensor of this pass lives and is used on candle's one stream.
    unsafe { dev.as_cuda_device()?.disable_event_tracking() };
    let (h, hk, d) = (32, 4, 128);
    // The copy bandwidth: a 1 GiB device copy (read + write).
    let src = Tensor::zeros(1 << 29, DType::BF16, dev)?;
    let copy = time(dev, || src.copy())?;
    let copy_tbs = 2.0 * (1u64 << 30) as f64 / copy / 1e12;
    drop(src);
    // Three page sizes (the table's columns), each a power of two from 16 to 256 that divides
    // every shape's seqlen_k.
    let page_sizes: Vec<usize> = match std::env::var("BENCH_PAGE_SIZES") {
        Ok(v) => v
            .split(',')
            .map(|x| x.trim().parse().expect("BENCH_PAGE_SIZES: page sizes"))
            .collect(),
        Err(_) => vec![16, 64, 256],
    };
    assert!(
        page_sizes.len() == 3,
        "BENCH_PAGE_SIZES: three page sizes, got {page_sizes:?}"
    );
    let in_order = std::env::var_os("BENCH_PAGES_IN_ORDER").is_some_and(|v| v != "0");
    let splits: Option<usize> = std::env::var("BENCH_KV_SPLITS")
        .ok()
        .map(|v| v.trim().parse().expect("BENCH_KV_SPLITS: a split count"));
    println!("\nflash_attn_with_kvcache, d128, bf16, heads 32/4, no append: us per call, K+V TB/s");
    println!("(device copy: {copy_tbs:.2} TB/s read + write)");
    println!("graph: the contiguous call captured in a CUDA graph and replayed (GPU time, as FA3's graph column)");
    println!("graph, max splits: the same with num_splits(128) (a share per key block, up to 128)");
    println!(
        "page N: eager us and × the eager contiguous call, then the paged call's graph × the contiguous graph ({})",
        if in_order {
            "each sequence's pages in order"
        } else {
            "pages shuffled in the pool"
        }
    );
    let page_columns: String = page_sizes
        .iter()
        .map(|p| format!(" page {p} us | ×contig | graph ×contig |"))
        .collect();
    println!("| batch | seqlen_q | seqlen_k | contiguous us | TB/s | % copy | graph us | TB/s | graph, max splits us |{page_columns}");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for (b, sq, sk) in kvcache_shapes() {
        let bytes = (2 * b * sk * hk * d * 2) as f64;
        let q = Tensor::randn(0f32, 1., (b, sq, h, d), dev)?.to_dtype(DType::BF16)?;
        let k = Tensor::randn(0f32, 1., (b, sk, hk, d), dev)?.to_dtype(DType::BF16)?;
        let v = Tensor::randn(0f32, 1., (b, sk, hk, d), dev)?.to_dtype(DType::BF16)?;
        let lens = Tensor::new(vec![sk as u32; b].as_slice(), dev)?;
        let mut attn = attn(1.0 / (d as f32).sqrt()).causal(sq > 1);
        if let Some(splits) = splits {
            attn = attn.num_splits(splits);
        }
        let contiguous = time(dev, || attn.kv_cache(&k, &v, &lens).forward(&q))?;
        let mut row = format!(
            "| {b} | {sq} | {sk} | {:.1} | {:.2} | {:.0}% |",
            contiguous * 1e6,
            bytes / contiguous / 1e12,
            100.0 * bytes / contiguous / 1e12 / copy_tbs
        );
        let contiguous_graph = graph_time(dev, || attn.kv_cache(&k, &v, &lens).forward(&q))?;
        match contiguous_graph {
            Some(g) => row += &format!(" {:.1} | {:.2} |", g * 1e6, bytes / g / 1e12),
            None => row += " – | – |",
        }
        // The same with a share per key block (num_splits capped at the block count): what the
        // split threshold leaves on the table at short caches.
        let split_all = attn.clone().num_splits(128);
        match graph_time(dev, || split_all.kv_cache(&k, &v, &lens).forward(&q))? {
            Some(g) => row += &format!(" {:.1} |", g * 1e6),
            None => row += " – |",
        }
        for &page in &page_sizes {
            // The same keys in a shuffled pool of pages: page i of sequence s at pool[perm] (or
            // in order with BENCH_PAGES_IN_ORDER: what the shuffle itself costs).
            let per_seq = sk / page;
            let pages = b * per_seq;
            let mut perm: Vec<u32> = (0..pages as u32).collect();
            for i in (1..pages).rev().filter(|_| !in_order) {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                perm.swap(i, (seed % (i as u64 + 1)) as usize);
            }
            let table = Tensor::from_vec(perm, (b, per_seq), dev)?;
            let kp = Tensor::randn(0f32, 1., (pages, page, hk, d), dev)?.to_dtype(DType::BF16)?;
            let vp = Tensor::randn(0f32, 1., (pages, page, hk, d), dev)?.to_dtype(DType::BF16)?;
            let paged = time(dev, || attn.kv_cache(&kp, &vp, &lens).page_table(&table).forward(&q))?;
            row += &format!(" {:.1} | {:.2} |", paged * 1e6, paged / contiguous);
            let paged_graph = graph_time(dev, || attn.kv_cache(&kp, &vp, &lens).page_table(&table).forward(&q))?;
            match (paged_graph, contiguous_graph) {
                (Some(p), Some(c)) => row += &format!(" {:.2} |", p / c),
                _ => row += " – |",
            }
        }
        println!("{row}");
    }
    Ok(())
}

/// FP8 KV caches against bf16 ones: the same decode shapes (seqlen_q 1, no append), contiguous
/// and paged by 64, µs per call and the ratio, then the contiguous calls replayed from a CUDA
/// graph (GPU time only). The fp8 calls pass descales of ones per (sequence, kv head), as the
/// model does. The fp8 call's kernel transposes V tiles in shared memory
/// (kernels/flash_fwd/transpose_v.cuh). Head dims from BENCH_KV_FP8_D (comma-separated, default
/// 128): 128 with heads 32/4, 64 with the Llama-3.2-1B shape's 32/8.
/// Single-query decode over short 16-bit caches: the CUDA-core decode kernel
/// (`Tuning::decode_kernel: Some(true)`) against the forward kernel (`Some(false)`) on the same
/// calls, µs per call eager and graph-replayed; the 1B model's shape (d64, 32/8 heads) and the
/// kvcache grid's (d128, 32/4), contiguous and pages of 16. BENCH_DECODE_KEYS /
/// BENCH_DECODE_BATCHES: the key counts and batches; BENCH_DECODE_DIMS: the head dims (64, 128);
/// BENCH_DECODE_HEADS=h:hk: the head-dim-64 shape's q and kv heads; BENCH_DECODE_ONCE: two untimed calls of
/// each kernel per cell (for Nsight Compute); BENCH_DECODE_APPEND: each call appends one key per
/// sequence with rotary (the cache then holds seqlen_k keys; every call writes the same row), or
/// with BENCH_DECODE_APPEND=plain without rotary, or with BENCH_DECODE_APPEND=rotary turns q only.
fn kvcache_decode_table(dev: &Device) -> Result<()> {
    // SAFETY: every tensor of this pass lives and is used on candle's one stream.
    unsafe { dev.as_cuda_device()?.disable_event_tracking() };
    let keys = list("BENCH_DECODE_KEYS", &[128, 640, 1024, 2048, 4096]);
    let batches = list("BENCH_DECODE_BATCHES", &[1, 8, 32, 128]);
    let mode = std::env::var("BENCH_DECODE_APPEND").ok();
    let (append, rotary) = match mode.as_deref() {
        None => (false, false),
        Some("plain") => (true, false),
        Some("rotary") => (false, true),
        Some(_) => (true, true),
    };
    let what = match (append, rotary) {
        (true, true) => "append of one key with rotary",
        (true, false) => "append of one key, no rotary",
        (false, true) => "no append, q turned by rotary",
        (false, false) => "no append",
    };
    println!("\nflash_attn_with_kvcache, seqlen_q 1, bf16, {what}: the decode kernel against the forward kernel, us per call");
    println!("| shape | batch | seqlen_k | cache | forward us | decode us | decode / forward | forward graph us | decode graph us | decode / forward |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let dims = list("BENCH_DECODE_DIMS", &[64, 128]);
    // BENCH_DECODE_HEADS=h:hk, the head-dim-64 shape's heads instead of the 1B model's 32/8.
    let (h64, hk64) = match std::env::var("BENCH_DECODE_HEADS") {
        Ok(v) => v
            .split_once(':')
            .and_then(|(h, hk)| Some((h.trim().parse().ok()?, hk.trim().parse().ok()?)))
            .unwrap_or_else(|| panic!("BENCH_DECODE_HEADS: want h:hk (q heads : kv heads), got {v:?}")),
        Err(_) => (32, 8),
    };
    for (h, hk, d) in [(h64, hk64, 64), (32, 4, 128)] {
        if !dims.contains(&d) {
            continue;
        }
        for &b in &batches {
            for &sk in &keys {
                for page in [None, Some(16)] {
                    let lens = Tensor::new(vec![sk as u32 - append as u32; b].as_slice(), dev)?;
                    let q = Tensor::randn(0f32, 1., (b, 1, h, d), dev)?.to_dtype(DType::BF16)?;
                    let new_rows = || Tensor::randn(0f32, 1., (b, 1, hk, d), dev)?.to_dtype(DType::BF16);
                    let (k_new, v_new) = (new_rows()?, new_rows()?);
                    let angles = Tensor::randn(0f32, 1., (sk, d / 2), dev)?;
                    let (cos, sin) = (angles.cos()?, angles.sin()?);
                    let cache = |pages: Option<usize>| -> Result<Tensor> {
                        let t = Tensor::randn(0f32, 1., (b, sk, hk, d), dev)?.to_dtype(DType::BF16)?;
                        match pages {
                            Some(ps) => t.reshape((b * sk / ps, ps, hk, d)),
                            None => Ok(t),
                        }
                    };
                    let (k, v) = (cache(page)?, cache(page)?);
                    let table = match page {
                        Some(ps) => Some(Tensor::from_vec(
                            (0..(b * sk / ps) as u32).collect::<Vec<_>>(),
                            (b, sk / ps),
                            dev,
                        )?),
                        None => None,
                    };
                    let call = |kernel: bool| -> Result<Tensor> {
                        let mut t = tuning();
                        t.decode_kernel = Some(kernel);
                        let attn = FlashAttn::new(1.0 / (d as f32).sqrt()).causal(true).tuning(t);
                        let mut c = attn.kv_cache(&k, &v, &lens);
                        if append {
                            c = c.append(&k_new, &v_new);
                        }
                        if rotary {
                            c = c.rotary(&cos, &sin, false);
                        }
                        match &table {
                            Some(table) => c.page_table(table).forward(&q),
                            None => c.forward(&q),
                        }
                    };
                    if std::env::var_os("BENCH_DECODE_ONCE").is_some() {
                        // Two calls of each kernel and no timing: for Nsight Compute's kernel
                        // durations (`ncu -k regex:"kvcache_decode|flash_fwd"`), one cell a line.
                        println!("cell d{d} {h}/{hk} batch {b} keys {sk} page {page:?}");
                        for kernel in [false, true, false, true] {
                            call(kernel)?;
                        }
                        dev.synchronize()?;
                        continue;
                    }
                    let (fwd, dec) = (time(dev, || call(false))?, time(dev, || call(true))?);
                    let graphs = (graph_time(dev, || call(false))?, graph_time(dev, || call(true))?);
                    let graph_cells = match graphs {
                        (Some(f), Some(g)) => format!(" {:.1} | {:.1} | {:.2} |", f * 1e6, g * 1e6, g / f),
                        _ => " – | – | – |".to_string(),
                    };
                    let cache_label = page.map_or("contiguous".to_string(), |ps| format!("page {ps}"));
                    println!(
                        "| d{d} {h}/{hk} | {b} | {sk} | {cache_label} | {:.1} | {:.1} | {:.2} |{graph_cells}",
                        fwd * 1e6,
                        dec * 1e6,
                        dec / fwd
                    );
                }
            }
        }
    }
    Ok(())
}

fn kvcache_fp8_tables(dev: &Device) -> Result<()> {
    let dims = std::env::var("BENCH_KV_FP8_D").unwrap_or_else(|_| "128".into());
    for d in dims.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        match d {
            "128" => kvcache_fp8_table(dev, 32, 4, 128)?,
            "64" => kvcache_fp8_table(dev, 32, 8, 64)?,
            other => candle_core::bail!("BENCH_KV_FP8_D: head dim {other} (64 or 128)"),
        }
    }
    Ok(())
}

fn kvcache_fp8_table(dev: &Device, h: usize, hk: usize, d: usize) -> Result<()> {
    let e4m3 = |t: &Tensor| -> Result<Tensor> { t.to_device(&Device::Cpu)?.to_dtype(DType::F8E4M3)?.to_device(dev) };
    println!("\nflash_attn_with_kvcache, d{d}, heads {h}/{hk}, seqlen_q 1, no append: fp8 (e4m3) caches against bf16, us per call");
    println!("| batch | seqlen_k | bf16 us | fp8 us | fp8 / bf16 | bf16 page 64 us | fp8 page 64 us | fp8 / bf16 | bf16 graph us | fp8 graph us | fp8 / bf16 |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for (b, sk) in [(1, 8192), (8, 8192), (8, 32768), (32, 8192), (32, 32768), (128, 8192)] {
        let lens = Tensor::new(vec![sk as u32; b].as_slice(), dev)?;
        let q = Tensor::randn(0f32, 1., (b, 1, h, d), dev)?;
        let k = Tensor::randn(0f32, 1., (b, sk, hk, d), dev)?;
        let v = Tensor::randn(0f32, 1., (b, sk, hk, d), dev)?;
        let table = Tensor::from_vec((0..(b * sk / 64) as u32).collect::<Vec<_>>(), (b, sk / 64), dev)?;
        let attn = attn(1.0 / (d as f32).sqrt());
        let ones = Tensor::ones((b, hk), DType::F32, dev)?;
        let attn8 = attn.clone().descale(Some(&ones), Some(&ones), Some(&ones));
        let mut row = format!("| {b} | {sk} |");
        let mut graph_cells = String::new();
        for paged in [false, true] {
            let pages = |t: &Tensor| -> Result<Tensor> {
                match paged {
                    true => t.reshape((b * sk / 64, 64, hk, d)),
                    false => Ok(t.clone()),
                }
            };
            let (q16, k16, v16) = (
                q.to_dtype(DType::BF16)?,
                pages(&k.to_dtype(DType::BF16)?)?,
                pages(&v.to_dtype(DType::BF16)?)?,
            );
            let (q8, k8, v8) = (e4m3(&q)?, pages(&e4m3(&k)?)?, pages(&e4m3(&v)?)?);
            let call = |attn: &FlashAttn, q: &Tensor, k: &Tensor, v: &Tensor| -> Result<Tensor> {
                let c = attn.kv_cache(k, v, &lens);
                match paged {
                    true => c.page_table(&table).forward(q),
                    false => c.forward(q),
                }
            };
            let bf16 = time(dev, || call(&attn, &q16, &k16, &v16))?;
            let fp8 = time(dev, || call(&attn8, &q8, &k8, &v8))?;
            row += &format!(" {:.1} | {:.1} | {:.2} |", bf16 * 1e6, fp8 * 1e6, fp8 / bf16);
            // The eager cells first: a failing capture below still leaves them in the log.
            print!("{}", std::mem::take(&mut row));
            std::io::stdout().flush()?;
            if !paged {
                let graphs = (
                    graph_time(dev, || call(&attn, &q16, &k16, &v16))?,
                    graph_time(dev, || call(&attn8, &q8, &k8, &v8))?,
                );
                graph_cells = match graphs {
                    (Some(g16), Some(g8)) => format!(" {:.1} | {:.1} | {:.2} |", g16 * 1e6, g8 * 1e6, g8 / g16),
                    _ => " – | – | – |".to_string(),
                };
            }
        }
        println!("{graph_cells}");
    }
    Ok(())
}

/// The forward over the paper grid, q, k and v each made by `input` from its (b, s, h, d) shape:
/// TFLOP/s per (head dim, mask) row, each cell also printed as a `label` line in the anchors'
/// format, then the grid as a table under `title`.
fn forward_grid(
    dev: &Device,
    seqs: &[usize],
    hdims: &[usize],
    label: &str,
    title: &str,
    input: impl Fn((usize, usize, usize, usize)) -> Result<Tensor>,
) -> Result<()> {
    let mut table = Vec::new();
    for &d in hdims {
        for causal in list("BENCH_CAUSAL", &[0, 1]).into_iter().map(|c| c != 0) {
            let mut row = Vec::new();
            for &s in seqs {
                let (b, h) = (16384 / s, 2048 / d);
                let (q, k, v) = (input((b, s, h, d))?, input((b, s, h, d))?, input((b, s, h, d))?);
                let attn = attn(1.0 / (d as f32).sqrt()).causal(causal);
                let secs = time(dev, || attn.forward(&q, &k, &v))?;
                let flops = 4.0 * (b * h * s * s * d) as f64 / if causal { 2.0 } else { 1.0 };
                let tflops = flops / secs / 1e12;
                println!(
                    "{label:<12} fwd d={d:>3} causal={} s={s:>5} b={b:>2} h={h:>2}: {:>8.3} ms {tflops:>7.1} TFLOP/s",
                    causal as u8,
                    secs * 1e3
                );
                row.push(tflops);
            }
            table.push((d, causal, row));
        }
    }
    print_grid(title, seqs, &table);
    Ok(())
}

/// The GPU quantizer (flash_attn3::fp8) on one bf16 input of the grid's size (16k tokens, hidden
/// 2048) per head dim and granularity: µs per tensor, GB/s of one read plus one write (per head
/// and per tensor read the input twice: their scale needs the whole sequence first), against
/// candle's own copy of the same tensor, and the three tensors' time (q, k, v) next to the fp8
/// forward they feed at seqlen 4k, unmasked.
fn quantize_table(dev: &Device, hdims: &[usize]) -> Result<()> {
    let (tokens, hidden) = (16384usize, 2048usize);
    let seqlen = 4096;
    let x = Tensor::randn(0f32, 1., (tokens / seqlen, seqlen, 1, hidden), dev)?.to_dtype(DType::BF16)?;
    let bytes = (x.elem_count() * 3) as f64; // 2 bytes in, 1 out
    let copy_secs = time(dev, || x.copy())?;
    let copy_gbs = (x.elem_count() * 4) as f64 / copy_secs / 1e9;
    println!("\nfp8 quantize of one bf16 (4, 4096, 2048 / d, d) tensor; candle's bf16 copy of it: {copy_gbs:.0} GB/s");
    println!("| head dim | granularity | µs | GB/s | of copy | q+k+v / fp8 fwd at 4k |");
    println!("|---|---|---|---|---|---|");
    for &d in hdims {
        let x = x.reshape((tokens / seqlen, seqlen, hidden / d, d))?;
        let q8 = fp8::quantize(&x, Granularity::Head)?.data;
        let attn = attn(1.0 / (d as f32).sqrt());
        let fwd = time(dev, || attn.forward(&q8, &q8, &q8))?;
        let cases: [(&str, Quantizer); 5] = [
            ("tensor", Quantizer::new(Granularity::Tensor)),
            ("head", Quantizer::new(Granularity::Head)),
            ("block 64", Quantizer::new(Granularity::Block(fp8::Q_BLOCK_ROWS))),
            ("block 128", Quantizer::new(Granularity::Block(fp8::K_BLOCK_ROWS))),
            (
                "block 64 + incoherent",
                Quantizer::new(Granularity::Block(fp8::Q_BLOCK_ROWS)).incoherent(7),
            ),
        ];
        for (name, quantizer) in cases {
            let secs = time(dev, || Ok(quantizer.quantize(&x)?.data))?;
            let gbs = bytes / secs / 1e9;
            println!(
                "| {d} | {name} | {:.1} | {gbs:.0} | {:.0}% | {:.2} |",
                secs * 1e6,
                100.0 * gbs / copy_gbs,
                3.0 * secs / fwd
            );
        }
    }
    Ok(())
}

/// A grid of TFLOP/s as a Markdown table: one row per (head dim, mask), one column per seqlen.
fn print_grid(title: &str, seqs: &[usize], table: &[(usize, bool, Vec<f64>)]) {
    println!("\n{title}");
    print!("| head dim | mask |");
    for s in seqs {
        print!(" {} |", seq_label(*s));
    }
    println!("\n|---|---|{}", "---|".repeat(seqs.len()));
    for (d, causal, row) in table {
        print!("| {d} | {} |", if *causal { "causal" } else { "full" });
        for t in row {
            print!(" {t:.0} |");
        }
        println!();
    }
}

/// RMSE of our fp8 output against the f64 reference that scripts/fp8_anchors.py stored in `dir`.
fn fp8_accuracy(dev: &Device, dir: &str) -> Result<()> {
    let shape = list("BENCH_FP8_ACC_SHAPE", &[2, 4096, 16, 128]);
    let shape = (shape[0], shape[1], shape[2], shape[3]);
    let read = |name: &str| -> Result<Tensor> {
        let bytes = std::fs::read(format!("{dir}/{name}"))?;
        let values: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Tensor::from_vec(values, shape, dev)
    };
    let (q, k, v, want) = (read("q.f32")?, read("k.f32")?, read("v.f32")?, read("ref.f32")?);
    let scale = 1.0 / (shape.3 as f32).sqrt();
    let rmse = |out: &Tensor| -> Result<f64> {
        let diff = (out.to_dtype(DType::F32)? - &want)?;
        Ok((diff.sqr()?.mean_all()?.to_scalar::<f32>()? as f64).sqrt())
    };
    let bf16 = attn(scale).forward(
        &q.to_dtype(DType::BF16)?,
        &k.to_dtype(DType::BF16)?,
        &v.to_dtype(DType::BF16)?,
    )?;
    println!("ACC ours_bf16 rmse={:.3e}", rmse(&bf16)?);
    let cases: [(&str, Granularity, Granularity, Option<u64>); 4] = [
        ("per-tensor", Granularity::Tensor, Granularity::Tensor, None),
        ("per-head", Granularity::Head, Granularity::Head, None),
        (
            "per-block",
            Granularity::Block(fp8::Q_BLOCK_ROWS),
            Granularity::Block(fp8::K_BLOCK_ROWS),
            None,
        ),
        (
            "per-block+incoherent",
            Granularity::Block(fp8::Q_BLOCK_ROWS),
            Granularity::Block(fp8::K_BLOCK_ROWS),
            Some(0x5eed),
        ),
    ];
    for (name, gq, gk, seed) in cases {
        let with = |g: Granularity| match seed {
            Some(s) => Quantizer::new(g).incoherent(s),
            None => Quantizer::new(g),
        };
        let (q8, k8) = (with(gq).quantize(&q)?, with(gk).quantize(&k)?);
        let gv = if gq == Granularity::Tensor {
            Granularity::Tensor
        } else {
            Granularity::Head
        };
        let v8 = Quantizer::new(gv).quantize(&v)?;
        let out = attn(scale)
            .descale(Some(&q8.descale), Some(&k8.descale), Some(&v8.descale))
            .forward(&q8.data, &k8.data, &v8.data)?;
        println!("ACC ours_fp8 {name} rmse={:.3e}", rmse(&out)?);
    }
    Ok(())
}

fn main() -> Result<()> {
    let dev = Device::new_cuda(0)?;
    // Freed memory stays in the GPU's pool across synchronisations, as under PyTorch's caching
    // allocator (the anchors'); BENCH_POOL_RELEASE=1 keeps CUDA's default, which hands it back at
    // each one (a call right after a synchronisation then maps its buffers again).
    if std::env::var_os("BENCH_POOL_RELEASE").is_none() {
        flash_attn3::retain_freed_device_memory(&dev)?;
    }
    if let Ok(dir) = std::env::var("BENCH_FP8_ACC_DIR") {
        fp8_accuracy(&dev, &dir)?;
    }
    let seqs = list("BENCH_SEQS", &[512, 1024, 2048, 4096, 8192, 16384]);
    let hdims = list("BENCH_HDIMS", &[64, 128, 256]);
    let passes = std::env::var("BENCH_PASSES").unwrap_or_else(|_| "fwd".into());
    if passes.split(',').any(|p| p.trim() == "bwd") {
        backward_grid(&dev, &seqs, &hdims)?;
    }
    if passes.split(',').any(|p| p.trim() == "fp8") {
        // e4m3 inputs with descales of 1 (the op's cost does not depend on their values); candle
        // 0.11's CUDA backend has no f32 -> e4m3 cast, so they are made on the host: three
        // tensors of the grid's 16k tokens × hidden 2048 once, reshaped to each cell's
        // (b, s, h, d) and handed out in turn as q, k and v (a host cast per cell took longer
        // than the timing).
        let made = (0..3)
            .map(|_| {
                Tensor::randn(0f32, 1., (16384, 2048), &Device::Cpu)?
                    .to_dtype(DType::F8E4M3)?
                    .to_device(&dev)
            })
            .collect::<Result<Vec<_>>>()?;
        let turn = std::cell::Cell::new(0usize);
        let e4m3 = |shape: (usize, usize, usize, usize)| {
            let i = turn.get();
            turn.set((i + 1) % made.len());
            made[i].reshape(shape)
        };
        let title = "GPU forward, fp8 (e4m3 in, bf16 out), TFLOP/s (16k tokens, hidden 2048)";
        forward_grid(&dev, &seqs, &hdims, "ours_fp8", title, e4m3)?;
    }
    if passes.split(',').any(|p| p.trim() == "quantize") {
        quantize_table(&dev, &hdims)?;
    }
    if passes.split(',').any(|p| p.trim() == "kvcache") {
        kvcache_table(&dev)?;
    }
    if passes.split(',').any(|p| p.trim() == "kvcache_decode") {
        kvcache_decode_table(&dev)?;
    }
    if passes.split(',').any(|p| p.trim() == "kvcache_fp8") {
        kvcache_fp8_tables(&dev)?;
    }
    if !passes.split(',').any(|p| p.trim() == "fwd") {
        return Ok(());
    }
    let bf16 = |shape| Tensor::randn(0f32, 1., shape, &dev)?.to_dtype(DType::BF16);
    let title = "GPU forward, bf16, TFLOP/s (16k tokens, hidden 2048)";
    forward_grid(&dev, &seqs, &hdims, "ours", title, bf16)?;

    if std::env::var("BENCH_DECODE").map(|v| v != "0").unwrap_or(true) {
        decode_shapes(&dev)?;
    }
    Ok(())
}
