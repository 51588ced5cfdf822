//! Training a [`Llama`] from scratch: presets, fresh weights as f32 master [`Var`]s, the
//! cross-entropy loss, AdamW steps with gradient accumulation and clipping, held-out
//! evaluation, and checkpoints that resume the identical run. `examples/train.rs` is the
//! command-line front end (docs/train.md).
//!
//! Mixed precision: the trainable weights are f32 `Var`s (master weights, updated by AdamW in
//! f32). Each step builds the model from them cast to the compute dtype (bf16 on the GPU);
//! the casts are graph nodes, so the backward hands f32 gradients back to the masters. On the
//! CPU the compute dtype is f32 and the model uses the `Var`s themselves.
//!
//! Every op of the training forward has a backward: RMSNorm, RoPE and SiLU × up are our fused
//! ops with backward kernels ([`Kernels::Trainable`], [`crate::train_ops`]), the loss is a
//! log-softmax written with basic ops, and attention is flash-attn3, whose backward the op
//! provides.
//!
//! Data parallelism ([`Trainer::set_data_parallel`]): every rank holds a full replica and runs
//! the same program. Each rank draws every micro-batch of a step (so the sampler's state stays
//! the same everywhere) but computes the gradients of only its share, micro-batches `rank`,
//! `rank + world`, ...; the summed gradients are all-reduced in large buckets, and every rank
//! applies the same update to the same weights. A step of N ranks is therefore the step of one
//! device over the same global batch, up to the order of the floating-point sums.
//!
//! Context parallelism ([`Trainer::set_context_parallel`]): every rank computes every
//! micro-batch, but only its consecutive chunk of each sequence, with ring attention between the
//! ranks; its loss is its share of the mean, and gradients and losses are summed as above.

pub mod data;
mod explicit;
pub mod optim;

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use crate::config::{Architecture, Config};
use crate::model::Llama;
use crate::nn::Kernels;
use crate::parallel::{self, Communicator, Group};
pub use data::{Corpus, Rng, Tokenization};
use explicit::{ExplicitModel, FinishedGrads, MicroBatch};
pub use optim::{AdamW, AdamWParams};

/// How a training step computes its gradients. Both give the same gradients up to the order of
/// floating-point sums (the tests compare them); they differ in speed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backward {
    /// The decoder's backward written out (module `explicit`): each gradient computed once
    /// where it is produced, none of candle's per-tensor gradient bookkeeping. Covers the
    /// models the trainer builds (plain Llama blocks) without context parallelism; other
    /// runs use [`Backward::Autograd`] whatever is asked.
    #[default]
    Explicit,
    /// `loss.backward()` through [`Llama::forward`] (or its context-parallel form), the way a
    /// user composing their own model trains through flash-attn3.
    Autograd,
}

/// The optimisation side of a run: everything but the model's shape. Stored in checkpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    /// Sequences per micro-batch.
    pub batch_size: usize,
    pub seq_len: usize,
    /// Micro-batches whose gradients are summed into one update.
    pub grad_accum: usize,
    /// Updates in the whole run (the cosine schedule ends here).
    pub steps: usize,
    pub warmup_steps: usize,
    pub lr: f64,
    /// The learning rate the cosine decay ends at.
    pub min_lr: f64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Maximum global gradient norm; 0 disables clipping.
    pub grad_clip: f64,
    /// Held-out micro-batches per evaluation.
    pub eval_batches: usize,
    /// Seeds the initial weights and the batch sampler.
    pub seed: u64,
}

impl TrainConfig {
    /// Tokens consumed by one update.
    pub fn tokens_per_step(&self) -> usize {
        self.batch_size * self.seq_len * self.grad_accum
    }

    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("batch_size", self.batch_size),
            ("seq_len", self.seq_len),
            ("grad_accum", self.grad_accum),
            ("steps", self.steps),
            ("eval_batches", self.eval_batches),
        ] {
            if v == 0 {
                bail!("invalid training config: {name} is 0")
            }
        }
        if !(self.lr > 0.0 && self.min_lr >= 0.0 && self.lr.is_finite()) {
            bail!("invalid training config: lr must be > 0 and min_lr >= 0")
        }
        Ok(())
    }
}

