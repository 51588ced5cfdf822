//! GPU tests of flash-llama's training ops (kernels/model/train_ops.cu): forward and gradients
//! of each op against the composed candle ops (in f32 on the same input values, through
//! candle's autograd) on CUDA, bf16/f16/f32, odd sizes; and the CUDA kernels against the CPU
//! loops of the same ops. Needs the `cuda` feature and a Hopper GPU.

mod common;
mod train_ops_common;

use candle_core::{DType, Device, Result, Tensor, Var};
use flash_llama::train_ops;
use train_ops_common::{randn, rel_diff};

fn gpu() -> Device {
    Device::new_cuda(0).expect("a CUDA device")
}

/// A rounding or two of the dtype (bf16 ~1e-2 relative).
const CASES: [(DType, f32); 3] = [(DType::BF16, 2e-2), (DType::F16, 4e-3), (DType::F32, 1e-5)];

#[test]
fn rms_norm_matches_composed_on_the_gpu() -> Result<()> {
    for (dtype, tol) in CASES {
        train_ops_common::rms_norm(&gpu(), dtype, tol)?;
    }
    Ok(())
}

#[test]
fn rope_matches_composed_on_the_gpu() -> Result<()> {
    for (dtype, tol) in CASES {
        train_ops_common::rope(&gpu(), dtype, tol)?;
    }
    Ok(())
}

#[test]
fn swiglu_matches_composed_on_the_gpu() -> Result<()> {
    for (dtype, tol) in CASES {
        train_ops_common::swiglu(&gpu(), dtype, tol)?;
    }
    Ok(())
}

#[test]
fn embedding_matches_candle_nn_on_the_gpu() -> Result<()> {
    for (dtype, tol) in CASES {
        train_ops_common::embedding(&gpu(), dtype, tol)?;
    }
    Ok(())
}

#[test]
fn cross_entropy_matches_an_f64_reference_on_the_gpu() -> Result<()> {
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        train_ops_common::cross_entropy(&gpu(), dtype)?;
    }
    Ok(())
}

/// Output and input gradients of `f` on CUDA and on the CPU, same inputs, same output gradient.
fn cuda_vs_cpu(what: &str, inputs: &[Tensor], f: impl Fn(&[Tensor]) -> Result<Tensor>, tol: f32) -> Result<()> {
    let r = randn(inputs[0].dims(), DType::F32, &Device::Cpu);
    let run = |dev: &Device| -> Result<(Tensor, Vec<Tensor>)> {
        let vars: Vec<Var> = inputs
            .iter()
            .map(|t| Var::from_tensor(&t.to_device(dev)?))
            .collect::<Result<_>>()?;
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = f(&ts)?;
        let grads = (y.to_dtype(DType::F32)? * r.to_device(dev)?)?.sum_all()?.backward()?;
        let g = vars
            .iter()
            .map(|v| grads.get(v).unwrap().to_device(&Device::Cpu))
            .collect::<Result<_>>()?;
        Ok((y.to_device(&Device::Cpu)?, g))
    };
    let (y, g) = run(&gpu())?;
    let (y_cpu, g_cpu) = run(&Device::Cpu)?;
    let d = rel_diff(&y, &y_cpu);
    let dg: Vec<f32> = g.iter().zip(&g_cpu).map(|(a, b)| rel_diff(a, b)).collect();
    eprintln!("{what}: CUDA vs CPU forward {d:.2e}, gradients {dg:?}");
    assert!(d <= tol && dg.iter().all(|&d| d <= tol), "{what}: CUDA and CPU differ");
    Ok(())
}

#[test]
fn kernels_match_the_cpu_loops() -> Result<()> {
    let cpu = Device::Cpu;
    for (dtype, tol) in CASES {
        let x = randn(&[257, 768], dtype, &cpu);
        let w = randn(&[768], dtype, &cpu);
        cuda_vs_cpu(
            &format!("RMSNorm {dtype:?}"),
            &[x, w],
            |t| train_ops::rms_norm(&t[0], &t[1], 1e-5),
            tol,
        )?;
        let x = randn(&[129, 3, 64], dtype, &cpu);
        let cos = randn(&[129, 32], dtype, &cpu);
        let sin = randn(&[129, 32], dtype, &cpu);
        for interleaved in [false, true] {
            cuda_vs_cpu(
                &format!("RoPE interleaved {interleaved} {dtype:?}"),
                std::slice::from_ref(&x),
                |t| {
                    let dev = t[0].device();
                    train_ops::rope(&t[0], &cos.to_device(dev)?, &sin.to_device(dev)?, interleaved)
                },
                tol,
            )?;
        }
        let (g, u) = (randn(&[131, 345], dtype, &cpu), randn(&[131, 345], dtype, &cpu));
        cuda_vs_cpu(
            &format!("SiLU × up {dtype:?}"),
            &[g, u],
            |t| train_ops::swiglu(&t[0], &t[1]),
            tol,
        )?;
    }
    Ok(())
}

