//! The decoder on tiny random-weight models: loading (HF directory and GGUF), shapes, the KV
//! cache against full recomputation, batched against single-prompt generation, dtypes.

mod common;

use candle_core::{DType, Device, IndexOp, Tensor};
use common::{abs_sum, hf_model, max_diff, mixed_steps, rel_diff, tokens, Family, VOCAB};
use flash_llama::loader::{load_gguf, load_hf_dir};
use flash_llama::{generate, Flow, GenerateOptions, Kernels, Llama, SamplingParams};

fn load(family: Family, dtype: DType) -> Llama {
    load_with(family, dtype, Kernels::Composed)
}

/// `Kernels::Fused` is the inference path: fused q/k/v and gate/up weights, one RoPE launch
/// over q, k and v (per-head angles), strided cache writes; `Composed` the trainable one.
fn load_with(family: Family, dtype: DType, kernels: Kernels) -> Llama {
    load_hf_dir(&hf_model(family), dtype, &Device::Cpu, kernels).unwrap()
}

/// The tokens `generate` gives request `r` alone (its sampling, max_tokens and stop tokens), with
/// a cache of `kv_cache_dtype`: what a batched run must give it too.
fn generated_alone(model: &Llama, r: &flash_llama::Request, kv_cache_dtype: Option<DType>) -> Vec<u32> {
    let opts = GenerateOptions {
        max_tokens: r.max_tokens,
        sampling: r.sampling.clone(),
        stop_tokens: r.stop_tokens.clone(),
        kv_cache_dtype,
        cuda_graphs: true,
    };
    generate(model, std::slice::from_ref(&r.prompt), &opts, |_, _| Ok(Flow::Continue))
        .unwrap()
        .tokens
        .remove(0)
}

#[test]
fn hf_directory_loads_and_gives_logit_shapes() {
    for family in Family::ALL {
        let model = load(family, DType::F32);
        let ids = Tensor::new(vec![tokens(5, 0), tokens(5, 1)], &Device::Cpu).unwrap();
        assert_eq!(model.forward(&ids).unwrap().dims(), &[2, 5, VOCAB], "{family:?}");
        let mut cache = model.new_cache(3, 16).unwrap();
        let logits = model
            .step(&[tokens(4, 0), tokens(2, 1), tokens(6, 2)], &mut cache)
            .unwrap();
        assert_eq!(logits.dims(), &[3, VOCAB]);
        assert_eq!(cache.lens(), &[4, 2, 6]);
    }
}

