//! A micro-batch's loss and gradients with the decoder's backward written out, without candle's
//! autograd ([`crate::train::Backward::Explicit`], the trainer's default).
//!
//! `loss.backward()` through [`crate::Llama::forward`] gives every tensor of the graph a fresh
//! zeros tensor and adds each contribution into it, even the first and only one: a memset and an
//! add the size of every activation, about 40% of the GPU time of a 125m micro-batch
//! (docs/benchmarks-history.md, "Training, GPU"). Here the forward keeps what the backward needs
//! ([`LayerActivations`], or with activation checkpointing only each layer's input), and the
//! backward runs the kernels autograd would (the matmuls, flash-attn3's backward, the backward
//! kernels of [`crate::train_ops`]), each gradient computed once where it is produced. On top of
//! that: q/k/v and gate/up are one matmul each over stacked weights (on the GPU kept from step
//! to step: the optimizer step writes them), the residual adds run inside the norms' launches,
//! each weight gradient is added in f32 to its accumulator by the GEMM that computes it, and the
//! LM head and the loss run over chunks of tokens with the loss's kernels reading and writing
//! the compute dtype (no f32 copy of the logits).
//!
//! The arithmetic is that of the autograd path: the same math in the same dtypes, the weights
//! cast from the f32 masters to the compute dtype; the weight gradients are summed in f32
//! (autograd's are rounded to the compute dtype first). Attention runs in its fixed-length
//! form (every sequence of a micro-batch has the same length), where the model's forward calls
//! the varlen form over the same sequences. The tests compare the two paths' gradients
//! (`crates/model/tests/train.rs`, and on the GPU in bf16).
//!
//! Scope: the decoders the trainer builds (plain Llama blocks: no biases, no q/k norm; sliding
//! windows and GQA are fine). [`ExplicitModel::supports`] says which; the others train through
//! autograd.

use candle_core::{DType, Device, Result, Tensor, Var};
use flash_attn3::FlashAttn;

use crate::config::Config;
use crate::nn::rope_angles;
use crate::train_ops::{
    accumulate_weight_grad, cross_entropy_backward, cross_entropy_logsumexp, rms_norm, rms_norm_add, rms_norm_backward,
    rope_pack_backward, rope_unpack, swiglu_packed, swiglu_packed_backward, TokenIndex,
};

/// The LM head and the loss run over chunks of a micro-batch's tokens whose logits take at most
/// this many bytes (in the compute dtype): a chunk's logits and their gradient are the only
/// (tokens, vocab) tensors that exist, never an f32 copy. A byte vocabulary fits one chunk; a
/// 128k vocabulary in bf16 takes 1,024 tokens a chunk.
const HEAD_CHUNK_BYTES: usize = 256 << 20;

/// One weight that is not a matmul's: its index among the trainer's master variables and its
/// value in the compute dtype (detached: nothing records a graph through it).
struct Param {
    index: usize,
    value: Tensor,
}

/// The weight of one matmul: one trainable weight, or several stacked along the output rows (q,
/// k and v; gate and up), cast to the compute dtype and concatenated once per step, so that one
/// matmul computes them all forward and one their input's gradient backward.
struct Linear {
    value: Tensor,
    /// Each part's master variable and its rows of `value`, in order.
    parts: Vec<(usize, usize)>,
}

impl Linear {
    /// `x · valueᵀ`: x (tokens, in) → (tokens, out).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.matmul(&self.value.t()?)
    }

    /// The backward for the gradient `dy` (tokens, out) of the output: each part's weight
    /// gradient `dyᵀ · x` (its columns of dy) added to its f32 accumulator in `grads`; returns
    /// `dy · value`, the input's gradient.
    fn backward(&self, x: &Tensor, dy: &Tensor, grads: &mut [Option<Tensor>]) -> Result<Tensor> {
        let mut row = 0;
        for &(index, rows) in &self.parts {
            let part = match self.parts.len() {
                1 => dy.clone(),
                _ => dy.narrow(1, row, rows)?,
            };
            grads[index] = Some(accumulate_weight_grad(grads[index].take(), &part, x)?);
            row += rows;
        }
        dy.matmul(&self.value)
    }
}

/// `grads[index] += g` in f32.
fn add_grad(grads: &mut [Option<Tensor>], index: usize, g: &Tensor) -> Result<()> {
    let g = g.to_dtype(DType::F32)?;
    grads[index] = Some(match grads[index].take() {
        None => g,
        Some(sum) => (sum + g)?,
    });
    Ok(())
}