/// The model shapes and training settings of a preset, for a vocabulary of `vocab_size` ids.
///
/// - `tiny`: 4 layers of width 128 (GQA 4:2), 128-token windows; 0.86M parameters, trains
///   in a few minutes on a 2-core CPU.
/// - `125m`: 12 layers of width 768, 12 heads of 64, SwiGLU width 3456, 2048-token windows;
///   124M parameters with the byte vocabulary, for the GPU (bf16).
pub fn preset(name: &str, vocab_size: usize) -> Result<(Config, TrainConfig)> {
    let common = TrainConfig {
        batch_size: 8,
        seq_len: 128,
        grad_accum: 1,
        steps: 300,
        warmup_steps: 30,
        lr: 3e-3,
        min_lr: 3e-4,
        weight_decay: 0.1,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        grad_clip: 1.0,
        eval_batches: 4,
        seed: 0,
    };
    match name {
        "tiny" => Ok((llama_config(vocab_size, 128, 384, 4, 4, 2, 128), common)),
        "125m" => Ok((
            llama_config(vocab_size, 768, 3456, 12, 12, 12, 2048),
            TrainConfig {
                batch_size: 8,
                seq_len: 2048,
                grad_accum: 4,
                steps: 5000,
                warmup_steps: 200,
                lr: 6e-4,
                min_lr: 6e-5,
                eval_batches: 8,
                ..common
            },
        )),
        other => bail!("unknown preset `{other}`: use tiny or 125m"),
    }
}

/// A Llama decoder of the given shape (head_dim = hidden / heads, untied output head, no
/// biases, RoPE θ = 10000), trained from scratch.
pub fn llama_config(
    vocab_size: usize,
    hidden: usize,
    intermediate: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    max_positions: usize,
) -> Config {
    Config {
        architecture: Architecture::Llama,
        vocab_size,
        hidden_size: hidden,
        intermediate_size: intermediate,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        head_dim: hidden / heads,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        rope_freq_factors: None,
        rope_interleaved: false,
        max_position_embeddings: max_positions,
        tie_word_embeddings: false,
        attention_bias: false,
        qk_norm: false,
        sliding_window: None,
        bos_token_id: None,
        eos_token_ids: Vec::new(),
    }
}

/// `cfg` as an HF `config.json` that [`Config::from_hf_json`] reads back identically (for the
/// configs [`llama_config`] makes: Llama architecture, no RoPE scaling).
pub fn hf_config_json(cfg: &Config) -> Result<String> {
    // What config.json cannot say for a `llama` model_type (a window needs Mistral's type, the
    // frequency factors come from GGUF files) would not survive the round trip.
    if cfg.architecture != Architecture::Llama
        || cfg.rope_scaling.is_some()
        || cfg.rope_freq_factors.is_some()
        || cfg.sliding_window.is_some()
        || cfg.qk_norm
        || cfg.rope_interleaved
    {
        bail!("the trainer checkpoints plain Llama configs only (no RoPE scaling, sliding window, q/k norm)")
    }
    Ok(serde_json::json!({
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "sliding_window": cfg.sliding_window,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids,
    })
    .to_string())
}

/// A `VarBuilder` backend that hands out zero-cost placeholders and notes what was asked for:
/// running [`Llama::load`] over it lists the model's weights by name and shape, so the trainer
/// never keeps a second copy of the naming scheme.
struct ShapeRecorder(Arc<Mutex<Vec<(String, Shape)>>>);

impl SimpleBackend for ShapeRecorder {
    fn get(&self, s: Shape, name: &str, _: candle_nn::Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.0.lock().unwrap().push((name.to_string(), s.clone()));
        // A broadcast scalar: the right shape without allocating it.
        Tensor::zeros((), dtype, dev)?.broadcast_as(s)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("the model asked for `{name}` without a shape")
    }

    fn contains_tensor(&self, _: &str) -> bool {
        true
    }
}

/// Every weight of a model of `cfg`: HF name and shape, sorted by name.
pub fn parameter_shapes(cfg: &Config) -> Result<Vec<(String, Shape)>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let vb = VarBuilder::from_backend(Box::new(ShapeRecorder(seen.clone())), DType::F32, Device::Cpu);
    Llama::load(vb, cfg, Kernels::Composed)?;
    let mut shapes = std::mem::take(&mut *seen.lock().unwrap());
    shapes.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(shapes)
}

/// Parameters that take part in matrix products: every weight matrix but the input embedding
/// (a lookup) unless it doubles as the output head.
pub fn matmul_parameters(cfg: &Config) -> Result<usize> {
    Ok(parameter_shapes(cfg)?
        .iter()
        .filter(|(name, s)| s.rank() == 2 && (cfg.tie_word_embeddings || !name.ends_with("embed_tokens.weight")))
        .map(|(_, s)| s.elem_count())
        .sum())
}

/// Training FLOPs per token (forward + backward) at sequence length `seq_len`: 6 per
/// matmul parameter (2 forward, 4 backward) plus attention's two products, 4·seq·head_dim per
/// head and layer forward, ×3 with the backward and halved by the causal mask. MFU divides
/// this by the device's peak.
pub fn flops_per_token(cfg: &Config, seq_len: usize) -> Result<f64> {
    let attention = 6.0 * (cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq_len) as f64;
    Ok(6.0 * matmul_parameters(cfg)? as f64 + attention)
}