/// Prefill part of the sequence, then decode token by token: every step's logits must equal
/// the full forward's logits at that position.
#[test]
fn cached_decoding_equals_full_recomputation() {
    for (family, kernels) in Family::ALL
        .into_iter()
        .flat_map(|f| [(f, Kernels::Composed), (f, Kernels::Fused)])
    {
        let model = load_with(family, DType::F32, kernels);
        let seq = tokens(11, 4);
        let full = model
            .forward(&Tensor::new(seq.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap())
            .unwrap()
            .squeeze(0)
            .unwrap();
        let prefill = 4;
        let mut cache = model.new_cache(1, 16).unwrap();
        let logits = model.step(&[seq[..prefill].to_vec()], &mut cache).unwrap();
        let diff = max_diff(&logits.i(0).unwrap(), &full.i(prefill - 1).unwrap());
        assert!(diff < 1e-4, "{family:?} {kernels:?} prefill: {diff}");
        for (pos, &token) in seq.iter().enumerate().skip(prefill) {
            let logits = model.step(&[vec![token]], &mut cache).unwrap();
            let diff = max_diff(&logits.i(0).unwrap(), &full.i(pos).unwrap());
            assert!(diff < 1e-4, "{family:?} {kernels:?} position {pos}: {diff}");
        }
    }
}

/// A callback that returns `Flow::Stop` ends that sequence at that token; the others of the
/// batch go on and produce the tokens they produce alone.
#[test]
fn flow_stop_ends_one_sequence() {
    let model = load_with(Family::Llama, DType::F32, Kernels::Fused);
    let prompts = vec![tokens(4, 1), tokens(5, 2)];
    let opts = GenerateOptions {
        max_tokens: 8,
        sampling: SamplingParams::default(),
        stop_tokens: vec![],
        kv_cache_dtype: None,
        cuda_graphs: true,
    };
    let full = generate(&model, &prompts, &opts, |_, _| Ok(Flow::Continue)).unwrap();
    let mut seen = 0;
    let cut = generate(&model, &prompts, &opts, |i, _| {
        seen += (i == 0) as usize;
        Ok(if i == 0 && seen == 3 {
            Flow::Stop
        } else {
            Flow::Continue
        })
    })
    .unwrap();
    assert_eq!(cut.tokens[0], full.tokens[0][..3]);
    assert_eq!(cut.tokens[1], full.tokens[1]);
    assert_eq!(full.tokens[1].len(), 8);
    // One step end per step (the prefill's first), in order; the latencies are their gaps.
    assert_eq!(full.step_ends_secs.len(), 8);
    assert_eq!(full.step_ends_secs[0], full.prefill_secs);
    assert!(full.step_ends_secs.windows(2).all(|w| w[0] <= w[1]));
    let gaps: Vec<f64> = full.step_ends_secs.windows(2).map(|w| w[1] - w[0]).collect();
    let (p50, p99) = (
        full.inter_token_latency(0.5).unwrap(),
        full.inter_token_latency(0.99).unwrap(),
    );
    assert!(gaps.contains(&p50) && gaps.contains(&p99) && p50 <= p99);
    assert_eq!(p99, gaps.iter().copied().fold(0.0, f64::max));
    let one_token = GenerateOptions { max_tokens: 1, ..opts };
    let g = generate(&model, &prompts, &one_token, |_, _| Ok(Flow::Continue)).unwrap();
    assert_eq!(g.inter_token_latency(0.5), None);
}

/// Prompts of different lengths in one batch (varlen prefill, then decode over the gapped cache)
/// give the logits and greedy tokens of each prompt alone.
#[test]
fn batched_generation_equals_single_prompt_generation() {
    for (family, kernels) in [Family::Llama, Family::Mistral, Family::Qwen2, Family::Qwen3]
        .into_iter()
        .flat_map(|f| [(f, Kernels::Composed), (f, Kernels::Fused)])
    {
        let model = load_with(family, DType::F32, kernels);
        let prompts = vec![tokens(3, 1), tokens(9, 2), tokens(6, 3)];
        let opts = GenerateOptions {
            max_tokens: 7,
            sampling: SamplingParams::default(),
            stop_tokens: vec![],
            kv_cache_dtype: None,
            cuda_graphs: true,
        };
        let batched = generate(&model, &prompts, &opts, |_, _| Ok(Flow::Continue)).unwrap();
        for (i, prompt) in prompts.iter().enumerate() {
            let single = generate(&model, std::slice::from_ref(prompt), &opts, |_, _| Ok(Flow::Continue)).unwrap();
            assert_eq!(batched.tokens[i], single.tokens[0], "{family:?} {kernels:?} prompt {i}");
        }

        // The logits themselves, step by step, with a sequence sitting out one step.
        let mut batch_cache = model.new_cache(3, 24).unwrap();
        let first = model.step(&prompts, &mut batch_cache).unwrap();
        let second = model.step(&[vec![5], vec![], vec![9]], &mut batch_cache).unwrap();
        assert_eq!(batch_cache.lens(), &[4, 9, 7]);
        assert_eq!(abs_sum(&second.i(1).unwrap()), 0.0);
        for (i, next) in [(0usize, Some(5u32)), (1, None), (2, Some(9))] {
            let mut cache = model.new_cache(1, 24).unwrap();
            let alone = model.step(&[prompts[i].clone()], &mut cache).unwrap();
            assert!(max_diff(&alone.i(0).unwrap(), &first.i(i).unwrap()) < 1e-4);
            if let Some(t) = next {
                let alone = model.step(&[vec![t]], &mut cache).unwrap();
                let diff = max_diff(&alone.i(0).unwrap(), &second.i(i).unwrap());
                assert!(diff < 1e-4, "{family:?} {kernels:?} sequence {i}: {diff}");
            }
        }
    }
}

/// The GGUF file stores the same weights with llama.cpp's names and permuted q/k rows; with
/// the interleaved RoPE that layout implies, it must compute exactly what the HF model does.
#[test]
fn gguf_matches_hf_directory() {
    let dir = common::temp_dir("gguf");
    let path = dir.join("tiny.gguf");
    common::write_gguf(&path);
    let gguf = load_gguf(&path, DType::F32, &Device::Cpu, Kernels::Composed).unwrap();
    assert!(gguf.config().rope_interleaved);
    let hf = load(Family::Llama, DType::F32);
    let ids = Tensor::new(vec![tokens(9, 5)], &Device::Cpu).unwrap();
    let diff = max_diff(&gguf.forward(&ids).unwrap(), &hf.forward(&ids).unwrap());
    assert!(diff < 1e-4, "{diff}");
}

#[test]
fn bf16_and_fused_kernels_follow_f32() {
    let reference = load(Family::Qwen3, DType::F32);
    let ids = Tensor::new(vec![tokens(8, 6)], &Device::Cpu).unwrap();
    let expected = reference.forward(&ids).unwrap();

    let bf16 = load(Family::Qwen3, DType::BF16);
    let got = bf16.forward(&ids).unwrap();
    assert_eq!(got.dtype(), DType::F32);
    let scale = expected.abs().unwrap().max_keepdim(2).unwrap().max_keepdim(1).unwrap();
    let scale = scale.flatten_all().unwrap().to_vec1::<f32>().unwrap()[0];
    let diff = max_diff(&got, &expected);
    assert!(
        diff < 0.1 * scale.max(1.0),
        "bf16 differs by {diff} (logit scale {scale})"
    );
    let mut cache = bf16.new_cache(1, 12).unwrap();
    bf16.step(&[tokens(8, 6)], &mut cache).unwrap();
    bf16.step(&[vec![3]], &mut cache).unwrap();

    for family in Family::ALL {
        let composed = load(family, DType::F32);
        let fused = load_hf_dir(&hf_model(family), DType::F32, &Device::Cpu, Kernels::Fused).unwrap();
        let diff = max_diff(&fused.forward(&ids).unwrap(), &composed.forward(&ids).unwrap());
        assert!(diff < 1e-4, "{family:?} fused vs composed: {diff}");
    }
}

/// The composed RMSNorm and RoPE are differentiable: gradients reach every weight.
#[test]
fn forward_is_differentiable() {
    let dir = hf_model(Family::Qwen3);
    let json = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let cfg = flash_llama::Config::from_hf_json(&json).unwrap();
    let weights = common::weights(Family::Qwen3);
    let varmap = candle_nn::VarMap::new();
    {
        let mut data = varmap.data().lock().unwrap();
        for (name, t) in weights {
            data.insert(name, candle_core::Var::from_tensor(&t).unwrap());
        }
    }
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = Llama::load(vb, &cfg, Kernels::Composed).unwrap();
    let ids = Tensor::new(vec![tokens(6, 7)], &Device::Cpu).unwrap();
    let loss = model.forward(&ids).unwrap().sqr().unwrap().mean_all().unwrap();
    let grads = loss.backward().unwrap();
    for (name, var) in varmap.data().lock().unwrap().iter() {
        let g = grads
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        let norm = g.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(norm.is_finite() && norm > 0.0, "{name}: gradient norm {norm}");
    }
}

#[test]
fn cache_overflow_and_bad_tokens_are_errors() {
    let model = load(Family::Llama, DType::F32);
    let mut cache = model.new_cache(1, 4).unwrap();
    let err = model.step(&[tokens(5, 0)], &mut cache).unwrap_err().to_string();
    assert!(err.contains("max_seq"), "{err}");
    let err = model.step(&[vec![VOCAB as u32]], &mut cache).unwrap_err().to_string();
    assert!(err.contains("outside the vocabulary"), "{err}");
    let err = model.step(&[vec![1], vec![2]], &mut cache).unwrap_err().to_string();
    assert!(err.contains("batch"), "{err}");
}

/// A batch whose sequences hold the same lengths decodes with one strided cache write per
/// layer and tensor (equally spaced rows); different lengths take one write per sequence.
/// Both must give each sequence's own logits, with the fused kernels as with the composed ones.
#[test]
fn equal_and_unequal_batches_decode_like_single_sequences() {
    for kernels in [Kernels::Composed, Kernels::Fused] {
        let model = load_with(Family::Llama32, DType::F32, kernels);
        for prompts in [
            vec![tokens(5, 1), tokens(5, 2), tokens(5, 3), tokens(5, 4)],
            vec![tokens(5, 1), tokens(2, 2), tokens(7, 3), tokens(5, 4)],
        ] {
            let mut batch_cache = model.new_cache(prompts.len(), 16).unwrap();
            model.step(&prompts, &mut batch_cache).unwrap();
            let next: Vec<Vec<u32>> = (0..prompts.len()).map(|i| vec![10 + i as u32]).collect();
            let batched = model.step(&next, &mut batch_cache).unwrap();
            let again = model.step(&next, &mut batch_cache).unwrap();
            for (i, prompt) in prompts.iter().enumerate() {
                let mut cache = model.new_cache(1, 16).unwrap();
                model.step(std::slice::from_ref(prompt), &mut cache).unwrap();
                let alone = model.step(&[next[i].clone()], &mut cache).unwrap();
                let diff = max_diff(&alone.i(0).unwrap(), &batched.i(i).unwrap());
                assert!(diff < 1e-4, "{kernels:?} {prompts:?} sequence {i}: {diff}");
                let alone = model.step(&[next[i].clone()], &mut cache).unwrap();
                let diff = max_diff(&alone.i(0).unwrap(), &again.i(i).unwrap());
                assert!(diff < 1e-4, "{kernels:?} {prompts:?} sequence {i}, second step: {diff}");
            }
        }
    }
}

/// GGUF (llama.cpp's interleaved RoPE) through the fused path equals the composed path.
#[test]
fn gguf_fused_matches_composed() {
    let dir = common::temp_dir("gguf-fused");
    let path = dir.join("tiny.gguf");
    common::write_gguf(&path);
    let composed = load_gguf(&path, DType::F32, &Device::Cpu, Kernels::Composed).unwrap();
    let fused = load_gguf(&path, DType::F32, &Device::Cpu, Kernels::Fused).unwrap();
    let ids = Tensor::new(vec![tokens(9, 5)], &Device::Cpu).unwrap();
    let diff = max_diff(&fused.forward(&ids).unwrap(), &composed.forward(&ids).unwrap());
    assert!(diff < 1e-4, "{diff}");
    let mut a = composed.new_cache(1, 12).unwrap();
    let mut b = fused.new_cache(1, 12).unwrap();
    composed.step(&[tokens(6, 1)], &mut a).unwrap();
    fused.step(&[tokens(6, 1)], &mut b).unwrap();
    let diff = max_diff(
        &composed.step(&[vec![4]], &mut a).unwrap(),
        &fused.step(&[vec![4]], &mut b).unwrap(),
    );
    assert!(diff < 1e-4, "decode: {diff}");
}

/// Above 64 tokens a call takes the MLP's prefill form (two matmuls over the halves of the
/// fused gate/up weight): still the composed logits, and the cache it fills decodes the same.
#[test]
fn long_prefill_fused_matches_composed() {
    let composed = load(Family::Llama32, DType::F32);
    let fused = load_with(Family::Llama32, DType::F32, Kernels::Fused);
    let ids = Tensor::new(vec![tokens(70, 8), tokens(70, 9)], &Device::Cpu).unwrap();
    let diff = max_diff(&fused.forward(&ids).unwrap(), &composed.forward(&ids).unwrap());
    assert!(diff < 1e-4, "{diff}");
    let (mut a, mut b) = (composed.new_cache(1, 80).unwrap(), fused.new_cache(1, 80).unwrap());
    let pa = composed.step(&[tokens(70, 8)], &mut a).unwrap();
    let pb = fused.step(&[tokens(70, 8)], &mut b).unwrap();
    assert!(max_diff(&pa, &pb) < 1e-4);
    let diff = max_diff(
        &composed.step(&[vec![2]], &mut a).unwrap(),
        &fused.step(&[vec![2]], &mut b).unwrap(),
    );
    assert!(diff < 1e-4, "decode after a long prefill: {diff}");
}

/// An fp8 (e4m3) KV cache on the CPU: the prefill gives the model-dtype cache's logits exactly
/// (it attends to the fresh keys), and every later step reads the e4m3 cache and follows the
/// f32 cache within e4m3's rounding, yet not exactly (the fp8 path ran). Steps whose sequences
/// take different numbers of tokens, or none, make several kvcache calls per layer whose
/// outputs go back in packed order.
#[test]
fn fp8_cache_follows_the_model_dtype_cache() {
    // e4m3 keeps 4 significant bits: q and k each off by up to 1/16 of a value, through two
    // layers of a tiny model with large attention logits (measured: 2-6e-2).
    const FP8_TOL: f32 = 0.1;
    for kernels in [Kernels::Composed, Kernels::Fused] {
        let model = load_with(Family::WideHeads, DType::F32, kernels);
        let mut exact = model.new_cache(4, 32).unwrap();
        let mut fp8 = model.new_cache_of(4, 32, DType::F8E4M3).unwrap();
        assert_eq!(fp8.dtype(), DType::F8E4M3);
        let steps = mixed_steps(7);
        for (n, step) in steps.iter().enumerate() {
            let want = model.step(step, &mut exact).unwrap();
            let got = model.step(step, &mut fp8).unwrap();
            let d = rel_diff(&got, &want);
            println!("{kernels:?} step {n}: fp8 cache vs f32 cache {d:.2e}");
            if n == 0 {
                assert_eq!(d, 0.0, "{kernels:?}: the prefill does not read the cache");
            } else {
                assert!(d > 0.0 && d < FP8_TOL, "{kernels:?} step {n}: fp8 cache differs by {d}");
            }
            // The sequences' rows differ by far more than that: rows put back in the wrong order
            // would fail.
            let active: Vec<usize> = (0..step.len()).filter(|&i| !step[i].is_empty()).collect();
            for pair in active.windows(2) {
                let apart = rel_diff(&want.i(pair[0]).unwrap(), &want.i(pair[1]).unwrap());
                assert!(apart > 4.0 * FP8_TOL, "step {n}: rows {pair:?} only {apart} apart");
            }
            for (i, tokens) in step.iter().enumerate() {
                if tokens.is_empty() {
                    assert_eq!(abs_sum(&got.i(i).unwrap()), 0.0, "step {n}: sequence {i} sat out");
                }
            }
        }
        assert_eq!(fp8.lens(), exact.lens());
        // A reset forgets the scales: the next prefill sets them afresh and runs as the first.
        fp8.reset();
        exact.reset();
        let want = model.step(&steps[0], &mut exact).unwrap();
        assert_eq!(max_diff(&model.step(&steps[0], &mut fp8).unwrap(), &want), 0.0);
    }
}

/// The perplexity through the cache is the full forward's (f32 cache), and an fp8 cache moves
/// it by little; texts too short or too long and unsupported cache dtypes are errors.
#[test]
fn perplexity_through_the_cache() {
    let model = load_with(Family::WideHeads, DType::F32, Kernels::Fused);
    let text = tokens(40, 7);
    let logits = model
        .forward(
            &Tensor::new(text.as_slice(), &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap(),
        )
        .unwrap()
        .squeeze(0)
        .unwrap();
    let log_probs = candle_nn::ops::log_softmax(&logits, 1)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let want: f64 = -(0..text.len() - 1)
        .map(|i| log_probs[i][text[i + 1] as usize] as f64)
        .sum::<f64>()
        / (text.len() - 1) as f64;
    let got = flash_llama::perplexity(&model, &text, DType::F32).unwrap();
    assert_eq!(got.predicted, text.len() - 1);
    assert!((got.mean_nll - want).abs() < 1e-5, "{} vs {want}", got.mean_nll);
    let fp8 = flash_llama::perplexity(&model, &text, DType::F8E4M3).unwrap();
    println!("perplexity: f32 cache {:.5}, fp8 cache {:.5}", got.value(), fp8.value());
    assert!(fp8.mean_nll != got.mean_nll && (fp8.mean_nll - got.mean_nll).abs() < 0.02 * want);
    assert!(flash_llama::perplexity(&model, &text[..1], DType::F32).is_err());
    let too_long = tokens(200, 1);
    assert!(flash_llama::perplexity(&model, &too_long, DType::F32)
        .unwrap_err()
        .to_string()
        .contains("context"));
    assert!(model
        .new_cache_of(1, 8, DType::F16)
        .unwrap_err()
        .to_string()
        .contains("f8e4m3"));
    // The fp8 kernels tile head dims by 16: the 8-dim heads of the other test models are refused.
    let narrow = load(Family::Llama, DType::F32);
    let err = narrow.new_cache_of(1, 8, DType::F8E4M3).unwrap_err().to_string();
    assert!(err.contains("multiple of 16"), "{err}");
}

/// Continuous batching: more requests than slots, joining as slots free up (so prefills run in
/// the same steps as other sequences' decoding), whole or in chunks, greedy and sampled, with
/// stop tokens: each
/// request's tokens are the ones `generate` gives it alone (with the model-dtype cache; an fp8
/// cache's scales depend on its first write, so there only the bookkeeping is checked).
#[test]
fn continuous_batching_equals_generation_alone() {
    use flash_llama::{Batcher, Finish, Request};
    for (family, kv_dtype, chunk, paged) in [
        (Family::Llama, None, 0, false),
        (Family::Llama, None, 5, false),
        (Family::Mistral, None, 3, false),
        (Family::Llama, None, 0, true),
        (Family::WideHeads, Some(DType::F8E4M3), 4, false),
    ] {
        let model = load_with(family, DType::F32, Kernels::Fused);
        let kv_dtype = kv_dtype.unwrap_or(DType::F32);
        let requests: Vec<Request> = (0..5u32)
            .map(|i| Request {
                prompt: tokens(3 + 4 * i as usize, 20 + i),
                max_tokens: 4 + 3 * i as usize,
                sampling: SamplingParams {
                    temperature: if i % 2 == 0 { 0.0 } else { 0.8 },
                    top_k: 8,
                    seed: 99 + i as u64,
                    ..SamplingParams::default()
                },
                stop_tokens: if i == 3 { vec![tokens(1, 5)[0], 2] } else { vec![] },
            })
            .collect();
        let alone: Vec<Vec<u32>> = requests
            .iter()
            .map(|r| generated_alone(&model, r, Some(kv_dtype)))
            .collect();
        // Two slots for five requests: the rest wait and join between steps. Prompts of more
        // than 5 tokens come in chunks.
        let mut batcher = match paged {
            false => Batcher::new(&model, 2, 40, kv_dtype).unwrap(),
            // Pages of 16 for 3 slots: 4 pages hold two requests at most (each needs 2 or 3).
            true => Batcher::with_cache(&model, model.new_paged_cache(3, 4, 16, 48, kv_dtype).unwrap()).unwrap(),
        }
        .prefill_chunk(chunk);
        let mut waiting: std::collections::VecDeque<(u64, Request)> = requests
            .iter()
            .cloned()
            .enumerate()
            .map(|(i, r)| (i as u64, r))
            .collect();
        let mut got: Vec<Vec<u32>> = vec![Vec::new(); requests.len()];
        let mut finished = vec![None; requests.len()];
        let mut steps = 0;
        while finished.iter().any(Option::is_none) {
            while let Some((id, r)) = waiting.pop_front() {
                if !batcher.fits(r.prompt.len() + r.max_tokens) {
                    waiting.push_front((id, r));
                    break;
                }
                batcher.join(id, r).unwrap();
            }
            for e in batcher.step().unwrap() {
                got[e.id as usize].push(e.token);
                if e.finish.is_some() {
                    finished[e.id as usize] = e.finish;
                }
            }
            steps += 1;
            assert!(steps < 200, "the batch never drained");
        }
        if kv_dtype == DType::F8E4M3 {
            // An fp8 cache's scales come from its first write: here the first two prompts
            // together, alone each prompt's own. So the tokens may part; the lengths may not
            // exceed the requests' (and `finished`, below, must match each last token).
            for (g, r) in got.iter().zip(&requests) {
                assert!(!g.is_empty() && g.len() <= r.max_tokens);
            }
        } else {
            assert_eq!(got, alone, "{family:?} {kv_dtype:?} chunk {chunk} paged {paged}");
        }
        for (i, (f, r)) in finished.iter().zip(&requests).enumerate() {
            let last = *got[i].last().unwrap();
            let want = if r.stop_tokens.contains(&last) {
                Finish::Stop
            } else {
                Finish::Length
            };
            assert_eq!(*f, Some(want), "request {i}");
        }
        assert_eq!(batcher.running(), 0);
        // Errors: too long for a slot, an empty prompt, a full batch.
        let long = Request {
            prompt: tokens(46, 1),
            max_tokens: 3,
            sampling: SamplingParams::default(),
            stop_tokens: vec![],
        };
        assert!(batcher
            .join(9, long.clone())
            .unwrap_err()
            .to_string()
            .contains("exceed"));
        let empty = Request {
            prompt: vec![],
            ..long.clone()
        };
        assert!(batcher.join(9, empty).is_err());
        let short = Request {
            prompt: tokens(2, 1),
            ..long
        };
        batcher.join(1, short.clone()).unwrap();
        assert!(batcher
            .join(1, short.clone())
            .unwrap_err()
            .to_string()
            .contains("already"));
        let mut id = 2;
        while batcher.free_slots() > 0 {
            batcher.join(id, short.clone()).unwrap();
            id += 1;
        }
        assert!(!batcher.fits(5));
        assert!(batcher
            .join(id, short)
            .unwrap_err()
            .to_string()
            .contains("no free slot"));
        batcher.cancel(1);
        assert_eq!(batcher.free_slots(), 1);
        assert!(batcher.fits(5));
    }
}

/// A paged KV cache (pages of 16, handed out from the end of the pool, so no sequence's pages
/// are in order): every step follows the contiguous cache of the same dtype (attention through
/// `flash_attn_with_kvcache` with a page table instead of the varlen call, so to f32 rounding;
/// an fp8 pair the same quantization), with steps of mixed token counts; pages go back to the
/// pool when a sequence is cleared, and an exhausted pool is an error before anything is written.
#[test]
fn paged_cache_follows_the_contiguous_cache() {
    for (family, dtype, kernels) in [
        (Family::Llama, DType::F32, Kernels::Fused),
        (Family::Mistral, DType::F32, Kernels::Composed),
        (Family::Qwen2, DType::F32, Kernels::Fused),
        (Family::WideHeads, DType::F8E4M3, Kernels::Fused),
    ] {
        let model = load_with(family, DType::F32, kernels);
        let mut contiguous = model.new_cache_of(3, 64, dtype).unwrap();
        let mut paged = model.new_paged_cache(3, 9, 16, 64, dtype).unwrap();
        assert_eq!((paged.page_size(), paged.free_pages()), (Some(16), Some(9)));
        let steps: Vec<Vec<Vec<u32>>> = vec![
            vec![tokens(20, 1), tokens(3, 2), tokens(17, 3)],
            vec![tokens(1, 4), tokens(14, 5), vec![]],
            (0..3).map(|i| tokens(1, 10 + i)).collect(),
            vec![tokens(2, 20), tokens(1, 21), tokens(16, 22)],
        ];
        for (n, step) in steps.iter().enumerate() {
            let want = model.step(step, &mut contiguous).unwrap();
            let got = model.step(step, &mut paged).unwrap();
            let d = rel_diff(&got, &want);
            println!("{family:?} {dtype:?} {kernels:?} step {n}: paged vs contiguous {d:.2e}");
            assert!(d < 1e-4, "{family:?} {dtype:?} step {n}: paged differs by {d}");
        }
        // 24, 19 and 34 tokens: 2 + 2 + 3 pages of 16.
        assert_eq!(paged.lens(), &[24, 19, 34]);
        assert_eq!(paged.free_pages(), Some(2));
        // 40 more tokens for the first two: 2 + 2 pages more, 2 free.
        let grow = [tokens(40, 1), tokens(40, 2), vec![]];
        let err = model.step(&grow, &mut paged).unwrap_err().to_string();
        assert!(err.contains("exhausted"), "{err}");
        assert_eq!(paged.lens(), &[24, 19, 34], "nothing written");
        assert_eq!(paged.free_pages(), Some(2), "nothing taken");
        paged.clear_sequence(2).unwrap();
        assert_eq!(paged.free_pages(), Some(5));
        model.step(&grow, &mut paged).unwrap();
        assert_eq!(paged.free_pages(), Some(1));
    }
    let model = load(Family::Llama, DType::F32);
    assert!(model.new_paged_cache(2, 4, 24, 48, DType::F32).is_err(), "page size 24");
    assert!(
        model.new_paged_cache(2, 4, 16, 40, DType::F32).is_err(),
        "max_seq not whole pages"
    );
}

/// The model the paged-batch tests run with a KV cache of `cache_dtype`: e4m3 caches need the
/// family with 64-dim heads (the smallest head dim of the fp8 KV-cache kernels), f32 caches Llama.
fn paged_batch_model(cache_dtype: DType) -> Llama {
    let family = if cache_dtype == DType::F8E4M3 {
        Family::WideHeads
    } else {
        Family::Llama
    };
    load_with(family, DType::F32, Kernels::Fused)
}

/// Prefix sharing in a paged batch: a request whose prompt starts like a running sequence's
/// cached keys shares those whole pages instead of computing them again (fewer pages taken), and
/// still gets the tokens `generate` gives it alone; the shared pages stay valid after the first
/// sequence ends, and all go back to the pool at the end.
#[test]
fn paged_batch_shares_prompt_prefixes() {
    use flash_llama::{Batcher, Request};
    for dtype in [DType::F32, DType::F8E4M3] {
        let model = paged_batch_model(dtype);
        let system = tokens(37, 9); // 2 whole pages of 16 shared, 5 tokens fed again
        let request = |tail: u32, max_tokens: usize| Request {
            prompt: system.iter().copied().chain(tokens(4, tail)).collect(),
            max_tokens,
            sampling: SamplingParams::default(),
            stop_tokens: vec![],
        };
        let (first, second) = (request(1, 3), request(2, 6));
        let cache = model.new_paged_cache(2, 12, 16, 64, dtype).unwrap();
        let mut batcher = Batcher::with_cache(&model, cache).unwrap();
        batcher.join(0, first.clone()).unwrap();
        let mut got = vec![Vec::new(), Vec::new()];
        for e in batcher.step().unwrap() {
            got[e.id as usize].push(e.token);
        }
        // 41 + 3 tokens: 3 pages; the second (41 + 6) needs 3 pages, 2 of them shared.
        let free = batcher.free_pages().unwrap();
        batcher.join(1, second.clone()).unwrap();
        assert_eq!(
            batcher.free_pages().unwrap(),
            free - 1,
            "{dtype:?}: 2 of its 3 pages shared"
        );
        while batcher.running() > 0 {
            for e in batcher.step().unwrap() {
                got[e.id as usize].push(e.token);
            }
        }
        assert_eq!(batcher.free_pages(), Some(12), "every page back in the pool");
        // share_prefix's rules: paged caches only, whole pages, held by the source, an empty
        // destination.
        let mut paged = model.new_paged_cache(2, 8, 16, 64, dtype).unwrap();
        model.step(&[tokens(40, 3), vec![]], &mut paged).unwrap();
        assert!(paged.share_prefix(0, 1, 20).is_err(), "not whole pages");
        assert!(paged.share_prefix(0, 1, 48).is_err(), "more than it holds");
        paged.share_prefix(0, 1, 32).unwrap();
        assert_eq!(paged.lens(), &[40, 32]);
        assert!(paged.share_prefix(0, 1, 16).is_err(), "not empty");
        let mut contiguous = model.new_cache_of(2, 64, dtype).unwrap();
        model.step(&[tokens(40, 3), vec![]], &mut contiguous).unwrap();
        assert!(contiguous.share_prefix(0, 1, 32).is_err(), "not paged");
        if dtype == DType::F32 {
            for (r, g) in [first, second].iter().zip(&got) {
                assert_eq!(g, &generated_alone(&model, r, None));
            }
        } else {
            assert_eq!((got[0].len(), got[1].len()), (3, 6));
        }
    }
}

/// Prefixes outlive their sequences in a paged batch: a finished request's whole pages of keys
/// stay (counted as free: the pool takes them back when it needs them), a later request that
/// starts the same way shares them and still gets the tokens `generate` gives it alone, a request
/// that needs the whole pool evicts them, and a contiguous cache just forgets.
#[test]
fn paged_batch_keeps_finished_prefixes() {
    use flash_llama::{Batcher, Request};
    for dtype in [DType::F32, DType::F8E4M3] {
        let model = paged_batch_model(dtype);
        let system = tokens(37, 9);
        let request = |prompt: Vec<u32>, max_tokens: usize| Request {
            prompt,
            max_tokens,
            sampling: SamplingParams::default(),
            stop_tokens: vec![],
        };
        let with_system = |tail: u32| system.iter().copied().chain(tokens(4, tail)).collect::<Vec<u32>>();
        let cache = model.new_paged_cache(2, 6, 16, 96, dtype).unwrap();
        let mut batcher = Batcher::with_cache(&model, cache).unwrap();
        let run = |batcher: &mut Batcher, id: u64, r: &Request| -> Vec<u32> {
            batcher.join(id, r.clone()).unwrap();
            let mut got = Vec::new();
            while batcher.running() > 0 {
                got.extend(batcher.step().unwrap().iter().map(|e| e.token));
            }
            got
        };
        // A: 41 + 3 tokens, 43 cached when it ends: its first 2 pages (32 tokens) stay.
        let a = request(with_system(1), 3);
        run(&mut batcher, 0, &a);
        assert_eq!(batcher.prefix_cache_pages(), Some(2), "{dtype:?}");
        assert_eq!(batcher.free_pages(), Some(6), "{dtype:?}: kept pages count as free");
        // B starts like A: it shares those 2 pages (and keeps them: nothing new to retire).
        let b = request(with_system(2), 6);
        let got_b = run(&mut batcher, 1, &b);
        assert_eq!(batcher.prefix_cache_pages(), Some(2), "{dtype:?}");
        // C needs the whole pool (96 tokens, 6 pages): the kept prefix goes.
        let c = request(tokens(90, 5), 6);
        let got_c = run(&mut batcher, 2, &c);
        assert_eq!(got_c.len(), 6);
        assert!(
            batcher.prefix_cache_pages().unwrap() <= 5,
            "{dtype:?}: C's own pages now"
        );
        assert_eq!(batcher.free_pages(), Some(6));
        // D starts like A again, after the eviction: computed afresh.
        let d = request(with_system(3), 4);
        let got_d = run(&mut batcher, 3, &d);
        if dtype == DType::F32 {
            for (r, got) in [(&b, &got_b), (&d, &got_d)] {
                assert_eq!(got, &generated_alone(&model, r, None));
            }
        } else {
            assert_eq!((got_b.len(), got_d.len()), (6, 4));
        }
    }
    // A contiguous cache keeps nothing.
    let model = load(Family::Llama, DType::F32);
    let mut contiguous = model.new_cache(2, 64).unwrap();
    model.step(&[tokens(40, 3), vec![]], &mut contiguous).unwrap();
    contiguous.retire_sequence(0, &tokens(40, 3)).unwrap();
    assert_eq!(contiguous.lens(), &[0, 0]);
    assert_eq!(contiguous.prefix_cache_pages(), None);
    // On a paged cache, retiring keeps whole pages of what the sequence holds, once.
    let mut paged = model.new_paged_cache(2, 8, 16, 64, DType::F32).unwrap();
    let prompt = tokens(40, 3);
    model.step(&[prompt.clone(), vec![]], &mut paged).unwrap();
    paged.retire_sequence(0, &prompt).unwrap();
    assert_eq!((paged.lens(), paged.prefix_cache_pages()), (&[0usize, 0][..], Some(2)));
    model.step(&[prompt.clone(), vec![]], &mut paged).unwrap();
    paged.retire_sequence(0, &prompt).unwrap();
    assert_eq!(paged.prefix_cache_pages(), Some(2), "the same prefix is kept once");
    let err = paged.retire_sequence(2, &prompt).unwrap_err().to_string();
    assert!(err.contains("no sequence 2"), "{err}");
    paged.reset();
    assert_eq!((paged.prefix_cache_pages(), paged.free_pages()), (Some(0), Some(8)));
}

/// The host's `sample_rows` draws follow the kept distribution (temperature, top-k, top-p): the
/// same check as the GPU's (tests/common/sampling.rs).
#[test]
fn sample_rows_draws_the_kept_distribution() -> candle_core::Result<()> {
    common::sampling::draws_follow_the_kept_distribution(&Device::Cpu)
}