impl Linear {
    /// The master variables' indices of its parts.
    fn indices(&self) -> impl Iterator<Item = usize> + '_ {
        self.parts.iter().map(|&(index, _)| index)
    }
}

/// Where the backward hands each group of gradients that no later work of the micro-batch
/// adds to (a layer's, then the final norm's and the head's, then the embedding's), with the
/// accumulators: a data-parallel step's last micro-batch starts their sums over the ranks there,
/// which then overlap the layers still to come.
pub(crate) type FinishedGrads<'a> = &'a mut dyn FnMut(&[usize], &mut [Option<Tensor>]) -> Result<()>;

struct LayerParams {
    attn_norm: Param,
    /// q, k and v stacked: (heads + 2 · kv_heads) · head_dim rows.
    qkv: Linear,
    o: Linear,
    mlp_norm: Param,
    /// gate and up stacked: 2 · intermediate rows.
    gate_up: Linear,
    down: Linear,
}

impl LayerParams {
    /// Its matmul weights.
    fn linears(&self) -> [&Linear; 4] {
        [&self.qkv, &self.o, &self.gate_up, &self.down]
    }

    /// Its norm gains.
    fn norms(&self) -> [&Param; 2] {
        [&self.attn_norm, &self.mlp_norm]
    }

    /// The master variables' indices of all its weights.
    fn indices(&self) -> Vec<usize> {
        let norms = self.norms().map(|p| p.index);
        norms
            .into_iter()
            .chain(self.linears().into_iter().flat_map(Linear::indices))
            .collect()
    }
}

/// What one layer's backward reads, kept by the forward (all (tokens, ..) in the compute dtype
/// but the LSE).
struct LayerActivations {
    /// The residual stream into the layer, and its norm (the q/k/v projection's input).
    x_in: Tensor,
    h1: Tensor,
    /// Attention's inputs, (batch, seq, heads, head_dim): q and k after RoPE; its output and LSE.
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    /// The stream after the attention sub-block, and its norm (the MLP's input).
    x_mid: Tensor,
    h2: Tensor,
    /// The gate/up projection (gate then up in each row) and silu(gate) · up.
    gate_up: Tensor,
    act: Tensor,
}

/// One micro-batch's token ids, uploaded before any of its kernels are queued: `batch`
/// sequences of `seq` tokens, the inputs with the embedding backward's index, and the targets.
pub(crate) struct MicroBatch {
    inputs: TokenIndex,
    targets: Tensor,
    batch: usize,
    seq: usize,
}

impl MicroBatch {
    pub(crate) fn new(
        inputs: &[u32],
        targets: &[u32],
        batch: usize,
        seq: usize,
        vocab: usize,
        device: &Device,
    ) -> Result<Self> {
        if inputs.len() != batch * seq || targets.len() != batch * seq {
            candle_core::bail!(
                "internal error: {} inputs and {} targets for {batch} × {seq} tokens",
                inputs.len(),
                targets.len()
            )
        }
        Ok(Self {
            inputs: TokenIndex::new(inputs, vocab, device)?,
            targets: Tensor::new(targets, device)?,
            batch,
            seq,
        })
    }
}

/// What the forward keeps of a layer for the backward.
enum Saved {
    All(LayerActivations),
    /// Activation checkpointing: the input stream only; the backward runs the layer's forward
    /// again from it.
    Input(Tensor),
}

/// The model's weights by role, in the compute dtype, for one optimizer step.
pub(crate) struct ExplicitModel {
    embed: Param,
    layers: Vec<LayerParams>,
    norm: Param,
    /// The output head: its own weight, or the embedding matrix (tied).
    head: Linear,
    /// RoPE's cos and sin of every token of a micro-batch, (batch · seq, head_dim / 2).
    cos: Tensor,
    sin: Tensor,
    attn: FlashAttn,
    /// Keep only each layer's input through the forward and recompute the rest in the backward
    /// (activation checkpointing): activation memory of one layer plus a stream per layer.
    checkpoint_activations: bool,
    /// The LM head's chunks: at most this many bytes of logits ([`HEAD_CHUNK_BYTES`]).
    head_chunk_bytes: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    eps: f64,
    rope_interleaved: bool,
    dtype: DType,
}

