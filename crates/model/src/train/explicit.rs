//! A micro-batch's loss and gradients with the decoder's backward written out, without candle's
//! autograd ([`crate::train::Backward::Explicit`], the trainer's default).
//!
//! `loss.backward()` through [`crate::Llama::forward`] gives every tensor of the graph a fresh
//! zeros tensor and adds each contribution into it, even the first and only one: a memset and an
//! add the size of every activation, about 40% of the GPU time of a 125m micro-batch
//! (docs/benchmarks-history.md, "Training, GPU"). Here the forward keeps what the backward needs
//! ([`LayerActivations`]), and the backward runs the kernels autograd would (the matmuls,
//! flash-attn3's backward, the backward kernels of [`crate::train_ops`]), each gradient computed
//! once where it is produced; the only adds left are the residual stream's two per layer.
//!
//! The arithmetic is that of the autograd path: the same ops in the same dtypes, the weights cast
//! from the f32 masters to the compute dtype once per step, each weight's gradient cast back to
//! f32. Attention runs in its fixed-length form (every sequence of a micro-batch has the same
//! length), where the model's forward calls the varlen form over the same sequences. The tests
//! compare the two paths' gradients (`crates/model/tests/train.rs`, and on the GPU in bf16).
//!
//! Scope: the decoders the trainer builds (plain Llama blocks: no biases, no q/k norm; sliding
//! windows and GQA are fine). [`ExplicitModel::supports`] says which; the others train through
//! autograd.

use candle_core::{DType, Result, Tensor, Var};
use flash_attn3::FlashAttn;

use crate::config::Config;
use crate::nn::rope_angles;
use crate::train_ops::{
    embedding_with_backward, rms_norm, rms_norm_backward, rope, rope_backward, swiglu, swiglu_backward,
};

/// One trainable weight: its index among the trainer's master variables and its value in the
/// compute dtype (detached: nothing records a graph through it).
struct Param {
    index: usize,
    value: Tensor,
}

impl Param {
    /// `x · valueᵀ`: the linear layer's forward, x (tokens, in) → (tokens, out).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.matmul(&self.value.t()?)
    }

    /// The linear layer's backward for the gradient `dy` (tokens, out) of its output:
    /// `(index, dyᵀ · x)` for the weight, and `dy · value` for the input.
    fn backward(&self, x: &Tensor, dy: &Tensor) -> Result<((usize, Tensor), Tensor)> {
        Ok(((self.index, dy.t()?.matmul(x)?), dy.matmul(&self.value)?))
    }
}

struct LayerParams {
    attn_norm: Param,
    q: Param,
    k: Param,
    v: Param,
    o: Param,
    mlp_norm: Param,
    gate: Param,
    up: Param,
    down: Param,
}

/// What one layer's backward reads, kept by the forward (all (tokens, ..) in the compute dtype
/// but the LSE).
struct LayerActivations {
    /// The residual stream into the layer, and its norm (the q/k/v projections' input).
    x_in: Tensor,
    h1: Tensor,
    /// Attention's inputs after RoPE, (batch, seq, heads, head_dim), its output and LSE.
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    /// The stream after the attention sub-block, and its norm (the MLP's input).
    x_mid: Tensor,
    h2: Tensor,
    /// The MLP's gate and up projections and silu(gate) · up.
    gate: Tensor,
    up: Tensor,
    act: Tensor,
}

/// The model's weights by role, in the compute dtype, for one optimizer step.
pub(crate) struct ExplicitModel {
    embed: Param,
    layers: Vec<LayerParams>,
    norm: Param,
    /// `None` when the output head is the embedding matrix (tied).
    head: Option<Param>,
    inv_freq: Tensor,
    attn: FlashAttn,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    eps: f64,
    rope_interleaved: bool,
    vocab: usize,
    dtype: DType,
    /// How many master variables the gradients are for.
    params: usize,
}

impl ExplicitModel {
    /// Whether the explicit backward covers models of `cfg`.
    pub(crate) fn supports(cfg: &Config) -> bool {
        !cfg.attention_bias && !cfg.qk_norm
    }