/// Mean cross-entropy of `logits` (tokens, vocab) against `targets` (tokens,) u32, through a
/// log-softmax of basic ops (candle-nn's fused softmax has no backward).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    // The row maximum only keeps exp in range; the result does not depend on it, so it needs no
    // gradient (and the backward skips the max's mask).
    let max = logits.max_keepdim(1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let log_z = shifted.exp()?.sum_keepdim(1)?.log()?;
    let picked = shifted.gather(&targets.unsqueeze(1)?, 1)?;
    (log_z - picked)?.mean_all()
}

/// Losses so far: (step, loss) after each update and at each evaluation.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct History {
    pub train: Vec<(usize, f32)>,
    pub eval: Vec<(usize, f32)>,
}

/// What one update did.
#[derive(Debug, Clone, Copy)]
pub struct StepStats {
    /// Updates done, this one included.
    pub step: usize,
    /// Mean loss over the step's micro-batches (before the update).
    pub loss: f32,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    pub lr: f64,
    pub tokens: usize,
}

/// The state of a training run: master weights, optimizer moments, sampler, step, history.
pub struct Trainer {
    model_config: Config,
    config: TrainConfig,
    names: Vec<String>,
    /// f32 master weights, in `names` order.
    vars: Vec<Var>,
    optimizer: AdamW,
    rng: Rng,
    step: usize,
    /// The dtype the model computes in (bf16 on the GPU, f32 on the CPU).
    dtype: DType,
    device: Device,
    history: History,
    /// The data-parallel group this replica belongs to; `None` trains alone.
    data_parallel: Option<Box<dyn Communicator>>,
    /// The context-parallel group: each rank holds a slice of every sequence.
    context_parallel: Option<Group>,
    backward: Backward,
    /// Activation checkpointing (explicit backward only): see [`Trainer::set_activation_checkpointing`].
    checkpoint_activations: bool,
    /// Data-parallel gradient sums started during the backward: see [`Trainer::set_overlapped_gradient_sums`].
    overlap_gradient_sums: bool,
    /// The explicit backward's model (its 16-bit weights, stacked), kept from one step to the
    /// next on the GPU, where the optimizer step writes its weights with the masters: a step
    /// then casts nothing. `None`: the next step builds it.
    kept_model: Option<ExplicitModel>,
}

/// Checkpoint format tag (safetensors metadata key `format`).
const FORMAT: &str = "flash-llama-train/1";
/// The batch sampler's seed differs from the weights' so the two streams are unrelated.
const DATA_SEED_SALT: u64 = 0x5EED_DA7A;
/// Gradients are all-reduced in buckets of this many bytes: large enough that each collective
/// runs near the link's bandwidth, small enough that the packed copy costs little memory.
const GRAD_BUCKET_BYTES: usize = 128 << 20;