/// The optimizer step on the GPU (global norm, clip scale and AdamW over every tensor in three
/// multi-tensor launches) against an f64 reference: decayed (matrix) and undecayed (vector)
/// parameters of odd sizes, one of several chunks; five steps with fresh gradients: clipped,
/// a NaN gradient (skipped: nothing changes), unclipped (clip 0), an infinite loss (skipped),
/// clipped again. The CPU's composed ops against the same reference.
#[test]
fn fused_adamw_matches_an_f64_reference() -> Result<()> {
    use flash_llama::train::optim::{AdamW, AdamWParams};
    let params = AdamWParams {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    // 77,100 elements: two whole chunks of the kernels (32,768) and a partial one.
    let shapes: [&[usize]; 3] = [&[37, 129], &[1001], &[300, 257]];
    let host = |t: &Tensor| -> Result<Vec<f64>> {
        Ok(t.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f64::from).collect())
    };
    let init_p: Vec<Tensor> = shapes.iter().map(|s| randn(s, DType::F32, &Device::Cpu)).collect();
    // Moments as after some steps: m of either sign, v positive.
    let init_m: Vec<Tensor> = shapes
        .iter()
        .map(|s| (randn(s, DType::F32, &Device::Cpu) * 0.01).unwrap())
        .collect();
    let init_v: Vec<Tensor> = shapes
        .iter()
        .map(|s| (randn(s, DType::F32, &Device::Cpu).sqr().unwrap() * 1e-4).unwrap())
        .collect();
    // (clip, loss, a NaN in the gradients); gradient norms are about 0.1 * sqrt(82,874) ≈ 29.
    let plan: [(f64, f32, bool); 5] = [
        (10.0, 2.5, false),
        (10.0, 2.4, true),
        (0.0, 2.3, false),
        (10.0, f32::INFINITY, false),
        (20.0, 2.2, false),
    ];
    let grads: Vec<Vec<Tensor>> = plan
        .iter()
        .map(|&(_, _, nan)| {
            shapes
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let g = (randn(s, DType::F32, &Device::Cpu) * 0.1).unwrap();
                    if nan && i == 2 {
                        let mut v = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                        v[40_000] = f32::NAN;
                        Tensor::from_vec(v, *s, &Device::Cpu).unwrap()
                    } else {
                        g
                    }
                })
                .collect()
        })
        .collect();
    let lr = 3e-3;

    // The f64 reference, with each step's expected norm and whether it applies.
    let mut rp: Vec<Vec<f64>> = init_p.iter().map(host).collect::<Result<_>>()?;
    let mut rm: Vec<Vec<f64>> = init_m.iter().map(host).collect::<Result<_>>()?;
    let mut rv: Vec<Vec<f64>> = init_v.iter().map(host).collect::<Result<_>>()?;
    let mut want_stats = Vec::new();
    let mut applied = 0usize;
    for (k, step_grads) in grads.iter().enumerate() {
        let (clip, loss, _) = plan[k];
        let g64: Vec<Vec<f64>> = step_grads.iter().map(host).collect::<Result<_>>()?;
        let norm = g64.iter().flatten().map(|g| g * g).sum::<f64>().sqrt();
        let skip = !norm.is_finite() || !loss.is_finite();
        want_stats.push((norm, skip));
        if skip {
            continue;
        }
        applied += 1;
        let step = applied + 3; // as if three steps had been taken before
        let scale = if clip > 0.0 && norm > clip { clip / norm } else { 1.0 };
        let c1 = 1.0 - params.beta1.powi(step as i32);
        let c2 = 1.0 - params.beta2.powi(step as i32);
        for (i, g) in g64.iter().enumerate() {
            let decay = if shapes[i].len() >= 2 {
                1.0 - lr * params.weight_decay
            } else {
                1.0
            };
            for (j, gj) in g.iter().enumerate() {
                let gj = gj * scale;
                rm[i][j] = params.beta1 * rm[i][j] + (1.0 - params.beta1) * gj;
                rv[i][j] = params.beta2 * rv[i][j] + (1.0 - params.beta2) * gj * gj;
                let update = (rm[i][j] / c1) / ((rv[i][j] / c2).sqrt() + params.eps);
                rp[i][j] = rp[i][j] * decay - lr * update;
            }
        }
    }
    assert!(
        want_stats[0].0 > 10.0 && want_stats[4].0 > 20.0,
        "the plan's clipped steps must clip"
    );

    for dev in [gpu(), Device::Cpu] {
        let vars: Vec<Var> = init_p
            .iter()
            .map(|p| Var::from_tensor(&p.to_device(&dev)?))
            .collect::<Result<_>>()?;
        let mut opt = AdamW::new(&vars, params)?;
        opt.m = init_m.iter().map(|t| t.to_device(&dev)).collect::<Result<_>>()?;
        opt.v = init_v.iter().map(|t| t.to_device(&dev)).collect::<Result<_>>()?;
        let mut applied = 0;
        for (k, step_grads) in grads.iter().enumerate() {
            let g: Vec<Tensor> = step_grads.iter().map(|t| t.to_device(&dev)).collect::<Result<_>>()?;
            let (clip, loss, _) = plan[k];
            let loss = Tensor::new(loss, &dev)?;
            // The trainer passes the number of the update about to be made (skipped ones do not count).
            let stats = opt.update(&vars, &g, &loss, clip, lr, applied + 4)?.to_vec1::<f32>()?;
            let (norm, skip) = want_stats[k];
            assert_eq!(
                stats[2] != 0.0,
                skip,
                "step {k} on {dev:?}: skipped {} (want {skip})",
                stats[2]
            );
            if norm.is_finite() {
                let rel = (f64::from(stats[0]) - norm).abs() / norm;
                assert!(
                    rel <= 1e-5,
                    "step {k} on {dev:?}: norm {} against {norm} (relative {rel:e})",
                    stats[0]
                );
            } else {
                assert!(
                    !stats[0].is_finite(),
                    "step {k} on {dev:?}: norm {} of a NaN gradient",
                    stats[0]
                );
            }
            if !skip {
                applied += 1;
            }
        }
        for i in 0..shapes.len() {
            for (what, got, want) in [
                ("parameter", vars[i].as_tensor(), &rp[i]),
                ("m", &opt.m[i], &rm[i]),
                ("v", &opt.v[i], &rv[i]),
            ] {
                let got = host(got)?;
                let scale = want.iter().fold(0f64, |a, x| a.max(x.abs()));
                let worst = got.iter().zip(want).fold(0f64, |a, (x, y)| {
                    // NaN never passes: a NaN difference makes `worst` infinite.
                    let d = (x - y).abs();
                    if d.is_nan() {
                        f64::INFINITY
                    } else {
                        a.max(d)
                    }
                });
                assert!(
                    worst <= 2e-6 * scale,
                    "AdamW on {dev:?}, tensor {i} {what}: max abs error {worst:e} (max |reference| {scale:e})"
                );
            }
        }
    }
    Ok(())
}