impl ExplicitModel {
    /// Whether the explicit backward covers models of `cfg`.
    pub(crate) fn supports(cfg: &Config) -> bool {
        !cfg.attention_bias && !cfg.qk_norm
    }

    /// The weights named `names` (HF names, as [`crate::train::parameter_shapes`] lists them),
    /// whose f32 masters are `vars`, cast to `dtype`, for micro-batches of `batch` sequences of
    /// `seq` tokens. Everything a step uploads is uploaded here, at its start (an upload waits
    /// for the GPU's queue to drain).
    pub(crate) fn new(
        cfg: &Config,
        names: &[String],
        vars: &[Var],
        dtype: DType,
        (batch, seq): (usize, usize),
        checkpoint_activations: bool,
    ) -> Result<Self> {
        if !Self::supports(cfg) {
            candle_core::bail!("internal error: the explicit backward does not cover biases or q/k norms")
        }
        let index = |name: &str| -> Result<usize> {
            match names.iter().position(|n| n == name) {
                Some(i) => Ok(i),
                None => candle_core::bail!("internal error: the trainer has no weight `{name}`"),
            }
        };
        let cast = |i: usize| vars[i].as_tensor().detach().to_dtype(dtype);
        let param = |name: &str| -> Result<Param> {
            let index = index(name)?;
            Ok(Param {
                index,
                value: cast(index)?,
            })
        };
        let linear = |names: &[String]| -> Result<Linear> {
            let indices = names.iter().map(|n| index(n)).collect::<Result<Vec<_>>>()?;
            let values = indices.iter().map(|&i| cast(i)).collect::<Result<Vec<_>>>()?;
            let parts = indices
                .iter()
                .zip(&values)
                .map(|(&i, v)| Ok((i, v.dim(0)?)))
                .collect::<Result<_>>()?;
            let value = match values.len() {
                1 => values[0].clone(),
                _ => Tensor::cat(&values, 0)?,
            };
            Ok(Linear { value, parts })
        };
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let name = |n: &str| format!("model.layers.{i}.{n}.weight");
                Ok(LayerParams {
                    attn_norm: param(&name("input_layernorm"))?,
                    qkv: linear(&[
                        name("self_attn.q_proj"),
                        name("self_attn.k_proj"),
                        name("self_attn.v_proj"),
                    ])?,
                    o: linear(&[name("self_attn.o_proj")])?,
                    mlp_norm: param(&name("post_attention_layernorm"))?,
                    gate_up: linear(&[name("mlp.gate_proj"), name("mlp.up_proj")])?,
                    down: linear(&[name("mlp.down_proj")])?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed = param("model.embed_tokens.weight")?;
        let head = match cfg.tie_word_embeddings {
            true => Linear {
                value: embed.value.clone(),
                parts: vec![(embed.index, cfg.vocab_size)],
            },
            false => linear(&["lm_head.weight".to_string()])?,
        };
        let device = embed.value.device().clone();
        // As the model's attention: causal, and a window of w sees itself and w - 1 keys back.
        let mut attn = FlashAttn::new(1.0 / (cfg.head_dim as f32).sqrt()).causal(true);
        if let Some(w) = cfg.sliding_window {
            attn = attn.window(Some(w.saturating_sub(1)), Some(0));
        }
        let positions = Tensor::arange(0, seq as u32, &device)?.repeat(batch)?;
        let (cos, sin) = rope_angles(&positions, &Tensor::new(cfg.rope_inv_freq(), &device)?)?;
        Ok(Self {
            embed,
            layers,
            norm: param("model.norm.weight")?,
            head,
            cos: cos.to_dtype(dtype)?,
            sin: sin.to_dtype(dtype)?,
            attn,
            checkpoint_activations,
            head_chunk_bytes: HEAD_CHUNK_BYTES,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            eps: cfg.rms_norm_eps,
            rope_interleaved: cfg.rope_interleaved,
            dtype,
        })
    }

    /// Where each master variable's compute-dtype copy lives, by the variable's index: the
    /// tensor (a weight, or the stacked weight it is a part of) and the element offset of its
    /// rows there. The optimizer writes these copies with the masters (GPU, 16-bit compute
    /// dtypes), so that the model serves the next step without casting again; `None` where the
    /// model has no copy of its own (an f32 compute dtype shares the masters' storage).
    pub(crate) fn weight_copies(&self, vars: usize) -> Result<Vec<Option<(&Tensor, usize)>>> {
        let mut copies: Vec<Option<(&Tensor, usize)>> = vec![None; vars];
        if !matches!(self.dtype, DType::BF16 | DType::F16) {
            return Ok(copies);
        }
        // (variable, tensor, offset) of every part of every matmul weight, then of the vectors.
        let mut entries: Vec<(usize, &Tensor, usize)> = Vec::new();
        // A tied head is the embedding's tensor: one copy.
        let head_tied = self.head.parts.iter().any(|&(i, _)| i == self.embed.index);
        let linears = self
            .layers
            .iter()
            .flat_map(LayerParams::linears)
            .chain((!head_tied).then_some(&self.head));
        for l in linears {
            let columns = l.value.dim(1)?;
            let mut row = 0;
            for &(index, rows) in &l.parts {
                entries.push((index, &l.value, row * columns));
                row += rows;
            }
        }
        let vectors = self.layers.iter().flat_map(LayerParams::norms);
        for p in vectors.chain([&self.norm, &self.embed]) {
            entries.push((p.index, &p.value, 0));
        }
        for (index, tensor, offset) in entries {
            match copies.get(index) {
                Some(None) => copies[index] = Some((tensor, offset)),
                _ => candle_core::bail!("internal error: weight {index} has two compute copies or none"),
            }
        }
        if copies.iter().any(Option::is_none) {
            candle_core::bail!("internal error: a weight without a compute copy")
        }
        Ok(copies)
    }

    /// The LM head on the final norm's output `xf` (tokens, hidden), the mean cross-entropy
    /// against `targets` ((tokens,) u32) times `scale` (an f32 scalar on the device), and the
    /// backward to `xf`: the head's weight gradient added to its accumulator in `grads`, and
    /// `xf`'s gradient returned. Over chunks of tokens ([`HEAD_CHUNK_BYTES`]): each chunk's
    /// logits (compute dtype), their logsumexp in f32 and their gradient written in the compute
    /// dtype, as the whole-batch f32 cross-entropy would round it.
    fn head_loss_backward(
        &self,
        xf: &Tensor,
        targets: &Tensor,
        scale: f64,
        grads: &mut [Option<Tensor>],
    ) -> Result<(Tensor, Tensor)> {
        let tokens = xf.dim(0)?;
        let vocab = self.head.value.dim(0)?;
        let chunk = (self.head_chunk_bytes / (vocab * self.dtype.size_in_bytes()).max(1)).clamp(1, tokens.max(1));
        let mut loss_sum: Option<Tensor> = None;
        let mut dxf = Vec::with_capacity(tokens.div_ceil(chunk));
        for start in (0..tokens).step_by(chunk) {
            let rows = chunk.min(tokens - start);
            let (x, t) = (xf.narrow(0, start, rows)?, targets.narrow(0, start, rows)?);
            let logits = self.head.forward(&x)?;
            let stats = cross_entropy_logsumexp(&logits, &t)?;
            let lse = stats.narrow(1, 0, 1)?.squeeze(1)?;
            // Σ (logsumexp − target logit) over the chunk's rows.
            let sum = (lse.sum_all()? - stats.narrow(1, 1, 1)?.sum_all()?)?;
            loss_sum = Some(match loss_sum.take() {
                None => sum,
                Some(s) => (s + sum)?,
            });
            let dlogits = cross_entropy_backward(&logits, &t, &lse, scale / tokens as f64)?;
            dxf.push(self.head.backward(&x, &dlogits, grads)?);
        }
        let loss = match loss_sum {
            Some(sum) => (sum * (scale / tokens as f64))?,
            None => Tensor::zeros((), DType::F32, xf.device())?,
        };
        let dxf = match dxf.len() {
            1 => dxf.pop().expect("one chunk"),
            _ => Tensor::cat(&dxf, 0)?,
        };
        Ok((loss, dxf))
    }

    /// One layer's forward from its input stream `x_in` and its norm `h1`: the activations its
    /// backward reads, and the MLP's output (not yet added to the stream).
    fn layer_forward(
        &self,
        l: &LayerParams,
        x_in: Tensor,
        h1: Tensor,
        (batch, seq): (usize, usize),
    ) -> Result<(LayerActivations, Tensor)> {
        let (h, hk, d) = (self.heads, self.kv_heads, self.head_dim);
        let tokens = batch * seq;
        let il = self.rope_interleaved;
        let (q, k, v) = rope_unpack(&l.qkv.forward(&h1)?, [h, hk, hk], d, &self.cos, &self.sin, il)?;
        let (q, k, v) = (
            q.reshape((batch, seq, h, d))?,
            k.reshape((batch, seq, hk, d))?,
            v.reshape((batch, seq, hk, d))?,
        );
        let (out, lse) = self.attn.forward_with_lse(&q, &k, &v)?;
        let o = l.o.forward(&out.reshape((tokens, h * d))?)?;
        let (x_mid, h2) = rms_norm_add(&x_in, &o, &l.mlp_norm.value, self.eps)?;
        let gate_up = l.gate_up.forward(&h2)?;
        let act = swiglu_packed(&gate_up)?;
        let down = l.down.forward(&act)?;
        let a = LayerActivations {
            x_in,
            h1,
            q,
            k,
            v,
            out,
            lse,
            x_mid,
            h2,
            gate_up,
            act,
        };
        Ok((a, down))
    }

    /// The mean cross-entropy of `mb` times `loss_scale`, returned as an f32 scalar on the
    /// device; its gradient with respect to each master variable is added to that variable's f32
    /// accumulator in `grads` (in the trainer's order; `None` is zero). `finished` receives each
    /// group of gradients as the backward completes it (every index once per call).
    pub(crate) fn accumulate(
        &self,
        mb: &MicroBatch,
        loss_scale: f64,
        grads: &mut [Option<Tensor>],
        finished: FinishedGrads,
    ) -> Result<Tensor> {
        let (batch, seq) = (mb.batch, mb.seq);
        let tokens = batch * seq;
        if self.cos.dim(0)? != tokens {
            candle_core::bail!(
                "internal error: a micro-batch of {tokens} tokens for a model prepared for {}",
                self.cos.dim(0)?
            )
        }
        let (h, d) = (self.heads, self.head_dim);
        let (x0, embedding) = mb.inputs.embed(&self.embed.value)?;
        let (cos, sin) = (&self.cos, &self.sin);
        let il = self.rope_interleaved;

        // Forward, keeping each layer's activations (or, checkpointing, only its input). Each
        // sub-block's output joins the residual stream inside the next norm's launch
        // (`rms_norm_add`).
        let mut stream = (x0, None::<Tensor>);
        let mut saved = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let (x_in, h1) = match stream {
                (x, None) => {
                    let h1 = rms_norm(&x, &l.attn_norm.value, self.eps)?;
                    (x, h1)
                }
                (x, Some(sub)) => rms_norm_add(&x, &sub, &l.attn_norm.value, self.eps)?,
            };
            let (a, down) = self.layer_forward(l, x_in, h1, (batch, seq))?;
            stream = (a.x_mid.clone(), Some(down));
            saved.push(match self.checkpoint_activations {
                true => Saved::Input(a.x_in),
                false => Saved::All(a),
            });
        }
        let (x_last, xf) = match stream {
            (x, None) => {
                let xf = rms_norm(&x, &self.norm.value, self.eps)?;
                (x, xf)
            }
            (x, Some(sub)) => rms_norm_add(&x, &sub, &self.norm.value, self.eps)?,
        };
        // The head, the loss and their backward, a chunk of tokens at a time.
        let (loss, dxf) = self.head_loss_backward(&xf, &mb.targets, loss_scale, grads)?;

        // Backward. `dx` is the gradient of the residual stream after the layer in hand, which
        // reaches both the layer's last sub-block output and the stream before it.
        let (mut dx, dw) = rms_norm_backward(&x_last, &self.norm.value, &dxf, self.eps, None)?;
        add_grad(grads, self.norm.index, &dw)?;
        // A tied head's gradient is the embedding's, which the embedding's backward completes.
        let head: Vec<usize> = std::iter::once(self.norm.index)
            .chain(self.head.indices().filter(|&i| i != self.embed.index))
            .collect();
        finished(&head, grads)?;
        for (l, a) in self.layers.iter().zip(saved).rev() {
            let a = match a {
                Saved::All(a) => a,
                // The layer's forward again from its input: the same kernels on the same
                // values, so the same activations bit for bit (x_in is the rounded sum whose
                // norm the forward took).
                Saved::Input(x_in) => {
                    let h1 = rms_norm(&x_in, &l.attn_norm.value, self.eps)?;
                    self.layer_forward(l, x_in, h1, (batch, seq))?.0
                }
            };
            // MLP: x_out = x_mid + down(silu(gate(h2)) · up(h2)), h2 = norm(x_mid).
            let dact = l.down.backward(&a.act, &dx, grads)?;
            let dgate_up = swiglu_packed_backward(&a.gate_up, &dact)?;
            let dh2 = l.gate_up.backward(&a.h2, &dgate_up, grads)?;
            let (dx_mid, dw) = rms_norm_backward(&a.x_mid, &l.mlp_norm.value, &dh2, self.eps, Some(&dx))?;
            add_grad(grads, l.mlp_norm.index, &dw)?;

            // Attention: x_mid = x_in + o(attention(rope(q), rope(k), v)), [q k v] = qkv(h1),
            // h1 = norm(x_in).
            let dout = l.o.backward(&a.out.reshape((tokens, h * d))?, &dx_mid, grads)?;
            let dout = dout.reshape((batch, seq, h, d))?;
            let (dq, dk, dv) = self.attn.backward(&a.q, &a.k, &a.v, &a.out, &a.lse, &dout)?;
            let dqkv = rope_pack_backward(&dq, &dk, &dv, cos, sin, il)?;
            let dh1 = l.qkv.backward(&a.h1, &dqkv, grads)?;
            let (dx_in, dw) = rms_norm_backward(&a.x_in, &l.attn_norm.value, &dh1, self.eps, Some(&dx_mid))?;
            add_grad(grads, l.attn_norm.index, &dw)?;
            dx = dx_in;
            finished(&l.indices(), grads)?;
        }
        add_grad(grads, self.embed.index, &embedding.backward(&dx)?)?;
        finished(&[self.embed.index], grads)?;
        Ok(loss)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::{data::Rng, llama_config, parameter_shapes};

    /// The LM head and loss over chunks of tokens (here 7 rows a chunk, the last one partial)
    /// give the loss and every gradient of the whole micro-batch in one chunk (f32 on the CPU:
    /// the same values up to the order of the f32 sums), with a tied and an untied head.
    #[test]
    fn head_chunks_give_the_whole_batch_gradients() -> Result<()> {
        let dev = Device::Cpu;
        for tied in [false, true] {
            let mut cfg = llama_config(300, 64, 96, 2, 4, 2, 64);
            cfg.tie_word_embeddings = tied;
            let mut rng = Rng(3);
            let (names, vars): (Vec<String>, Vec<Var>) = parameter_shapes(&cfg)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?
                .into_iter()
                .map(|(name, shape)| {
                    let v = Tensor::from_vec(rng.normals(shape.elem_count(), 0.1), shape, &dev)?;
                    Ok((name, Var::from_tensor(&v)?))
                })
                .collect::<Result<Vec<_>>>()?
                .into_iter()
                .unzip();
            let (batch, seq) = (2, 24);
            let ids: Vec<u32> = (0..=batch * seq).map(|_| rng.below(300) as u32).collect();
            let mb = MicroBatch::new(&ids[..batch * seq], &ids[1..], batch, seq, 300, &dev)?;
            let mut model = ExplicitModel::new(&cfg, &names, &vars, DType::F32, (batch, seq), false)?;
            let mut run = |chunk_bytes: usize| -> Result<(f32, Vec<Vec<f32>>)> {
                model.head_chunk_bytes = chunk_bytes;
                let mut grads = vec![None; vars.len()];
                let loss = model.accumulate(&mb, 0.5, &mut grads, &mut |_, _| Ok(()))?;
                let grads = grads
                    .into_iter()
                    .map(|g| g.expect("every weight has a gradient").flatten_all()?.to_vec1::<f32>())
                    .collect::<Result<_>>()?;
                Ok((loss.to_scalar::<f32>()?, grads))
            };
            let (loss_whole, whole) = run(HEAD_CHUNK_BYTES)?;
            let (loss_chunked, chunked) = run(7 * 300 * 4)?;
            assert!(
                (loss_whole - loss_chunked).abs() <= 1e-6 * loss_whole.abs(),
                "tied {tied}: loss {loss_chunked} in chunks, {loss_whole} whole"
            );
            for (i, (a, b)) in chunked.iter().zip(&whole).enumerate() {
                let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
                let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                assert!(
                    scale > 0.0 && diff <= 1e-5 * scale,
                    "tied {tied}, {}: gradients differ by {diff} (max {scale})",
                    names[i]
                );
            }
        }
        Ok(())
    }
}