impl Trainer {
    /// A new run: weights drawn from `config.seed` (N(0, 0.02); the residual output projections
    /// o_proj and down_proj scaled by 1/√(2·layers) as in GPT-2, so the residual stream does not
    /// grow with depth; norm gains 1, biases 0) and zero optimizer moments.
    pub fn new(model_config: Config, config: TrainConfig, dtype: DType, device: &Device) -> Result<Self> {
        model_config.validate()?;
        config.validate()?;
        let mut rng = Rng(config.seed);
        let residual_std = 0.02 / (2.0 * model_config.num_hidden_layers as f64).sqrt();
        let mut names = Vec::new();
        let mut vars = Vec::new();
        for (name, shape) in parameter_shapes(&model_config)? {
            let n = shape.elem_count();
            let values = if name.ends_with("norm.weight") {
                vec![1f32; n]
            } else if name.ends_with(".bias") {
                vec![0f32; n]
            } else if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
                rng.normals(n, residual_std)
            } else {
                rng.normals(n, 0.02)
            };
            vars.push(Var::from_tensor(&Tensor::from_vec(values, shape, device)?)?);
            names.push(name);
        }
        let optimizer = AdamW::new(&vars, adamw_params(&config))?;
        Ok(Self {
            rng: Rng(config.seed ^ DATA_SEED_SALT),
            model_config,
            config,
            names,
            vars,
            optimizer,
            step: 0,
            dtype,
            device: device.clone(),
            history: History::default(),
            data_parallel: None,
            context_parallel: None,
            backward: Backward::default(),
            checkpoint_activations: false,
            overlap_gradient_sums: true,
            kept_model: None,
        })
    }

    /// Makes this trainer one replica of a data-parallel group: from the next step on it
    /// computes the gradients of its share of each step's micro-batches and sums them with the
    /// other ranks' (see the module docs). Every rank must start from the same state (the same
    /// `new` arguments, or the same checkpoint) and call the same methods in the same order.
    /// The micro-batches per step (`grad_accum`) must be a multiple of the ranks.
    pub fn set_data_parallel(&mut self, comm: Box<dyn Communicator>) -> Result<()> {
        let world = comm.world_size();
        if self.context_parallel.is_some() {
            bail!("a trainer is data-parallel or context-parallel, not both")
        }
        if self.config.grad_accum % world != 0 {
            bail!(
                "data-parallel training over {world} ranks needs a multiple of {world} micro-batches per step \
                 (--grad-accum), not {}: each rank computes grad_accum / ranks of them",
                self.config.grad_accum
            )
        }
        self.data_parallel = Some(comm);
        Ok(())
    }

    /// Makes this trainer one rank of a context-parallel group: each micro-batch's sequences are
    /// cut into equal consecutive chunks, rank r computes the loss of chunk r through ring
    /// attention ([`Llama::forward_context_parallel`]) and the gradients are summed over the
    /// ranks. Activation memory per rank falls with the ranks, so sequences too long for one
    /// device train on several. Same rules as [`Trainer::set_data_parallel`]; `seq_len` must be
    /// a multiple of the ranks.
    pub fn set_context_parallel(&mut self, group: Group) -> Result<()> {
        let world = group.world_size();
        if self.config.seq_len % world != 0 {
            bail!(
                "context-parallel training over {world} ranks needs a sequence length that is a multiple of {world}, not {}",
                self.config.seq_len
            )
        }
        if self.data_parallel.is_some() {
            bail!("a trainer is data-parallel or context-parallel, not both")
        }
        self.context_parallel = Some(group);
        self.kept_model = None;
        Ok(())
    }

    /// The group gradients and losses are summed over: the data- or context-parallel one.
    fn reduce_group(&self) -> Option<&dyn Communicator> {
        match (&self.data_parallel, &self.context_parallel) {
            (Some(c), _) => Some(c.as_ref()),
            (None, Some(g)) => Some(g.as_ref() as &dyn Communicator),
            (None, None) => None,
        }
    }

    /// This replica's data-parallel rank and group size ((0, 1) when not data-parallel).
    pub fn rank_and_world(&self) -> (usize, usize) {
        self.data_parallel
            .as_ref()
            .map_or((0, 1), |c| (c.rank(), c.world_size()))
    }

    /// Chooses how the next steps compute their gradients (default [`Backward::Explicit`]).
    pub fn set_backward(&mut self, backward: Backward) {
        self.backward = backward;
        self.kept_model = None;
    }

    /// Activation checkpointing: the forward keeps only each layer's input and the backward runs
    /// each layer's forward again from it, so activation memory is one layer's plus one residual
    /// stream per layer instead of every layer's (about a third more compute; the same
    /// gradients bit for bit). Longer sequences fit on one device. Needs the explicit backward:
    /// a step under [`Backward::Autograd`] with it set is an error.
    pub fn set_activation_checkpointing(&mut self, on: bool) {
        self.checkpoint_activations = on;
        self.kept_model = None;
    }

    /// Data-parallel with the explicit backward: whether the last micro-batch's backward starts
    /// each layer's gradient sums over the ranks as soon as the layer is done, on a stream of
    /// their own beside the layers still to come (the default), or sums all gradients after the
    /// backward, in 128 MiB buckets (the same sums; for comparing the two).
    pub fn set_overlapped_gradient_sums(&mut self, on: bool) {
        self.overlap_gradient_sums = on;
    }

    /// How steps compute their gradients: the choice of [`Trainer::set_backward`] where it
    /// applies, otherwise [`Backward::Autograd`].
    pub fn backward(&self) -> Backward {
        match self.backward {
            Backward::Explicit if self.context_parallel.is_none() && ExplicitModel::supports(&self.model_config) => {
                Backward::Explicit
            }
            _ => Backward::Autograd,
        }
    }

    /// The loss of one micro-batch (`inputs` → `targets`, batch_size × seq_len ids each) and its
    /// gradient with respect to every master weight (f32, in [`Trainer::parameters`] order),
    /// computed as `backward` says; no update. For checking the two ways against each other.
    pub fn gradients(&self, inputs: Vec<u32>, targets: Vec<u32>, backward: Backward) -> Result<(f32, Vec<Tensor>)> {
        let mut grads = vec![None; self.vars.len()];
        let model = self.gradient_model(backward)?;
        let batch = model.prepare(self, inputs, targets)?;
        // The explicit backward hands each gradient over once it is complete (data parallelism
        // starts its sum there): take it at that point, as the data-parallel step does, so that
        // a gradient handed over early, or twice, or never, is an error here.
        let mut done: Vec<Option<Tensor>> = vec![None; self.vars.len()];
        let mut take = |indices: &[usize], sums: &mut [Option<Tensor>]| -> candle_core::Result<()> {
            for &i in indices {
                match (sums[i].take(), &done[i]) {
                    (Some(g), None) => done[i] = Some(g),
                    _ => candle_core::bail!(
                        "internal error: the explicit backward handed `{}` over twice or before its gradient",
                        self.names[i]
                    ),
                }
            }
            Ok(())
        };
        let loss = model.accumulate(self, &batch, 1.0, &mut grads, &mut take)?;
        if matches!(model, GradientModel::Explicit(_)) {
            if let Some(i) = (0..grads.len()).find(|&i| grads[i].is_some() || done[i].is_none()) {
                bail!(
                    "internal error: the explicit backward added to `{}` after handing it over, or never handed it over",
                    self.names[i]
                )
            }
            grads = done;
        }
        Ok((loss.to_scalar::<f32>()?, collect_grads(grads, &self.names)?))
    }

    fn gradient_model(&self, backward: Backward) -> Result<GradientModel> {
        Ok(match backward {
            Backward::Explicit if self.context_parallel.is_none() && ExplicitModel::supports(&self.model_config) => {
                GradientModel::Explicit(self.explicit_model()?)
            }
            _ if self.checkpoint_activations => {
                bail!("activation checkpointing needs the explicit backward (not --autograd, not context parallelism)")
            }
            _ => GradientModel::Autograd(self.model()?),
        })
    }

    fn explicit_model(&self) -> Result<ExplicitModel> {
        ExplicitModel::new(
            &self.model_config,
            &self.names,
            &self.vars,
            self.dtype,
            (self.config.batch_size, self.config.seq_len),
            self.checkpoint_activations,
        )
        .map_err(Into::into)
    }

    pub fn model_config(&self) -> &Config {
        &self.model_config
    }

    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    /// Updates done so far.
    pub fn step(&self) -> usize {
        self.step
    }

    pub fn history(&self) -> &History {
        &self.history
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of trainable parameters.
    pub fn num_parameters(&self) -> usize {
        self.vars.iter().map(|v| v.elem_count()).sum()
    }

    /// The master weights by name (f32). To read: a step on the GPU keeps 16-bit copies of them
    /// that only its optimizer updates, so a weight changed here (`Var::set`) would not reach the
    /// next step's forward; save a checkpoint and [`Trainer::resume`] from it instead.
    pub fn parameters(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.names.iter().map(String::as_str).zip(&self.vars)
    }

    /// The model at the current weights, in the compute dtype. Its weights are the master
    /// `Var`s (f32) or casts of them, so a loss computed with it differentiates into the masters.
    /// It does not follow later updates: build it again after a step.
    pub fn model(&self) -> Result<Llama> {
        self.build_model(false)
    }

    /// The model at the current weights for inference (sampling): no autograd graph is
    /// recorded through it.
    pub fn inference_model(&self) -> Result<Llama> {
        self.build_model(true)
    }

    fn build_model(&self, detached: bool) -> Result<Llama> {
        let tensors: HashMap<String, Tensor> = self
            .parameters()
            .map(|(n, v)| {
                let t = if detached {
                    v.as_tensor().detach()
                } else {
                    v.as_tensor().clone()
                };
                (n.to_string(), t)
            })
            .collect();
        let vb = VarBuilder::from_tensors(tensors, self.dtype, &self.device);
        Ok(Llama::load(vb, &self.model_config, Kernels::Trainable)?)
    }

    /// Mean loss of `model` on one batch; `inputs`/`targets` are batch × seq_len ids. With
    /// context parallelism: this rank's share of it (the mean over its chunk of every sequence,
    /// divided by the ranks), which the group sums.
    fn batch_loss(&self, model: &Llama, inputs: Vec<u32>, targets: Vec<u32>) -> Result<Tensor> {
        let (b, s) = (self.config.batch_size, self.config.seq_len);
        let x = Tensor::from_vec(inputs, (b, s), &self.device)?;
        let y = Tensor::from_vec(targets, (b, s), &self.device)?;
        let vocab = self.model_config.vocab_size;
        let Some(group) = &self.context_parallel else {
            let logits = model.forward(&x)?;
            return Ok(cross_entropy(&logits.reshape((b * s, vocab))?, &y.flatten_all()?)?);
        };
        let world = group.world_size();
        let chunk = s / world;
        let slice = |t: &Tensor| t.narrow(1, group.rank() * chunk, chunk)?.contiguous();
        let logits = model.forward_context_parallel(&slice(&x)?, group)?;
        let loss = cross_entropy(&logits.reshape((b * chunk, vocab))?, &slice(&y)?.flatten_all()?)?;
        Ok((loss / world as f64)?)
    }

    /// One update: `grad_accum` micro-batches drawn from the training part, gradients summed,
    /// clipped by their global norm, then AdamW at the scheduled learning rate.
    pub fn train_step(&mut self, data: &Corpus) -> Result<StepStats> {
        let c = self.config.clone();
        data.check_fits(c.seq_len)?;
        let model = match self.kept_model.take() {
            Some(kept) => GradientModel::Explicit(kept),
            None => self.gradient_model(self.backward)?,
        };
        let (rank, world) = self.rank_and_world();
        // This rank's micro-batches, uploaded before any of their kernels is queued: an upload
        // from host memory waits for the GPU's queue to drain, which in the middle of the step
        // would leave the GPU idle until the host queued the next kernels. Every rank draws
        // every micro-batch, so that the samplers stay in step.
        let mut batches = Vec::new();
        for micro_batch in 0..c.grad_accum {
            let (inputs, targets) = data.sample_batch(&mut self.rng, c.batch_size, c.seq_len);
            if micro_batch % world == rank {
                batches.push(model.prepare(self, inputs, targets)?);
            }
        }
        let mut sums: Vec<Option<Tensor>> = vec![None; self.vars.len()];
        // Data-parallel with the explicit backward: the last micro-batch's backward starts each
        // layer's gradient sums over the ranks as soon as the layer is done, so that they run
        // beside the layers still to come instead of after the whole backward.
        let overlapped = match (self.data_parallel.as_deref(), &model) {
            (Some(comm), GradientModel::Explicit(_)) if self.overlap_gradient_sums => Some(comm),
            _ => None,
        };
        let mut reduced: Vec<Option<Tensor>> = vec![None; self.vars.len()];
        let mut start_sums = |indices: &[usize], sums: &mut [Option<Tensor>]| -> candle_core::Result<()> {
            let Some(comm) = overlapped else { return Ok(()) };
            let indices: Vec<usize> = indices.iter().copied().filter(|&i| sums[i].is_some()).collect();
            let group: Vec<Tensor> = indices.iter().filter_map(|&i| sums[i].take()).collect();
            for (i, sum) in indices.into_iter().zip(comm.start_all_reduce_sum(&group)?) {
                reduced[i] = Some(sum);
            }
            Ok(())
        };
        let mut no_start = |_: &[usize], _: &mut [Option<Tensor>]| -> candle_core::Result<()> { Ok(()) };
        // The losses stay on the device: the step waits for the GPU once, at its end.
        let mut loss_sum: Option<Tensor> = None;
        for (i, batch) in batches.iter().enumerate() {
            let finished: FinishedGrads = match i + 1 == batches.len() {
                true => &mut start_sums,
                false => &mut no_start,
            };
            // Dividing by the micro-batch count makes the summed gradient that of the mean loss.
            let loss = model.accumulate(self, batch, 1.0 / c.grad_accum as f64, &mut sums, finished)?;
            loss_sum = Some(match loss_sum.take() {
                None => loss,
                Some(s) => (s + loss)?,
            });
        }
        let mut loss = match loss_sum {
            Some(l) => l,
            // A rank without a micro-batch (fewer micro-batches than ranks is refused, so never).
            None => Tensor::zeros((), DType::F32, &self.device)?,
        };
        let grads = match overlapped {
            Some(comm) => {
                // Any gradient the backward did not hand over (none today) is summed now.
                let rest: Vec<usize> = (0..sums.len()).filter(|&i| sums[i].is_some()).collect();
                start_sums(&rest, &mut sums)?;
                comm.finish_all_reduces()?;
                loss = comm.all_reduce_sum(&loss)?;
                collect_grads(reduced, &self.names)?
            }
            None => {
                let mut grads = match batches.is_empty() {
                    false => collect_grads(sums, &self.names)?,
                    true => Vec::new(),
                };
                if let Some(comm) = self.reduce_group() {
                    grads = parallel::all_reduce_sum_bucketed(comm, &grads, GRAD_BUCKET_BYTES)?;
                    loss = comm.all_reduce_sum(&loss)?;
                }
                grads
            }
        };
        let lr = optim::learning_rate(self.step, c.warmup_steps, c.steps, c.lr, c.min_lr);
        // On the GPU with a 16-bit compute dtype, the explicit model's weights are written by the
        // optimizer step and kept for the next step.
        let keep = self.device.is_cuda() && matches!(self.dtype, DType::BF16 | DType::F16);
        let copies = match &model {
            GradientModel::Explicit(m) if keep => m.weight_copies(self.vars.len())?,
            _ => Vec::new(),
        };
        let stats =
            self.optimizer
                .update_with_copies(&self.vars, &grads, &loss, c.grad_clip, lr, self.step + 1, &copies)?;
        drop(copies);
        // The one wait of the step: the loss and the update's statistics.
        let read = Tensor::cat(&[loss.reshape(1)?, stats], 0)?.to_vec1::<f32>()?;
        let (loss, grad_norm, skipped) = (read[0], f64::from(read[1]), read[3] != 0.0);
        if skipped || !loss.is_finite() {
            bail!(
                "the training loss is {loss} (gradient norm {grad_norm}) at step {}: the run diverged (try a lower --lr); \
                 the weights are those after step {}",
                self.step + 1,
                self.step
            )
        }
        self.step += 1;
        self.history.train.push((self.step, loss));
        if let GradientModel::Explicit(m) = model {
            if keep {
                self.kept_model = Some(m);
            }
        }
        Ok(StepStats {
            step: self.step,
            loss,
            grad_norm,
            lr,
            tokens: c.tokens_per_step(),
        })
    }

    /// Mean loss over the held-out batches (the same windows every time), recorded in the
    /// history at the current step.
    pub fn evaluate(&mut self, data: &Corpus) -> Result<f32> {
        let c = &self.config;
        data.check_fits(c.seq_len)?;
        // Detached weights: no graph is recorded for a forward that is never differentiated.
        let model = self.inference_model()?;
        let (rank, world) = self.rank_and_world();
        let mut sum = 0f64;
        let mut last = None;
        // Data-parallel: the ranks share the batches, then sum.
        for i in (rank..c.eval_batches).step_by(world) {
            let (inputs, targets) = data.eval_batch(i, c.eval_batches, c.batch_size, c.seq_len);
            let loss = self.batch_loss(&model, inputs, targets)?;
            sum += loss.to_scalar::<f32>()? as f64;
            last = Some(loss);
        }
        if let Some(comm) = self.reduce_group() {
            // A rank without a batch (more ranks than batches) still joins the sum.
            let like = match last {
                Some(l) => l,
                None => Tensor::zeros(1, DType::F32, &self.device)?,
            };
            sum = parallel::all_reduce_scalar(comm, sum as f32, &like)? as f64;
        }
        let loss = (sum / c.eval_batches as f64) as f32;
        self.history.eval.push((self.step, loss));
        Ok(loss)
    }

    /// Writes a safetensors checkpoint: the master weights under their HF names, the AdamW
    /// moments under `optimizer.m.NAME` / `optimizer.v.NAME`, and in the metadata the step, the
    /// sampler state, both configs, the loss history and `data`'s fingerprint. Written to a
    /// temporary file then renamed, so an interrupted save never leaves a torn checkpoint.
    pub fn save(&self, path: &Path, data: &Corpus) -> Result<()> {
        let mut tensors: Vec<(String, Tensor)> = Vec::new();
        for (i, (name, var)) in self.parameters().enumerate() {
            tensors.push((name.to_string(), var.as_tensor().clone()));
            tensors.push((format!("optimizer.m.{name}"), self.optimizer.m[i].clone()));
            tensors.push((format!("optimizer.v.{name}"), self.optimizer.v[i].clone()));
        }
        let metadata = HashMap::from([
            ("format".to_string(), FORMAT.to_string()),
            ("step".to_string(), self.step.to_string()),
            ("rng".to_string(), self.rng.0.to_string()),
            ("model_config".to_string(), hf_config_json(&self.model_config)?),
            ("train_config".to_string(), serde_json::to_string(&self.config)?),
            ("history".to_string(), serde_json::to_string(&self.history)?),
            ("corpus".to_string(), data.fingerprint()),
        ]);
        let tmp = path.with_extension("safetensors.tmp");
        safetensors::serialize_to_file(tensors.iter().map(|(n, t)| (n.as_str(), t)), Some(metadata), &tmp)
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
        Ok(())
    }

    /// Continues the run saved at `path` with the same data: the next [`Trainer::train_step`]
    /// computes exactly what the uninterrupted run's would have. Only the compute dtype and
    /// device come from the caller. A checkpoint of another corpus is refused.
    pub fn resume(path: &Path, data: &Corpus, dtype: DType, device: &Device) -> Result<Self> {
        let bytes = std::fs::read(path).with_context(|| format!("reading the checkpoint {}", path.display()))?;
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)
            .map_err(|e| anyhow!("{} is not a safetensors file ({e})", path.display()))?;
        let md = header.metadata().clone().unwrap_or_default();
        let get = |key: &str| {
            md.get(key).map(String::as_str).with_context(|| {
                format!(
                    "{} is not a checkpoint of the train example (no `{key}` in its metadata)",
                    path.display()
                )
            })
        };
        if get("format")? != FORMAT {
            bail!(
                "{} has checkpoint format {:?}, expected {FORMAT}",
                path.display(),
                get("format")?
            )
        }
        let bad = |what: &str| format!("{}: unreadable `{what}` in the checkpoint metadata", path.display());
        let step: usize = get("step")?.parse().with_context(|| bad("step"))?;
        let rng = Rng(get("rng")?.parse().with_context(|| bad("rng"))?);
        let model_config = Config::from_hf_json(get("model_config")?).with_context(|| bad("model_config"))?;
        let config: TrainConfig = serde_json::from_str(get("train_config")?).with_context(|| bad("train_config"))?;
        let history: History = serde_json::from_str(get("history")?).with_context(|| bad("history"))?;
        let corpus = get("corpus")?;
        if corpus != data.fingerprint() {
            bail!(
                "{} was trained on other data ({corpus}) than this run's ({}): resume with the same --data and tokenizer",
                path.display(),
                data.fingerprint()
            )
        }

        let mut tensors = candle_core::safetensors::load_buffer(&bytes, device)
            .with_context(|| format!("reading the tensors of {}", path.display()))?;
        let mut take = |name: &str, shape: &Shape| -> Result<Tensor> {
            let t = tensors
                .remove(name)
                .with_context(|| format!("{} lacks the tensor `{name}`", path.display()))?;
            if t.shape() != shape || t.dtype() != DType::F32 {
                bail!(
                    "{}: tensor `{name}` is {:?} {:?}, expected F32 {shape:?}",
                    path.display(),
                    t.dtype(),
                    t.shape()
                )
            }
            Ok(t)
        };
        let (mut names, mut vars, mut m, mut v) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (name, shape) in parameter_shapes(&model_config)? {
            vars.push(Var::from_tensor(&take(&name, &shape)?)?);
            m.push(take(&format!("optimizer.m.{name}"), &shape)?);
            v.push(take(&format!("optimizer.v.{name}"), &shape)?);
            names.push(name);
        }
        let optimizer = AdamW {
            params: adamw_params(&config),
            m,
            v,
        };
        Ok(Self {
            model_config,
            config,
            names,
            vars,
            optimizer,
            rng,
            step,
            dtype,
            device: device.clone(),
            history,
            data_parallel: None,
            context_parallel: None,
            backward: Backward::default(),
            checkpoint_activations: false,
            overlap_gradient_sums: true,
            kept_model: None,
        })
    }
}

