//! Tensor-parallel inference on the CPU, ranks as threads meeting through `LocalGroup` (the
//! stand-in for NCCL): every family's shards give the full model's logits, through the full
//! forward and through the KV cache, and generate its tokens.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device, IndexOp, Tensor};
use common::{hf_model, max_abs, max_diff, tokens, Family};
use flash_llama::loader::{load_hf_dir, load_model_tensor_parallel};
use flash_llama::parallel::LocalGroup;
use flash_llama::{generate, Flow, GenerateOptions, Kernels, Llama, SamplingParams};

/// What one model (whole or shard) computes: the full forward's logits of a sequence, the cached
/// prefill + decode logits, and 12 sampled tokens.
fn run(model: &Llama, seq: &[u32]) -> (Tensor, Vec<Tensor>, Vec<u32>) {
    let ids = Tensor::new(seq, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let full = model.forward(&ids).unwrap().squeeze(0).unwrap();
    let mut cache = model.new_cache(1, 32).unwrap();
    let mut steps = vec![model.step(&[seq[..5].to_vec()], &mut cache).unwrap()];
    for &t in &seq[5..] {
        steps.push(model.step(&[vec![t]], &mut cache).unwrap());
    }
    let opts = GenerateOptions {
        max_tokens: 12,
        sampling: SamplingParams {
            temperature: 0.8,
            seed: 3,
            ..SamplingParams::default()
        },
        stop_tokens: vec![],
        kv_cache_dtype: None,
        cuda_graphs: false,
    };
    let out = generate(model, &[seq[..4].to_vec()], &opts, |_, _| Ok(Flow::Continue)).unwrap();
    (full, steps, out.tokens[0].clone())
}

#[test]
fn tensor_parallel_shards_give_the_full_models_logits() {
    let seq = tokens(9, 5);
    for family in Family::ALL {
        for kernels in [Kernels::Composed, Kernels::Fused] {
            let dir = hf_model(family);
            let whole = load_hf_dir(&dir, DType::F32, &Device::Cpu, kernels).unwrap();
            let (full, steps, sampled) = run(&whole, &seq);
            let scale = max_abs(&full);
            let (heads, width) = (whole.config().num_attention_heads, whole.config().intermediate_size);
            let groups = LocalGroup::new(2).unwrap();
            let ranks: Vec<_> = std::thread::scope(|s| {
                let handles: Vec<_> = groups
                    .into_iter()
                    .map(|g| {
                        let (dir, seq) = (&dir, &seq);
                        s.spawn(move || {
                            let shard = load_model_tensor_parallel(dir, DType::F32, &Device::Cpu, kernels, Arc::new(g))
                                .unwrap();
                            // The shard's config: half the heads and MLP width.
                            assert_eq!(shard.config().num_attention_heads * 2, heads);
                            assert_eq!(shard.config().intermediate_size * 2, width);
                            run(&shard, seq)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (rank, (r_full, r_steps, r_sampled)) in ranks.iter().enumerate() {
                let what = format!("{family:?} {kernels:?} rank {rank}");
                let d = max_diff(r_full, &full);
                assert!(
                    d <= 1e-5 * scale,
                    "{what}: full forward differs by {d} (logits up to {scale})"
                );
                for (i, (a, b)) in r_steps.iter().zip(&steps).enumerate() {
                    let d = max_diff(a, b);
                    assert!(d <= 1e-5 * scale, "{what}: cached step {i} differs by {d}");
                }
                // The last cached step is the forward's last position.
                let d = max_diff(&r_steps.last().unwrap().i(0).unwrap(), &full.i(seq.len() - 1).unwrap());
                assert!(d <= 1e-4 * scale, "{what}: cache vs forward {d}");
                assert_eq!(r_sampled, &sampled, "{what}: sampled tokens");
            }
        }
    }
}

#[test]
fn tensor_parallel_needs_divisible_heads() {
    // The tiny models have 4 heads, 2 kv heads, MLP width 48: 4 ranks leave a kv head half.
    let dir = hf_model(Family::Llama);
    let groups = LocalGroup::new(4).unwrap();
    let errors: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                let dir = &dir;
                s.spawn(move || {
                    load_model_tensor_parallel(dir, DType::F32, &Device::Cpu, Kernels::Fused, Arc::new(g))
                        .err()
                        .map(|e| format!("{e:#}"))
                        .unwrap_or_default()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in errors {
        assert!(e.contains("multiple of 4 key/value heads"), "{e}");
    }
}

/// Ring attention over 2 and 3 ranks (odd chunk lengths, GQA, causal and not) gives each rank
/// the rows of the single-device call over the whole sequence: output, log-sum-exp and the
/// gradients of its q, k and v chunks.
#[test]
fn ring_attention_equals_attention_over_the_whole_sequence() {
    use flash_llama::parallel::context::RingAttention;
    use flash_llama::parallel::Communicator;
    let dev = Device::Cpu;
    for (world, chunk, causal) in [(2, 7, true), (3, 5, true), (3, 6, false), (2, 9, false)] {
        let (b, h, hk, d) = (2, 4, 2, 16);
        let s = world * chunk;
        let q = Tensor::randn(0f32, 1.0, (b, s, h, d), &dev).unwrap();
        let k = Tensor::randn(0f32, 1.0, (b, s, hk, d), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (b, s, hk, d), &dev).unwrap();
        let dout = Tensor::randn(0f32, 1.0, (b, s, h, d), &dev).unwrap();
        let scale = 1.0 / (d as f32).sqrt();
        let attn = flash_attn3::FlashAttn::new(scale).causal(causal);
        let (out, lse) = attn.forward_with_lse(&q, &k, &v).unwrap();
        let (dq, dk, dv) = attn.backward(&q, &k, &v, &out, &lse, &dout).unwrap();
        let rows = |t: &Tensor, r: usize| t.narrow(1, r * chunk, chunk).unwrap().contiguous().unwrap();
        let lse_rows = |t: &Tensor, r: usize| t.narrow(2, r * chunk, chunk).unwrap().contiguous().unwrap();

        let groups = LocalGroup::new(world).unwrap();
        let ranks: Vec<_> = std::thread::scope(|sc| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|g| {
                    let (q, k, v, dout) = (&q, &k, &v, &dout);
                    sc.spawn(move || {
                        let r = g.rank();
                        let ring = RingAttention::new(scale).causal(causal);
                        let (qr, kr, vr) = (rows(q, r), rows(k, r), rows(v, r));
                        let (o, l) = ring.forward_with_lse(&g, &qr, &kr, &vr).unwrap();
                        let grads = ring.backward(&g, &qr, &kr, &vr, &o, &l, &rows(dout, r)).unwrap();
                        (o, l, grads)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, (o, l, (gq, gk, gv))) in ranks.iter().enumerate() {
            let what = format!("{world} ranks, chunk {chunk}, causal {causal}, rank {r}");
            for (name, got, want) in [
                ("out", o, rows(&out, r)),
                ("lse", l, lse_rows(&lse, r)),
                ("dq", gq, rows(&dq, r)),
                ("dk", gk, rows(&dk, r)),
                ("dv", gv, rows(&dv, r)),
            ] {
                let scale = max_abs(&want).max(1e-3);
                let diff = max_diff(got, &want);
                assert!(diff <= 2e-5 * scale, "{what}: {name} differs by {diff} (max {scale})");
            }
        }
    }
}
