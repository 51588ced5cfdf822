//! Training from scratch on the CPU: the loss falls, a resumed run repeats the uninterrupted one
//! exactly, and the whole model's gradients through flash-attn3 equal those through the
//! textbook attention composite.

mod common;

use candle_core::{DType, Device, Tensor};
use flash_llama::parallel::LocalGroup;
use flash_llama::train::{self, cross_entropy, data, Backward, Corpus, Tokenization, TrainConfig, Trainer};

/// Python-like text with some structure to learn, the same on every run.
fn corpus() -> Corpus {
    let mut rng = data::Rng(7);
    let names = ["alpha", "beta", "gamma", "delta", "value", "count", "items", "result"];
    let docs: Vec<Vec<u32>> = (0..40)
        .map(|i| {
            let mut text = String::new();
            for _ in 0..12 {
                let a = names[rng.below(names.len())];
                let b = names[rng.below(names.len())];
                text += &format!("def {a}_{i}({b}):\n    return {b} + {}\n\n", rng.below(100));
            }
            Tokenization::Bytes.encode(text.as_bytes()).unwrap()
        })
        .collect();
    Corpus::from_documents(docs, Tokenization::Bytes.end_of_text())
}

/// The tiny preset with short windows and a short schedule, so each test takes seconds.
fn tiny(steps: usize, grad_accum: usize) -> (flash_llama::Config, TrainConfig) {
    let (model, cfg) = train::preset("tiny", data::BYTE_VOCAB_SIZE).unwrap();
    let cfg = TrainConfig {
        batch_size: 4,
        seq_len: 64,
        grad_accum,
        steps,
        warmup_steps: 3,
        eval_batches: 2,
        ..cfg
    };
    (model, cfg)
}

#[test]
fn a_few_tiny_steps_lower_the_loss() {
    let data = corpus();
    let (model, cfg) = tiny(25, 1);
    let mut t = Trainer::new(model, cfg, DType::F32, &Device::Cpu).unwrap();
    let eval_before = t.evaluate(&data).unwrap();
    let losses: Vec<f32> = (0..25).map(|_| t.train_step(&data).unwrap().loss).collect();
    let eval_after = t.evaluate(&data).unwrap();
    let first = losses[0];
    let last = losses[20..].iter().sum::<f32>() / 5.0;
    // From about ln(264) = 5.6 (uniform over the byte vocabulary) to well below.
    assert!(first > 5.0, "first loss {first}");
    assert!(last < first - 1.5, "train loss {first} -> {last}: {losses:?}");
    assert!(
        eval_after < eval_before - 1.5,
        "eval loss {eval_before} -> {eval_after}"
    );
    assert_eq!(t.history().train.len(), 25);
    assert_eq!(t.history().eval, vec![(0, eval_before), (25, eval_after)]);
}

/// bf16 compute over f32 master weights (the GPU's setting), here on the CPU: the masters and
/// their gradients stay f32 and the loss falls as in f32.
#[test]
fn bf16_compute_trains_f32_master_weights() {
    let data = corpus();
    let (model, cfg) = tiny(12, 1);
    let mut t = Trainer::new(model, cfg, DType::BF16, &Device::Cpu).unwrap();
    assert_eq!(t.model().unwrap().dtype(), DType::BF16);
    let losses: Vec<f32> = (0..12).map(|_| t.train_step(&data).unwrap().loss).collect();
    assert!(t.parameters().all(|(_, v)| v.dtype() == DType::F32));
    let last = losses[9..].iter().sum::<f32>() / 3.0;
    assert!(
        last < losses[0] - 0.8,
        "bf16 train loss {} -> {last}: {losses:?}",
        losses[0]
    );
}

/// Data parallelism over 2 and 4 ranks (threads through `LocalGroup`, the stand-in for NCCL)
/// takes the same steps as one rank over the same global batch: the same losses, evaluations
/// and weights, up to the order of the f32 sums; and every replica ends with the same weights.
#[test]
fn data_parallel_ranks_take_the_single_rank_steps() {
    ranks_take_the_single_rank_steps(5, 4, |t, g| t.set_data_parallel(Box::new(g)).unwrap());
}

/// Context parallelism over 2 and 4 ranks (each a consecutive quarter or half of every
/// sequence, ring attention through `LocalGroup`) takes the single rank's steps: the same losses,
/// evaluations and weights up to the order of the f32 sums.
#[test]
fn context_parallel_ranks_take_the_single_rank_steps() {
    ranks_take_the_single_rank_steps(4, 2, |t, g| t.set_context_parallel(std::sync::Arc::new(g)).unwrap());
}