fn adamw_params(c: &TrainConfig) -> AdamWParams {
    AdamWParams {
        beta1: c.beta1,
        beta2: c.beta2,
        eps: c.eps,
        weight_decay: c.weight_decay,
    }
}

/// What computes a micro-batch's gradients in a step ([`Backward`]).
enum GradientModel {
    Explicit(ExplicitModel),
    Autograd(Llama),
}

/// A micro-batch ready for [`GradientModel::accumulate`]: uploaded (explicit), or the host's ids
/// (autograd, whose model uploads them itself).
enum PreparedBatch {
    Explicit(MicroBatch),
    Autograd { inputs: Vec<u32>, targets: Vec<u32> },
}

impl GradientModel {
    fn prepare(&self, trainer: &Trainer, inputs: Vec<u32>, targets: Vec<u32>) -> Result<PreparedBatch> {
        let c = &trainer.config;
        let vocab = trainer.model_config.vocab_size;
        Ok(match self {
            Self::Explicit(_) => PreparedBatch::Explicit(MicroBatch::new(
                &inputs,
                &targets,
                c.batch_size,
                c.seq_len,
                vocab,
                &trainer.device,
            )?),
            Self::Autograd(_) => PreparedBatch::Autograd { inputs, targets },
        })
    }

    /// The micro-batch's loss times `loss_scale` (an f32 scalar on the device); its gradient
    /// with respect to each of `trainer`'s master weights is added to that weight's f32
    /// accumulator in `grads` (`None`: zero).
    fn accumulate(
        &self,
        trainer: &Trainer,
        batch: &PreparedBatch,
        loss_scale: f64,
        grads: &mut [Option<Tensor>],
        finished: FinishedGrads,
    ) -> Result<Tensor> {
        match (self, batch) {
            (Self::Explicit(model), PreparedBatch::Explicit(mb)) => {
                Ok(model.accumulate(mb, loss_scale, grads, finished)?)
            }
            (Self::Autograd(model), PreparedBatch::Autograd { inputs, targets }) => {
                let loss = (trainer.batch_loss(model, inputs.clone(), targets.clone())? * loss_scale)?;
                let store = loss.backward()?;
                for ((sum, var), name) in grads.iter_mut().zip(&trainer.vars).zip(&trainer.names) {
                    let g = store
                        .get(var)
                        .with_context(|| format!("internal error: the loss does not depend on `{name}`"))?;
                    *sum = Some(match sum.take() {
                        None => g.clone(),
                        Some(s) => (s + g)?,
                    });
                }
                Ok(loss.detach().to_dtype(DType::F32)?)
            }
            _ => bail!("internal error: a micro-batch prepared for the other backward"),
        }
    }
}

/// The accumulated gradients, one per weight: an error naming a weight that got none.
fn collect_grads(grads: Vec<Option<Tensor>>, names: &[String]) -> Result<Vec<Tensor>> {
    grads
        .into_iter()
        .zip(names)
        .map(|(g, name)| g.with_context(|| format!("internal error: the loss does not depend on `{name}`")))
        .collect()
}