    /// The weights named `names` (HF names, as [`crate::train::parameter_shapes`] lists them),
    /// whose f32 masters are `vars`, cast to `dtype`.
    pub(crate) fn new(cfg: &Config, names: &[String], vars: &[Var], dtype: DType) -> Result<Self> {
        if !Self::supports(cfg) {
            candle_core::bail!("internal error: the explicit backward does not cover biases or q/k norms")
        }
        let param = |name: &str| -> Result<Param> {
            let Some(index) = names.iter().position(|n| n == name) else {
                candle_core::bail!("internal error: the trainer has no weight `{name}`")
            };
            Ok(Param {
                index,
                value: vars[index].as_tensor().detach().to_dtype(dtype)?,
            })
        };
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let p = |name: &str| param(&format!("model.layers.{i}.{name}.weight"));
                Ok(LayerParams {
                    attn_norm: p("input_layernorm")?,
                    q: p("self_attn.q_proj")?,
                    k: p("self_attn.k_proj")?,
                    v: p("self_attn.v_proj")?,
                    o: p("self_attn.o_proj")?,
                    mlp_norm: p("post_attention_layernorm")?,
                    gate: p("mlp.gate_proj")?,
                    up: p("mlp.up_proj")?,
                    down: p("mlp.down_proj")?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed = param("model.embed_tokens.weight")?;
        let device = embed.value.device().clone();
        // As the model's attention: causal, and a window of w sees itself and w - 1 keys back.
        let mut attn = FlashAttn::new(1.0 / (cfg.head_dim as f32).sqrt()).causal(true);
        if let Some(w) = cfg.sliding_window {
            attn = attn.window(Some(w.saturating_sub(1)), Some(0));
        }
        Ok(Self {
            embed,
            layers,
            norm: param("model.norm.weight")?,
            head: match cfg.tie_word_embeddings {
                true => None,
                false => Some(param("lm_head.weight")?),
            },
            inv_freq: Tensor::new(cfg.rope_inv_freq(), &device)?,
            attn,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            eps: cfg.rms_norm_eps,
            rope_interleaved: cfg.rope_interleaved,
            vocab: cfg.vocab_size,
            dtype,
            params: vars.len(),
        })
    }

    /// The mean cross-entropy of `batch` sequences of `seq` tokens (`inputs` → `targets`, both
    /// batch · seq ids) times `loss_scale`, as an f32 scalar on the device, and its gradient with
    /// respect to every master variable (f32, in the trainer's order).
    pub(crate) fn loss_and_grads(
        &self,
        inputs: &[u32],
        targets: &[u32],
        batch: usize,
        seq: usize,
        loss_scale: f64,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let tokens = batch * seq;
        if inputs.len() != tokens || targets.len() != tokens {
            candle_core::bail!(
                "internal error: {} inputs and {} targets for {batch} × {seq} tokens",
                inputs.len(),
                targets.len()
            )
        }
        let (h, hk, d) = (self.heads, self.kv_heads, self.head_dim);
        let device = self.embed.value.device();
        let (x0, embedding) = embedding_with_backward(&self.embed.value, inputs)?;
        let positions = Tensor::arange(0, seq as u32, device)?.repeat(batch)?;
        let (cos, sin) = rope_angles(&positions, &self.inv_freq)?;
        let (cos, sin) = (cos.to_dtype(self.dtype)?, sin.to_dtype(self.dtype)?);

        // Forward, keeping each layer's activations.
        let mut x = x0;
        let mut saved = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let h1 = rms_norm(&x, &l.attn_norm.value, self.eps)?;
            let rotated = |p: &Param, heads: usize| {
                rope(
                    &p.forward(&h1)?.reshape((tokens, heads, d))?,
                    &cos,
                    &sin,
                    self.rope_interleaved,
                )
            };
            let q = rotated(&l.q, h)?.reshape((batch, seq, h, d))?;
            let k = rotated(&l.k, hk)?.reshape((batch, seq, hk, d))?;
            let v = l.v.forward(&h1)?.reshape((batch, seq, hk, d))?;
            let (out, lse) = self.attn.forward_with_lse(&q, &k, &v)?;
            let x_mid = (&x + l.o.forward(&out.reshape((tokens, h * d))?)?)?;
            let h2 = rms_norm(&x_mid, &l.mlp_norm.value, self.eps)?;
            let (gate, up) = (l.gate.forward(&h2)?, l.up.forward(&h2)?);
            let act = swiglu(&gate, &up)?;
            let x_out = (&x_mid + l.down.forward(&act)?)?;
            saved.push(LayerActivations {
                x_in: x,
                h1,
                q,
                k,
                v,
                out,
                lse,
                x_mid,
                h2,
                gate,
                up,
                act,
            });
            x = x_out;
        }
        let xf = rms_norm(&x, &self.norm.value, self.eps)?;
        let head = self.head.as_ref().unwrap_or(&self.embed);
        let logits = head.forward(&xf)?;

        // The loss and its gradient with respect to the logits, in f32: for each row,
        // softmax(logits) minus the target's one-hot, over the rows.
        let (loss, dlogits) = cross_entropy_with_grad(&logits, targets, self.vocab, loss_scale)?;
        let dlogits = dlogits.to_dtype(self.dtype)?;

        // Backward.
        let mut grads: Vec<(usize, Tensor)> = Vec::with_capacity(self.params + 1);
        let (g, dxf) = head.backward(&xf, &dlogits)?;
        grads.push(g);
        let (mut dx, dw) = rms_norm_backward(&x, &self.norm.value, &dxf, self.eps)?;
        grads.push((self.norm.index, dw));
        for (l, a) in self.layers.iter().zip(saved).rev() {
            // MLP: x_out = x_mid + down(silu(gate(h2)) · up(h2)), h2 = norm(x_mid).
            let (g, dact) = l.down.backward(&a.act, &dx)?;
            grads.push(g);
            let (dgate, dup) = swiglu_backward(&a.gate, &a.up, &dact)?;
            let (g, dh2_gate) = l.gate.backward(&a.h2, &dgate)?;
            grads.push(g);
            let (g, dh2_up) = l.up.backward(&a.h2, &dup)?;
            grads.push(g);
            let (dnorm, dw) = rms_norm_backward(&a.x_mid, &l.mlp_norm.value, &(dh2_gate + dh2_up)?, self.eps)?;
            grads.push((l.mlp_norm.index, dw));
            let dx_mid = (dx + dnorm)?;

            // Attention: x_mid = x_in + o(attention(rope(q(h1)), rope(k(h1)), v(h1))), h1 = norm(x_in).
            let (g, dout) = l.o.backward(&a.out.reshape((tokens, h * d))?, &dx_mid)?;
            grads.push(g);
            let dout = dout.reshape((batch, seq, h, d))?;
            let (dq, dk, dv) = self.attn.backward(&a.q, &a.k, &a.v, &a.out, &a.lse, &dout)?;
            let unrotated = |dy: Tensor, heads: usize| -> Result<Tensor> {
                rope_backward(&dy.reshape((tokens, heads, d))?, &cos, &sin, self.rope_interleaved)?
                    .reshape((tokens, heads * d))
            };
            let (g, dh1_q) = l.q.backward(&a.h1, &unrotated(dq, h)?)?;
            grads.push(g);
            let (g, dh1_k) = l.k.backward(&a.h1, &unrotated(dk, hk)?)?;
            grads.push(g);
            let (g, dh1_v) = l.v.backward(&a.h1, &dv.reshape((tokens, hk * d))?)?;
            grads.push(g);
            let dh1 = ((dh1_q + dh1_k)? + dh1_v)?;
            let (dnorm, dw) = rms_norm_backward(&a.x_in, &l.attn_norm.value, &dh1, self.eps)?;
            grads.push((l.attn_norm.index, dw));
            dx = (dx_mid + dnorm)?;
        }
        grads.push((self.embed.index, embedding.backward(&dx)?));

        // Into the masters' order, in f32; a tied head's gradient joins the embedding's.
        let mut by_var: Vec<Option<Tensor>> = vec![None; self.params];
        for (index, g) in grads {
            let g = g.to_dtype(DType::F32)?;
            by_var[index] = Some(match by_var[index].take() {
                None => g,
                Some(sum) => (sum + g)?,
            });
        }
        let grads = by_var
            .into_iter()
            .enumerate()
            .map(|(i, g)| {
                g.ok_or_else(|| candle_core::Error::Msg(format!("internal error: no gradient for weight {i}")))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((loss, grads))
    }
}

/// The mean over the rows of `logits` (tokens, vocab) of the cross-entropy against `targets`,
/// times `scale`, as an f32 scalar, and its gradient with respect to the logits (f32, same
/// shape): `scale / tokens · (softmax(row) − one_hot(target))`. The same operations as
/// [`crate::train::cross_entropy`] for the loss.
fn cross_entropy_with_grad(logits: &Tensor, targets: &[u32], vocab: usize, scale: f64) -> Result<(Tensor, Tensor)> {
    let device = logits.device();
    let tokens = targets.len();
    let logits = logits.to_dtype(DType::F32)?;
    let targets = Tensor::new(targets, device)?.unsqueeze(1)?;
    let shifted = logits.broadcast_sub(&logits.max_keepdim(1)?)?;
    let exp = shifted.exp()?;
    let sum = exp.sum_keepdim(1)?;
    let picked = shifted.gather(&targets, 1)?;
    let loss = ((sum.log()? - picked)?.mean_all()? * scale)?;
    let one_hot = targets
        .broadcast_eq(&Tensor::arange(0, vocab as u32, device)?.unsqueeze(0)?)?
        .to_dtype(DType::F32)?;
    let dlogits = ((exp.broadcast_div(&sum)? - one_hot)? * (scale / tokens as f64))?;
    Ok((loss, dlogits))
}