/// Context-parallel (ring) attention on the GPU, bf16: 2 and 3 ranks as threads on one GPU
/// (`LocalGroup`; NCCL ranks run the same code on several GPUs), each rank's output and
/// gradients against the rows of one flash-attn3 call over the whole sequence.
#[test]
fn ring_attention_matches_the_whole_sequence_on_the_gpu() -> Result<()> {
    use flash_llama::parallel::context::RingAttention;
    use flash_llama::parallel::{Communicator, LocalGroup};
    let dev = gpu();
    for (world, chunk, causal) in [(2, 200, true), (3, 131, true), (2, 97, false)] {
        let (b, h, hk, d) = (2, 8, 2, 128);
        let s = world * chunk;
        let q = randn(&[b, s, h, d], DType::BF16, &dev);
        let k = randn(&[b, s, hk, d], DType::BF16, &dev);
        let v = randn(&[b, s, hk, d], DType::BF16, &dev);
        let dout = randn(&[b, s, h, d], DType::BF16, &dev);
        let scale = 1.0 / (d as f32).sqrt();
        let attn = flash_attn3::FlashAttn::new(scale).causal(causal);
        let (out, lse) = attn.forward_with_lse(&q, &k, &v)?;
        let (dq, dk, dv) = attn.backward(&q, &k, &v, &out, &lse, &dout)?;
        let rows = |t: &Tensor, r: usize| t.narrow(1, r * chunk, chunk).unwrap().contiguous().unwrap();
        // candle queues each thread's GPU work on that thread's own stream: the inputs must be
        // written before the ranks' threads read them, and each rank's results before this
        // thread reads them.
        dev.synchronize()?;
        let groups = LocalGroup::new(world)?;
        let ranks: Vec<_> = std::thread::scope(|sc| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|g| {
                    let (q, k, v, dout) = (&q, &k, &v, &dout);
                    sc.spawn(move || -> Result<_> {
                        let r = g.rank();
                        let ring = RingAttention::new(scale).causal(causal);
                        let (qr, kr, vr) = (rows(q, r), rows(k, r), rows(v, r));
                        let (o, l) = ring.forward_with_lse(&g, &qr, &kr, &vr)?;
                        let grads = ring.backward(&g, &qr, &kr, &vr, &o, &l, &rows(dout, r))?;
                        qr.device().synchronize()?;
                        Ok((o, grads))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
        });
        for (r, res) in ranks.into_iter().enumerate() {
            let (o, (gq, gk, gv)) = res?;
            for (name, got, want) in [
                ("out", o, rows(&out, r)),
                ("dq", gq, rows(&dq, r)),
                ("dk", gk, rows(&dk, r)),
                ("dv", gv, rows(&dv, r)),
            ] {
                let e = rel_diff(&got, &want);
                assert!(
                    e < 3e-2,
                    "{world} ranks, chunk {chunk}, causal {causal}, rank {r}: {name} rel diff {e}"
                );
            }
        }
    }
    Ok(())
}

/// The explicit backward on the GPU in bf16 against `loss.backward()` through the model on the
/// GPU in bf16, both against the f32 gradients of the CPU (the same weights: the trainer draws
/// them on the host from its seed). Head dim 64 with GQA 4:2, with and without a sliding
/// window, 2 × 300 tokens (not a multiple of any tile).
#[test]
fn explicit_backward_matches_autograd_on_the_gpu() -> Result<()> {
    use flash_llama::train::{self, data, Backward, TrainConfig, Trainer};
    let mut model_cfg = train::llama_config(data::BYTE_VOCAB_SIZE, 256, 384, 2, 4, 2, 512);
    let (_, base) = train::preset("tiny", data::BYTE_VOCAB_SIZE).unwrap();
    let cfg = TrainConfig {
        batch_size: 2,
        seq_len: 300,
        ..base
    };
    for window in [None, Some(77)] {
        model_cfg.sliding_window = window;
        let gpu_trainer = Trainer::new(model_cfg.clone(), cfg.clone(), DType::BF16, &gpu()).unwrap();
        let cpu_trainer = Trainer::new(model_cfg.clone(), cfg.clone(), DType::F32, &Device::Cpu).unwrap();
        let mut rng = data::Rng(5);
        let ids: Vec<u32> = (0..2 * 300 + 1).map(|_| rng.below(256) as u32).collect();
        let (inputs, targets) = (ids[..600].to_vec(), ids[1..].to_vec());
        let (loss, grads) = gpu_trainer
            .gradients(inputs.clone(), targets.clone(), Backward::Explicit)
            .unwrap();
        let (loss_auto, grads_auto) = gpu_trainer
            .gradients(inputs.clone(), targets.clone(), Backward::Autograd)
            .unwrap();
        let (loss_f32, grads_f32) = cpu_trainer.gradients(inputs, targets, Backward::Autograd).unwrap();
        for (what, l) in [("explicit", loss), ("autograd", loss_auto)] {
            assert!(
                (l - loss_f32).abs() <= 1e-2 * loss_f32,
                "window {window:?}: {what} bf16 loss {l}, f32 {loss_f32}"
            );
        }
        assert_eq!(grads.len(), cpu_trainer.parameters().count());
        for ((name, _), ((g, a), r)) in cpu_trainer
            .parameters()
            .zip(grads.iter().zip(&grads_auto).zip(&grads_f32))
        {
            let r = r.to_device(&gpu())?;
            // Relative to the largest entry (a zero gradient gives NaN, which fails).
            let rel = common::diff_over_max;
            let (e_explicit, e_autograd) = (rel(g, &r), rel(a, &r));
            // bf16 through two layers and back: a few roundings of the dtype; the explicit
            // backward must be as close to f32 as autograd's (NaN fails every comparison).
            assert!(
                e_explicit < 5e-2 && e_explicit <= 1.5 * e_autograd + 1e-2,
                "window {window:?}, {name}: explicit {e_explicit}, autograd {e_autograd} (relative to the f32 gradient)"
            );
            let e_between = rel(g, a);
            assert!(
                e_between < 5e-2,
                "window {window:?}, {name}: explicit vs autograd {e_between}"
            );
        }
    }
    Ok(())
}

/// The building blocks of the explicit backward (train_ops' graph-free and packed ops) on CUDA
/// against their CPU loops on the same values, bf16/f16/f32, with shapes that take the 16-byte
/// vector path of the SiLU × up kernels (columns a multiple of 8) and shapes that do not; the
/// in-place f32 weight-gradient GEMM against the CPU's f32 matmul of the same 16-bit values.
#[test]
fn explicit_ops_match_the_cpu_loops() -> Result<()> {
    let cpu = Device::Cpu;
    let both = |t: &Tensor| -> Result<(Tensor, Tensor)> { Ok((t.to_device(&gpu())?, t.clone())) };
    let check = |what: &str, got: &Tensor, want: &Tensor, tol: f32| {
        let e = rel_diff(&got.to_device(&Device::Cpu).unwrap(), want);
        eprintln!("{what}: CUDA vs CPU {e:.2e}");
        assert!(e <= tol, "{what}: CUDA and CPU differ by {e}");
    };
    for (dtype, tol) in CASES {
        // add + RMSNorm, and the backward with a residual gradient: rows the fused backward
        // takes (768) and wider ones it leaves to the two-kernel path (2050, no 16-byte vectors).
        for (rows, dim) in [(1031, 768), (131, 2050)] {
            let (x, h, w, dy, dres) = (
                randn(&[rows, dim], dtype, &cpu),
                randn(&[rows, dim], dtype, &cpu),
                randn(&[dim], dtype, &cpu),
                randn(&[rows, dim], dtype, &cpu),
                randn(&[rows, dim], dtype, &cpu),
            );
            let [(xg, x), (hg, h), (wg, w), (dyg, dy), (dresg, dres)] =
                [&x, &h, &w, &dy, &dres].map(|t| both(t).unwrap());
            let (sum_g, y_g) = train_ops::rms_norm_add(&xg, &hg, &wg, 1e-5)?;
            let (sum_c, y_c) = train_ops::rms_norm_add(&x, &h, &w, 1e-5)?;
            check(&format!("add + RMSNorm sum {dim} {dtype:?}"), &sum_g, &sum_c, 0.0);
            check(&format!("add + RMSNorm {dim} {dtype:?}"), &y_g, &y_c, tol);
            for residual in [true, false] {
                let (dx_g, dw_g) = train_ops::rms_norm_backward(&xg, &wg, &dyg, 1e-5, residual.then_some(&dresg))?;
                let (dx_c, dw_c) = train_ops::rms_norm_backward(&x, &w, &dy, 1e-5, residual.then_some(&dres))?;
                check(
                    &format!("RMSNorm backward dx {dim}, residual {residual} {dtype:?}"),
                    &dx_g,
                    &dx_c,
                    tol,
                );
                // dw sums a product per row: relative to its own size.
                let e = common::diff_over_max(&dw_g, &dw_c);
                eprintln!("RMSNorm backward dw {dim} {dtype:?}: {e:.2e}");
                assert!(
                    e <= tol,
                    "RMSNorm backward dw {dim} {dtype:?}: CUDA and CPU differ by {e}"
                );
            }
        }

        // RoPE of the q and k heads of a packed q/k/v row (4 q, 2 k, 2 v heads of 64), and the
        // packed backward.
        let (tokens, d) = (97, 64);
        let qkv = randn(&[tokens, 8 * d], dtype, &cpu);
        let angles = Tensor::rand(0f32, 6.3, (tokens, d / 2), &cpu)?;
        let (cos, sin) = (angles.cos()?.to_dtype(dtype)?, angles.sin()?.to_dtype(dtype)?);
        let [(qkvg, qkv), (cosg, cos), (sing, sin)] = [&qkv, &cos, &sin].map(|t| both(t).unwrap());
        for interleaved in [false, true] {
            let got = train_ops::rope_unpack(&qkvg, [4, 2, 2], d, &cosg, &sing, interleaved)?;
            let want = train_ops::rope_unpack(&qkv, [4, 2, 2], d, &cos, &sin, interleaved)?;
            for (name, g, w) in [("q", &got.0, &want.0), ("k", &got.1, &want.1)] {
                check(
                    &format!("RoPE unpack {name}, interleaved {interleaved} {dtype:?}"),
                    g,
                    w,
                    tol,
                );
            }
            // v is copied bit for bit.
            check(
                &format!("RoPE unpack v {dtype:?}"),
                &got.2,
                &qkv.narrow(1, 6 * d, 2 * d)?.contiguous()?.reshape((tokens, 2, d))?,
                0.0,
            );
            let (dq, dk, dv) = (
                randn(&[tokens, 4, d], dtype, &cpu),
                randn(&[tokens, 2, d], dtype, &cpu),
                randn(&[tokens, 2, d], dtype, &cpu),
            );
            let [(dqg, dq), (dkg, dk), (dvg, dv)] = [&dq, &dk, &dv].map(|t| both(t).unwrap());
            let got = train_ops::rope_pack_backward(&dqg, &dkg, &dvg, &cosg, &sing, interleaved)?;
            let want = train_ops::rope_pack_backward(&dq, &dk, &dv, &cos, &sin, interleaved)?;
            assert_eq!(got.dims(), [tokens, 8 * d]);
            check(
                &format!("RoPE packed backward interleaved {interleaved} {dtype:?}"),
                &got,
                &want,
                tol,
            );
            // dv is copied bit for bit.
            check(
                &format!("RoPE packed backward's dv {dtype:?}"),
                &got.narrow(1, 6 * d, 2 * d)?.contiguous()?,
                &dv.reshape((tokens, 2 * d))?,
                0.0,
            );
        }

        // SiLU × up of a packed gate/up tensor: 344 columns (vectors of 16 bytes) and 345 (none).
        for cols in [344, 345] {
            let (gu, dy) = (randn(&[67, 2 * cols], dtype, &cpu), randn(&[67, cols], dtype, &cpu));
            let [(gug, gu), (dyg, dy)] = [&gu, &dy].map(|t| both(t).unwrap());
            let what = format!("SiLU × up packed, {cols} columns {dtype:?}");
            check(
                &what,
                &train_ops::swiglu_packed(&gug)?,
                &train_ops::swiglu_packed(&gu)?,
                tol,
            );
            let got = train_ops::swiglu_packed_backward(&gug, &dyg)?;
            check(
                &format!("{what} backward"),
                &got,
                &train_ops::swiglu_packed_backward(&gu, &dy)?,
                tol,
            );
            // The unpacked backward (stacked [dgate; dup]) through the same kernel.
            let (g, u) = (
                gu.narrow(1, 0, cols)?.contiguous()?,
                gu.narrow(1, cols, cols)?.contiguous()?,
            );
            let (dg, du) = train_ops::swiglu_backward(&g.to_device(&gpu())?, &u.to_device(&gpu())?, &dyg)?;
            let got = got.to_device(&cpu)?;
            check(
                &format!("{what} backward, unpacked dgate"),
                &dg,
                &got.narrow(1, 0, cols)?,
                0.0,
            );
            check(
                &format!("{what} backward, unpacked dup"),
                &du,
                &got.narrow(1, cols, cols)?,
                0.0,
            );
        }

        // The weight gradient, accumulated twice into f32 (16-bit inputs only on the GPU path);
        // the second dy a column slice of a wider tensor (a row stride of its own).
        if dtype != DType::F32 {
            let (x, dy, wide) = (
                randn(&[300, 96], dtype, &cpu),
                randn(&[300, 40], dtype, &cpu),
                randn(&[300, 100], dtype, &cpu),
            );
            let slice = |t: &Tensor| t.narrow(1, 30, 40).unwrap();
            let [(xg, x), (dyg, dy), (wideg, wide)] = [&x, &dy, &wide].map(|t| both(t).unwrap());
            let acc = train_ops::accumulate_weight_grad(None, &dyg, &xg)?;
            let acc = train_ops::accumulate_weight_grad(Some(acc), &slice(&wideg), &xg)?;
            let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let want = (f32s(&dy).t()?.matmul(&f32s(&x))? + f32s(&slice(&wide)).t()?.matmul(&f32s(&x))?)?;
            assert_eq!(acc.dtype(), DType::F32);
            // Sums of 600 exact products in f32, in another order than the CPU's.
            check(&format!("weight gradient {dtype:?}"), &acc, &want, 1e-4);
        }
    }
    Ok(())
}

/// f64 autograd of `f` at `inputs` (cast to f64, on the CPU) with the output gradient `dy`:
/// the output and each input's gradient.
fn f64_grads(
    inputs: &[&Tensor],
    dy: &Tensor,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<(Tensor, Vec<Tensor>)> {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(&t.to_device(&Device::Cpu)?.to_dtype(DType::F64)?))
        .collect::<Result<_>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts)?;
    let dy = dy.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let grads = (&y * &dy)?.sum_all()?.backward()?;
    let g = vars.iter().map(|v| grads.get(v).unwrap().clone()).collect();
    Ok((y, g))
}

/// The explicit backward's graph-free and packed ops on CUDA against f64 references of the same
/// input values (the composed forms, differentiated in f64 by candle's autograd): add + RMSNorm
/// and its backward with and without the residual stream's gradient (rows the fused backward
/// takes and wider ones), RoPE of the q and k heads of packed q/k/v rows and the packed
/// backward (the rotation by the opposite angles), packed SiLU × up and its backward, and the
/// in-place f32 weight-gradient GEMM; bf16/f16/f32 within the tolerances of the other op tests.
#[test]
fn explicit_ops_match_an_f64_reference_on_the_gpu() -> Result<()> {
    use candle_core::Module;
    use flash_llama::nn::{apply_rope, RmsNorm};
    use flash_llama::Kernels;
    let dev = gpu();
    let f64s = |t: &Tensor| t.to_device(&Device::Cpu).unwrap().to_dtype(DType::F64).unwrap();
    let check = |what: &str, got: &Tensor, want: &Tensor, tol: f32| {
        let e = rel_diff(&got.to_device(&Device::Cpu).unwrap(), want);
        eprintln!("{what}: against f64 {e:.2e}");
        assert!(e <= tol, "{what}: differs from the f64 reference by {e} (tol {tol})");
    };
    for (dtype, tol) in CASES {
        for (rows, dim) in [(1031, 768), (131, 2050)] {
            let [x, h, dy, dres] = [0; 4].map(|_| randn(&[rows, dim], dtype, &dev));
            let w = randn(&[dim], dtype, &dev);
            let (sum, y) = train_ops::rms_norm_add(&x, &h, &w, 1e-5)?;
            // The sum is the dtype's rounding of x + h, which the norm then reads.
            check(
                &format!("add + RMSNorm sum {dim} {dtype:?}"),
                &sum,
                &(&x + &h)?.to_device(&Device::Cpu)?,
                0.0,
            );
            let norm = |t: &[Tensor]| RmsNorm::new(t[1].clone(), 1e-5, Kernels::Composed).forward(&t[0]);
            let (y_ref, _) = f64_grads(&[&sum, &w], &dy, norm)?;
            check(&format!("add + RMSNorm {dim} {dtype:?}"), &y, &y_ref, tol);
            let (_, g) = f64_grads(&[&x, &w], &dy, norm)?;
            for residual in [true, false] {
                let (dx, dw) = train_ops::rms_norm_backward(&x, &w, &dy, 1e-5, residual.then_some(&dres))?;
                let dx_ref = if residual { (&g[0] + f64s(&dres))? } else { g[0].clone() };
                check(
                    &format!("RMSNorm backward dx {dim}, residual {residual} {dtype:?}"),
                    &dx,
                    &dx_ref,
                    tol,
                );
                let e = common::diff_over_max(&dw.to_device(&Device::Cpu)?, &g[1]);
                eprintln!("RMSNorm backward dw {dim} {dtype:?}: against f64 {e:.2e}");
                assert!(e <= tol, "RMSNorm backward dw {dim} {dtype:?}: differs from f64 by {e}");
            }
        }

        // RoPE of the q and k heads of packed q/k/v rows (4 q, 2 k, 2 v heads of 64).
        let (tokens, d) = (97, 64);
        let qkv = randn(&[tokens, 8 * d], dtype, &dev);
        let angles = Tensor::rand(0f32, 6.3, (tokens, d / 2), &dev)?;
        let (cos, sin) = (angles.cos()?.to_dtype(dtype)?, angles.sin()?.to_dtype(dtype)?);
        let (cos64, sin64) = (f64s(&cos), f64s(&sin));
        let qkv64 = f64s(&qkv);
        let heads = |t: &Tensor, first: usize, n: usize| t.narrow(1, first * d, n * d)?.reshape((tokens, n, d));
        for interleaved in [false, true] {
            let (q, k, v) = train_ops::rope_unpack(&qkv, [4, 2, 2], d, &cos, &sin, interleaved)?;
            for (name, got, first, n) in [("q", &q, 0, 4), ("k", &k, 4, 2)] {
                let want = apply_rope(
                    &heads(&qkv64, first, n)?,
                    &cos64,
                    &sin64,
                    interleaved,
                    Kernels::Composed,
                )?;
                check(
                    &format!("RoPE unpack {name}, interleaved {interleaved} {dtype:?}"),
                    got,
                    &want,
                    tol,
                );
            }
            check(&format!("RoPE unpack v {dtype:?}"), &v, &heads(&qkv64, 6, 2)?, 0.0);
            let [dq, dk, dv] = [4, 2, 2].map(|n| randn(&[tokens, n, d], dtype, &dev));
            let got = train_ops::rope_pack_backward(&dq, &dk, &dv, &cos, &sin, interleaved)?;
            // The rotation's transpose: the rotation by the opposite angles.
            let back = |t: &Tensor| apply_rope(&f64s(t), &cos64, &sin64.neg()?, interleaved, Kernels::Composed);
            let want = Tensor::cat(
                &[
                    back(&dq)?.reshape((tokens, 4 * d))?,
                    back(&dk)?.reshape((tokens, 2 * d))?,
                    f64s(&dv).reshape((tokens, 2 * d))?,
                ],
                1,
            )?;
            check(
                &format!("RoPE packed backward interleaved {interleaved} {dtype:?}"),
                &got,
                &want,
                tol,
            );
        }

        // SiLU × up of a packed gate/up tensor: 344 columns (16-byte vectors) and 345 (none).
        for cols in [344, 345] {
            let (gu, dy) = (randn(&[67, 2 * cols], dtype, &dev), randn(&[67, cols], dtype, &dev));
            let swiglu = |t: &[Tensor]| t[0].narrow(1, 0, cols)?.silu()? * t[0].narrow(1, cols, cols)?;
            let (y_ref, g) = f64_grads(&[&gu], &dy, swiglu)?;
            let what = format!("SiLU × up packed, {cols} columns {dtype:?}");
            check(&what, &train_ops::swiglu_packed(&gu)?, &y_ref, tol);
            check(
                &format!("{what} backward"),
                &train_ops::swiglu_packed_backward(&gu, &dy)?,
                &g[0],
                tol,
            );
        }

        // The weight gradient accumulated twice into f32 (16-bit inputs only), the second dy a
        // column slice of a wider tensor: sums of 600 products of 16-bit values, exact in f64.
        if dtype != DType::F32 {
            let [x, dy, wide] = [96, 40, 100].map(|c| randn(&[300, c], dtype, &dev));
            let slice = wide.narrow(1, 30, 40)?;
            let acc = train_ops::accumulate_weight_grad(None, &dy, &x)?;
            let acc = train_ops::accumulate_weight_grad(Some(acc), &slice, &x)?;
            let want = (f64s(&dy).t()?.matmul(&f64s(&x))? + f64s(&slice).t()?.matmul(&f64s(&x))?)?;
            check(&format!("weight gradient {dtype:?}"), &acc, &want, 1e-5);
        }
    }
    Ok(())
}

/// On the GPU the optimizer step writes the explicit backward's 16-bit weights (stacked q/k/v
/// and gate/up, norms, embedding, head) with the masters, and the next step uses them without
/// casting. Steps made that way must be the steps of a trainer that casts the masters afresh
/// each step, bit for bit (losses and master weights), with a tied and an untied head, bf16 and
/// f16.
#[test]
fn kept_weights_take_the_steps_of_fresh_casts() -> Result<()> {
    use flash_llama::train::{self, data, Backward, Corpus, Tokenization, TrainConfig, Trainer};
    let mut rng = data::Rng(11);
    let docs: Vec<Vec<u32>> = (0..24)
        .map(|_| (0..900).map(|_| rng.below(200) as u32 + 32).collect())
        .collect();
    let corpus = Corpus::from_documents(docs, Tokenization::Bytes.end_of_text());
    let (_, base) = train::preset("tiny", data::BYTE_VOCAB_SIZE).unwrap();
    let cfg = TrainConfig {
        batch_size: 2,
        seq_len: 136,
        grad_accum: 2,
        steps: 4,
        warmup_steps: 1,
        ..base
    };
    for (tied, dtype) in [(false, DType::BF16), (true, DType::F16)] {
        let mut model_cfg = train::llama_config(data::BYTE_VOCAB_SIZE, 256, 384, 2, 4, 2, 256);
        model_cfg.tie_word_embeddings = tied;
        let mut kept = Trainer::new(model_cfg.clone(), cfg.clone(), dtype, &gpu()).unwrap();
        let mut fresh = Trainer::new(model_cfg.clone(), cfg.clone(), dtype, &gpu()).unwrap();
        for step in 0..cfg.steps {
            // Choosing the backward drops the kept model: the step casts the masters again.
            fresh.set_backward(Backward::Explicit);
            let (a, b) = (kept.train_step(&corpus).unwrap(), fresh.train_step(&corpus).unwrap());
            assert_eq!(
                a.loss.to_bits(),
                b.loss.to_bits(),
                "tied {tied}, {dtype:?}, step {step}: loss {} with kept weights, {} with fresh casts",
                a.loss,
                b.loss
            );
        }
        for ((name, a), (_, b)) in kept.parameters().zip(fresh.parameters()) {
            let (a, b) = (a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?);
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "tied {tied}, {dtype:?}: {name} differs after {} steps",
                cfg.steps
            );
        }
    }
    Ok(())
}