/// `steps` tiny-preset steps of `grad_accum` micro-batches on one rank, then on 2 and 4 ranks
/// joined by `join` (each a thread): every rank's losses, evaluation and weights must be the
/// single rank's, and every rank's weights rank 0's.
fn ranks_take_the_single_rank_steps(steps: usize, grad_accum: usize, join: impl Fn(&mut Trainer, LocalGroup) + Sync) {
    let data = corpus();
    let (model, cfg) = tiny(steps, grad_accum);
    let mut alone = Trainer::new(model.clone(), cfg.clone(), DType::F32, &Device::Cpu).unwrap();
    let expected: Vec<f32> = (0..steps).map(|_| alone.train_step(&data).unwrap().loss).collect();
    let expected_eval = alone.evaluate(&data).unwrap();
    let weights = |t: &Trainer| -> Vec<f32> {
        t.parameters()
            .flat_map(|(_, v)| v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .collect()
    };
    let expected_weights = weights(&alone);

    for world in [2, 4] {
        let groups = LocalGroup::new(world).unwrap();
        let ranks: Vec<(Vec<f32>, f32, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|g| {
                    let (model, cfg, data, join, weights) = (model.clone(), cfg.clone(), &data, &join, &weights);
                    s.spawn(move || {
                        let mut t = Trainer::new(model, cfg, DType::F32, &Device::Cpu).unwrap();
                        join(&mut t, g);
                        let losses: Vec<f32> = (0..steps).map(|_| t.train_step(data).unwrap().loss).collect();
                        let eval = t.evaluate(data).unwrap();
                        (losses, eval, weights(&t))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, (losses, eval, w)) in ranks.iter().enumerate() {
            for (step, (a, b)) in expected.iter().zip(losses).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 * a.abs(),
                    "{world} ranks, rank {rank}, step {}: loss {b}, one rank {a}",
                    step + 1
                );
            }
            assert!(
                (eval - expected_eval).abs() <= 1e-5 * expected_eval,
                "{world} ranks: eval {eval} vs {expected_eval}"
            );
            let worst = w
                .iter()
                .zip(&expected_weights)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            // Adam divides by the gradients' RMS, so a rounding difference in a near-zero
            // gradient moves a weight by up to lr-ish amounts after 5 steps; 1e-4 leaves room for
            // that and still fails on a wrong share (which moves weights by ~1e-3 per step).
            assert!(worst < 1e-4, "{world} ranks, rank {rank}: weights differ by {worst}");
            assert_eq!(
                w, &ranks[0].2,
                "{world} ranks: rank {rank}'s replica differs from rank 0's"
            );
        }
    }
}

/// A step's micro-batches must split evenly over the ranks.
#[test]
fn data_parallel_needs_a_multiple_of_the_ranks_in_micro_batches() {
    let (model, cfg) = tiny(5, 3);
    let mut t = Trainer::new(model, cfg, DType::F32, &Device::Cpu).unwrap();
    let group = LocalGroup::new(2).unwrap().remove(0);
    let err = t.set_data_parallel(Box::new(group)).unwrap_err().to_string();
    assert!(err.contains("multiple of 2 micro-batches"), "{err}");
}

/// Context parallelism needs the sequence to split evenly, and a trainer is data- or
/// context-parallel, not both.
#[test]
fn context_parallel_errors() {
    let (model, cfg) = tiny(5, 2);
    let mut t = Trainer::new(model.clone(), cfg.clone(), DType::F32, &Device::Cpu).unwrap();
    // seq_len 64 over 3 ranks.
    let group = LocalGroup::new(3).unwrap().remove(0);
    let err = t
        .set_context_parallel(std::sync::Arc::new(group))
        .unwrap_err()
        .to_string();
    assert!(err.contains("multiple of 3"), "{err}");

    let mut t = Trainer::new(model, cfg, DType::F32, &Device::Cpu).unwrap();
    t.set_data_parallel(Box::new(LocalGroup::new(2).unwrap().remove(0)))
        .unwrap();
    let group = LocalGroup::new(2).unwrap().remove(0);
    let err = t
        .set_context_parallel(std::sync::Arc::new(group))
        .unwrap_err()
        .to_string();
    assert!(err.contains("not both"), "{err}");
}

#[test]
fn resuming_repeats_the_uninterrupted_run() {
    let data = corpus();
    let (model, cfg) = tiny(8, 2);
    let dev = Device::Cpu;

    let mut whole = Trainer::new(model.clone(), cfg.clone(), DType::F32, &dev).unwrap();
    let expected: Vec<f32> = (0..8).map(|_| whole.train_step(&data).unwrap().loss).collect();
    let expected_eval = whole.evaluate(&data).unwrap();

    let dir = common::temp_dir("resume");
    let path = dir.join("checkpoint.safetensors");
    let mut first = Trainer::new(model, cfg, DType::F32, &dev).unwrap();
    let mut losses: Vec<f32> = (0..4).map(|_| first.train_step(&data).unwrap().loss).collect();
    first.save(&path, &data).unwrap();
    drop(first);
    let mut resumed = Trainer::resume(&path, &data, DType::F32, &dev).unwrap();
    assert_eq!(resumed.step(), 4);
    assert_eq!(resumed.model_config(), whole.model_config());
    assert_eq!(resumed.config(), whole.config());
    losses.extend((0..4).map(|_| resumed.train_step(&data).unwrap().loss));

    // Bit for bit: same weights, moments, schedule and batches after the restart.
    for (step, (a, b)) in expected.iter().zip(&losses).enumerate() {
        assert_eq!(
            a.to_bits(),
            b.to_bits(),
            "step {}: {a} uninterrupted, {b} resumed",
            step + 1
        );
    }
    assert_eq!(resumed.evaluate(&data).unwrap().to_bits(), expected_eval.to_bits());
    assert_eq!(resumed.history().train, whole.history().train);
    for ((name, a), (_, b)) in whole.parameters().zip(resumed.parameters()) {
        let diff = (a.as_tensor() - b.as_tensor())
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap();
        assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0, "{name}");
    }
}

#[test]
fn bad_checkpoints_and_data_are_errors() {
    let data = corpus();
    let dev = Device::Cpu;
    let dir = common::temp_dir("bad-checkpoint");
    let err = |r: anyhow::Result<Trainer>| format!("{:#}", r.err().expect("an error"));

    let missing = dir.join("missing.safetensors");
    assert!(err(Trainer::resume(&missing, &data, DType::F32, &dev)).contains("reading the checkpoint"));
    let garbage = dir.join("garbage.safetensors");
    std::fs::write(&garbage, b"not a checkpoint at all").unwrap();
    assert!(err(Trainer::resume(&garbage, &data, DType::F32, &dev)).contains("not a safetensors file"));
    // A plain weights file (no training metadata).
    let weights = dir.join("weights.safetensors");
    candle_core::safetensors::save(&common::weights(common::Family::Llama), &weights).unwrap();
    assert!(err(Trainer::resume(&weights, &data, DType::F32, &dev)).contains("not a checkpoint of the train example"));

    // A real checkpoint, resumed on other data.
    let (model, cfg) = tiny(2, 1);
    let path = dir.join("checkpoint.safetensors");
    Trainer::new(model, cfg, DType::F32, &dev)
        .unwrap()
        .save(&path, &data)
        .unwrap();
    let other = Corpus::from_documents(
        vec![b"print('hello')\n".repeat(50).iter().map(|&b| b as u32).collect()],
        None,
    );
    assert!(err(Trainer::resume(&path, &other, DType::F32, &dev)).contains("other data"));
    // Cut short: the header promises more bytes than the file has.
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    assert!(Trainer::resume(&path, &data, DType::F32, &dev).is_err());

    // Too little data for one window.
    let short = Corpus::from_documents(vec![vec![1, 2, 3]], None);
    let (model, cfg) = tiny(2, 1);
    let mut t = Trainer::new(model, cfg, DType::F32, &dev).unwrap();
    let e = format!("{:#}", t.train_step(&short).unwrap_err());
    assert!(e.contains("fewer than one window"), "{e}");
    let empty = data::Corpus::from_files(&[], &Tokenization::Bytes, None);
    assert!(format!("{:#}", empty.err().unwrap()).contains("empty"));
}

/// Gradients of every weight, through a loss over the whole model, with attention computed by
/// flash-attn3 and by the matmul / masked softmax / matmul composite.
#[test]
fn model_gradients_match_reference_attention() {
    let dev = Device::Cpu;
    // GQA (4 heads on 2 kv heads), head_dim 16; plain causal and with a sliding window.
    for window in [None, Some(9)] {
        let mut model_cfg = train::llama_config(data::BYTE_VOCAB_SIZE, 64, 96, 2, 4, 2, 64);
        model_cfg.sliding_window = window;
        let (_, cfg) = tiny(1, 1);
        let t = Trainer::new(model_cfg, cfg, DType::F32, &dev).unwrap();
        let model = t.model().unwrap();
        let (b, s) = (2, 37);
        let mut rng = data::Rng(3);
        let ids: Vec<u32> = (0..b * s + 1).map(|_| rng.below(256) as u32).collect();
        let x = Tensor::from_vec(ids[..b * s].to_vec(), (b, s), &dev).unwrap();
        let y = Tensor::from_vec(ids[1..].to_vec(), b * s, &dev).unwrap();
        let loss =
            |logits: Tensor| cross_entropy(&logits.reshape((b * s, data::BYTE_VOCAB_SIZE)).unwrap(), &y).unwrap();
        let ours = loss(model.forward(&x).unwrap());
        let reference = loss(model.forward_reference(&x).unwrap());
        let (lo, lr) = (ours.to_scalar::<f32>().unwrap(), reference.to_scalar::<f32>().unwrap());
        assert!((lo - lr).abs() < 1e-5, "window {window:?}: loss {lo} vs {lr}");
        let g_ours = ours.backward().unwrap();
        let g_ref = reference.backward().unwrap();
        for (name, var) in t.parameters() {
            let a = g_ours.get(var).unwrap_or_else(|| panic!("no gradient for {name}"));
            let r = g_ref.get(var).unwrap();
            let scale = r.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            let diff = (a - r)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(scale > 0.0, "{name}: zero gradient");
            assert!(
                diff <= 1e-4 * scale + 1e-7,
                "window {window:?}, {name}: max |ours - reference| = {diff}, max |reference| = {scale}"
            );
        }
    }
}

/// The explicit backward (the trainer's default) against `loss.backward()` through the model:
/// the same loss and, for every weight, the same gradient up to f32 rounding. GQA, a sliding
/// window, a tied output head, a sequence length off every tile size.
#[test]
fn explicit_backward_matches_autograd() {
    let dev = Device::Cpu;
    for (window, tied) in [(None, false), (Some(9), false), (None, true)] {
        let mut model_cfg = train::llama_config(data::BYTE_VOCAB_SIZE, 64, 96, 2, 4, 2, 64);
        model_cfg.sliding_window = window;
        model_cfg.tie_word_embeddings = tied;
        let (_, cfg) = tiny(1, 1);
        let cfg = TrainConfig {
            batch_size: 2,
            seq_len: 37,
            ..cfg
        };
        let t = Trainer::new(model_cfg, cfg, DType::F32, &dev).unwrap();
        assert_eq!(t.backward(), Backward::Explicit);
        let mut rng = data::Rng(11);
        let ids: Vec<u32> = (0..2 * 37 + 1).map(|_| rng.below(256) as u32).collect();
        let (inputs, targets) = (ids[..74].to_vec(), ids[1..].to_vec());
        let (loss, grads) = t
            .gradients(inputs.clone(), targets.clone(), Backward::Explicit)
            .unwrap();
        let (loss_ref, grads_ref) = t.gradients(inputs, targets, Backward::Autograd).unwrap();
        let case = format!("window {window:?}, tied {tied}");
        assert!(
            loss.is_finite() && (loss - loss_ref).abs() <= 1e-6 * loss_ref,
            "{case}: loss {loss} vs {loss_ref}"
        );
        assert_eq!(grads.len(), t.parameters().count());
        for (((name, _), g), r) in t.parameters().zip(&grads).zip(&grads_ref) {
            assert_eq!(g.dims(), r.dims(), "{case}, {name}");
            assert_eq!(g.dtype(), DType::F32, "{case}, {name}");
            let scale = r.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            let diff = (g - r)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(scale > 0.0, "{case}, {name}: zero gradient");
            // NaN fails both comparisons.
            assert!(
                diff <= 1e-5 * scale,
                "{case}, {name}: max |explicit - autograd| = {diff}, max |autograd| = {scale}"
            );
        }
    }
}

/// Activation checkpointing recomputes each layer's forward in the backward from the layer's
/// input: the same loss and the same gradients bit for bit. Under autograd it is an error.
#[test]
fn activation_checkpointing_gives_the_same_gradients() {
    let dev = Device::Cpu;
    let model_cfg = train::llama_config(data::BYTE_VOCAB_SIZE, 64, 96, 3, 4, 2, 64);
    let (_, cfg) = tiny(1, 1);
    let cfg = TrainConfig {
        batch_size: 2,
        seq_len: 37,
        ..cfg
    };
    let mut t = Trainer::new(model_cfg, cfg, DType::F32, &dev).unwrap();
    let mut rng = data::Rng(13);
    let ids: Vec<u32> = (0..2 * 37 + 1).map(|_| rng.below(256) as u32).collect();
    let (inputs, targets) = (ids[..74].to_vec(), ids[1..].to_vec());
    let (loss, grads) = t
        .gradients(inputs.clone(), targets.clone(), Backward::Explicit)
        .unwrap();
    t.set_activation_checkpointing(true);
    let (loss_ckpt, grads_ckpt) = t
        .gradients(inputs.clone(), targets.clone(), Backward::Explicit)
        .unwrap();
    assert_eq!(loss.to_bits(), loss_ckpt.to_bits());
    for (((name, _), g), c) in t.parameters().zip(&grads).zip(&grads_ckpt) {
        let (g, c) = (
            g.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            c.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        assert!(g.iter().any(|&v| v != 0.0), "{name}: zero gradient");
        assert_eq!(g, c, "{name}: checkpointed gradient differs");
    }
    let err = t.gradients(inputs, targets, Backward::Autograd).unwrap_err();
    assert!(
        format!("{err:#}").contains("activation checkpointing needs the explicit backward"),
        "{err:#}"
    );
}
