//! Tensor parallelism (Megatron-style) for inference: each rank holds a slice of every layer and
//! the ranks sum their partial outputs twice per layer.
//!
//! - Attention: rank r keeps heads `r·h/N ..` of q and kv heads `r·hk/N ..` of k and v (the
//!   rows of q_proj, k_proj, v_proj: column-parallel), and the matching columns of o_proj
//!   (row-parallel), so its o_proj output is a partial sum over its heads.
//! - MLP: the rows `r·i/N ..` of gate_proj and up_proj and the matching columns of down_proj.
//! - Embedding, norms and the output head are replicated. After the all-reduce of each
//!   sub-block's output every rank holds the same residual stream, hence the same logits, and
//!   samples the same tokens with the same seed: no broadcast is needed.
//!
//! A rank's model is an ordinary [`Llama`](crate::Llama) built from a *shard config* (the heads
//! and MLP width divided by N, [`shard_config`]) and a `VarBuilder` that cuts each sliced weight
//! out of the full one as it is read ([`sharded_var_builder`]); the layer loop adds the two
//! all-reduces. Nothing else in the model knows about the split.

use candle_core::{bail, DType, Device, Result, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;

use crate::config::Config;

/// The config of one rank's shard of `cfg` over `world` ranks: heads, kv heads and the MLP width
/// divided by `world` (head_dim and everything else unchanged). Errors unless all three divide.
pub fn shard_config(cfg: &Config, world: usize) -> Result<Config> {
    if world == 0 {
        bail!("tensor parallelism over 0 ranks")
    }
    for (what, n) in [
        ("attention heads", cfg.num_attention_heads),
        ("key/value heads", cfg.num_key_value_heads),
        ("MLP width (intermediate_size)", cfg.intermediate_size),
    ] {
        if n % world != 0 {
            bail!("tensor parallelism over {world} ranks needs a multiple of {world} {what}; this model has {n}")
        }
    }
    Ok(Config {
        num_attention_heads: cfg.num_attention_heads / world,
        num_key_value_heads: cfg.num_key_value_heads / world,
        intermediate_size: cfg.intermediate_size / world,
        ..cfg.clone()
    })
}

/// Which dimension of the tensor `name` (an HF name) is split across ranks: 0 for the output
/// rows of the column-parallel projections (weights and biases), 1 for the input columns of
/// the row-parallel ones, `None` for replicated tensors.
fn split_dim(name: &str) -> Option<usize> {
    const COLUMN_PARALLEL: [&str; 5] = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"];
    const ROW_PARALLEL: [&str; 2] = ["o_proj", "down_proj"];
    let mut parts = name.rsplit('.');
    let (param, module) = (parts.next()?, parts.next()?);
    if COLUMN_PARALLEL.contains(&module) {
        return Some(0);
    }
    (ROW_PARALLEL.contains(&module) && param == "weight").then_some(1)
}

/// A `VarBuilder` on `device` over `full` (the whole model's tensors, best on the CPU: a
/// memory map) that hands out rank `rank`'s slice of each split tensor ([`split_dim`]) when
/// asked for the shard shape, and replicated tensors whole. Slices are cut where `full` lives
/// and only they are copied to `device`.
pub fn sharded_var_builder<'a>(full: VarBuilder<'a>, rank: usize, world: usize, device: &Device) -> VarBuilder<'a> {
    let dtype = full.dtype();
    VarBuilder::from_backend(Box::new(ShardedBackend { full, rank, world }), dtype, device.clone())
}

struct ShardedBackend<'a> {
    full: VarBuilder<'a>,
    rank: usize,
    world: usize,
}

impl SimpleBackend for ShardedBackend<'_> {
    fn get(&self, s: Shape, name: &str, h: candle_nn::Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        let Some(dim) = split_dim(name) else {
            return self.full.get_with_hints_dtype(s, name, h, dtype)?.to_device(dev);
        };
        if dim >= s.rank() {
            bail!("tensor-parallel load: `{name}` of shape {s:?} has no dimension {dim} to split")
        }
        let mut full_dims = s.dims().to_vec();
        let part = full_dims[dim];
        full_dims[dim] *= self.world;
        let t = self.full.get_with_hints_dtype(full_dims, name, h, dtype)?;
        t.narrow(dim, self.rank * part, part)?.contiguous()?.to_device(dev)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        if split_dim(name).is_some() {
            bail!("tensor-parallel load: `{name}` is split across ranks and needs its shard's shape")
        }
        self.full.get_unchecked_dtype(name, dtype)?.to_device(dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.full.contains_tensor(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_dims_follow_megatron() {
        assert_eq!(split_dim("model.layers.3.self_attn.q_proj.weight"), Some(0));
        assert_eq!(split_dim("model.layers.3.self_attn.k_proj.bias"), Some(0));
        assert_eq!(split_dim("model.layers.0.mlp.up_proj.weight"), Some(0));
        assert_eq!(split_dim("model.layers.0.self_attn.o_proj.weight"), Some(1));
        assert_eq!(split_dim("model.layers.0.mlp.down_proj.weight"), Some(1));
        assert_eq!(split_dim("model.layers.0.input_layernorm.weight"), None);
        assert_eq!(split_dim("model.layers.0.self_attn.q_norm.weight"), None);
        assert_eq!(split_dim("model.embed_tokens.weight"), None);
        assert_eq!(split_dim("lm_head.weight"), None);
    }
}
