//! Tiny random-weight models written to disk the way real ones are shipped: an HF directory
//! (config.json + model.safetensors) and a llama.cpp-style GGUF file.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};

pub mod sampling;

pub const VOCAB: usize = 64;
pub const HIDDEN: usize = 32;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
pub const HEAD_DIM: usize = 8;
pub const INTER: usize = 48;
pub const LAYERS: usize = 2;

/// Which family the tiny model imitates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Family {
    Llama,
    /// Tied embeddings and llama3 RoPE scaling (Llama 3.2 style).
    Llama32,
    /// Sliding window of 4 keys.
    Mistral,
    /// q/k/v biases.
    Qwen2,
    /// q/k RMSNorm.
    Qwen3,
    /// Llama with heads of 64 dims (the smallest head dim of the fp8 KV-cache kernels; the other
    /// families' heads have 8). Not in [`Family::ALL`].
    WideHeads,
}

impl Family {
    pub const ALL: [Family; 5] = [
        Family::Llama,
        Family::Llama32,
        Family::Mistral,
        Family::Qwen2,
        Family::Qwen3,
    ];

    pub fn config_json(self) -> String {
        let (model_type, extra) = match self {
            Family::Llama => ("llama", String::new()),
            Family::Llama32 => (
                "llama",
                r#", "tie_word_embeddings": true, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                   "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}"#
                    .to_string(),
            ),
            Family::Mistral => ("mistral", r#", "sliding_window": 4"#.to_string()),
            Family::Qwen2 => ("qwen2", r#", "tie_word_embeddings": true"#.to_string()),
            Family::Qwen3 => ("qwen3", r#", "head_dim": 8, "attention_bias": false"#.to_string()),
            Family::WideHeads => ("llama", format!(r#", "head_dim": {}"#, self.head_dim())),
        };
        format!(
            r#"{{"model_type": "{model_type}", "vocab_size": {VOCAB}, "hidden_size": {HIDDEN},
               "intermediate_size": {INTER}, "num_hidden_layers": {LAYERS}, "num_attention_heads": {HEADS},
               "num_key_value_heads": {KV_HEADS}, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
               "max_position_embeddings": 128, "bos_token_id": 1, "eos_token_id": 2{extra}}}"#
        )
    }

    pub fn head_dim(self) -> usize {
        match self {
            Family::WideHeads => 64,
            _ => HEAD_DIM,
        }
    }

    fn tied(self) -> bool {
        matches!(self, Family::Llama32 | Family::Qwen2)
    }
}

/// Deterministic pseudo-random values in [-scale, scale) (the same weights on every run).
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// HF-named random weights of a tiny model of `family`.
pub fn weights(family: Family) -> HashMap<String, Tensor> {
    let dev = Device::Cpu;
    let mut seed = 0;
    let mut t = |shape: &[usize], scale: f32| {
        seed += 1;
        Tensor::from_vec(values(shape.iter().product(), seed, scale), shape, &dev).unwrap()
    };
    let mut w = HashMap::new();
    w.insert("model.embed_tokens.weight".to_string(), t(&[VOCAB, HIDDEN], 1.0));
    w.insert("model.norm.weight".to_string(), (t(&[HIDDEN], 0.2) + 1.0).unwrap());
    if !family.tied() {
        w.insert("lm_head.weight".to_string(), t(&[VOCAB, HIDDEN], 0.3));
    }
    let proj = 0.35;
    let head_dim = family.head_dim();
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        let mut put = |name: &str, tensor: Tensor| {
            w.insert(format!("{p}.{name}"), tensor);
        };
        put("input_layernorm.weight", (t(&[HIDDEN], 0.2) + 1.0).unwrap());
        put("post_attention_layernorm.weight", (t(&[HIDDEN], 0.2) + 1.0).unwrap());
        put("self_attn.q_proj.weight", t(&[HEADS * head_dim, HIDDEN], proj));
        put("self_attn.k_proj.weight", t(&[KV_HEADS * head_dim, HIDDEN], proj));
        put("self_attn.v_proj.weight", t(&[KV_HEADS * head_dim, HIDDEN], proj));
        put("self_attn.o_proj.weight", t(&[HIDDEN, HEADS * head_dim], proj));
        put("mlp.gate_proj.weight", t(&[INTER, HIDDEN], proj));
        put("mlp.up_proj.weight", t(&[INTER, HIDDEN], proj));
        put("mlp.down_proj.weight", t(&[HIDDEN, INTER], proj));
        if family == Family::Qwen2 {
            put("self_attn.q_proj.bias", t(&[HEADS * head_dim], 0.2));
            put("self_attn.k_proj.bias", t(&[KV_HEADS * head_dim], 0.2));
            put("self_attn.v_proj.bias", t(&[KV_HEADS * head_dim], 0.2));
        }
        if family == Family::Qwen3 {
            put("self_attn.q_norm.weight", (t(&[head_dim], 0.2) + 1.0).unwrap());
            put("self_attn.k_norm.weight", (t(&[head_dim], 0.2) + 1.0).unwrap());
        }
    }
    w
}

/// A fresh empty directory under the system temp dir, removed when dropped.
pub struct TempDir(PathBuf);

impl std::ops::Deref for TempDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn temp_dir(tag: &str) -> TempDir {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, Ordering::SeqCst);
    let dir = std::env::temp_dir().join(format!("flash-llama-test-{}-{tag}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    TempDir(dir)
}

/// Writes `config_json` and `weights` as an HF model directory.
pub fn write_hf_dir(dir: &Path, config_json: &str, weights: &HashMap<String, Tensor>) {
    std::fs::write(dir.join("config.json"), config_json).unwrap();
    candle_core::safetensors::save(weights, dir.join("model.safetensors")).unwrap();
}

/// A tiny model of `family` as an HF directory.
pub fn hf_model(family: Family) -> TempDir {
    let dir = temp_dir(&format!("{family:?}"));
    write_hf_dir(&dir, &family.config_json(), &weights(family));
    dir
}

/// llama.cpp's converter permutes the rows of q/k so that RoPE rotates adjacent pairs:
/// (heads, 2, d/2, in) → (heads, d/2, 2, in).
fn llama_cpp_permute(w: &Tensor, heads: usize) -> Tensor {
    let (out, inp) = w.dims2().unwrap();
    w.reshape((heads, 2, out / heads / 2, inp))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .reshape((out, inp))
        .unwrap()
}

/// The plain Llama tiny model as a GGUF file with llama.cpp's names and q/k layout, so that it
/// must give the same logits as `hf_model(Family::Llama)`.
pub fn write_gguf(path: &Path) {
    let w = weights(Family::Llama);
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut add = |name: String, t: &Tensor| tensors.push((name, QTensor::quantize(t, GgmlDType::F32).unwrap()));
    add("token_embd.weight".into(), &w["model.embed_tokens.weight"]);
    add("output_norm.weight".into(), &w["model.norm.weight"]);
    add("output.weight".into(), &w["lm_head.weight"]);
    for l in 0..LAYERS {
        let hf = |n: &str| w[&format!("model.layers.{l}.{n}")].clone();
        let g = |n: &str| format!("blk.{l}.{n}.weight");
        add(g("attn_q"), &llama_cpp_permute(&hf("self_attn.q_proj.weight"), HEADS));
        add(
            g("attn_k"),
            &llama_cpp_permute(&hf("self_attn.k_proj.weight"), KV_HEADS),
        );
        add(g("attn_v"), &hf("self_attn.v_proj.weight"));
        add(g("attn_output"), &hf("self_attn.o_proj.weight"));
        add(g("ffn_gate"), &hf("mlp.gate_proj.weight"));
        add(g("ffn_up"), &hf("mlp.up_proj.weight"));
        add(g("ffn_down"), &hf("mlp.down_proj.weight"));
        add(g("attn_norm"), &hf("input_layernorm.weight"));
        add(g("ffn_norm"), &hf("post_attention_layernorm.weight"));
    }
    use gguf_file::Value;
    let metadata = [
        ("general.architecture", Value::String("llama".into())),
        ("llama.block_count", Value::U32(LAYERS as u32)),
        ("llama.context_length", Value::U32(128)),
        ("llama.embedding_length", Value::U32(HIDDEN as u32)),
        ("llama.feed_forward_length", Value::U32(INTER as u32)),
        ("llama.attention.head_count", Value::U32(HEADS as u32)),
        ("llama.attention.head_count_kv", Value::U32(KV_HEADS as u32)),
        ("llama.rope.freq_base", Value::F32(10000.0)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ("tokenizer.ggml.eos_token_id", Value::U32(2)),
    ];
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut file = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut file, &md, &ts).unwrap();
}

/// The largest absolute value of an f32 tensor.
pub fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// The largest absolute difference between two tensors of one shape.
pub fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    max_abs(&(a - b).unwrap())
}

/// Largest |a - b| over the largest |b|, both compared in f32 on b's device: the error relative
/// to the reference's own size (gradients far below 1, where [`rel_diff`] would measure
/// absolute differences). A reference of zeros gives NaN, which fails every bound.
pub fn diff_over_max(a: &Tensor, b: &Tensor) -> f32 {
    let b = b.to_dtype(DType::F32).unwrap();
    let a = a.to_device(b.device()).unwrap().to_dtype(DType::F32).unwrap();
    match max_abs(&b) {
        0.0 => f32::NAN,
        scale => max_diff(&a, &b) / scale,
    }
}

/// Largest |a - b| over the largest |b| (at least 1), both compared in f32.
pub fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    let (a, b) = (a.to_dtype(DType::F32).unwrap(), b.to_dtype(DType::F32).unwrap());
    let max_abs_b = max_abs(&b);
    max_diff(&a, &b) / max_abs_b.max(1.0)
}

/// The sum of |t| over all elements (f32 tensors): 0 exactly for an all-zero row.
pub fn abs_sum(t: &Tensor) -> f32 {
    t.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap()
}

/// `n` token ids inside the tiny models' vocabulary, a different run for each `salt`.
pub fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7 + salt * 13 + 3) % VOCAB as u32).collect()
}

/// The steps of a batch of 4 that every KV-cache check runs: a prefill of prompts of different
/// lengths (the third of `long` tokens), a decode step, mixed token counts with a sequence
/// sitting out, one sequence alone, and a decode step.
pub fn mixed_steps(long: usize) -> Vec<Vec<Vec<u32>>> {
    vec![
        vec![tokens(5, 1), tokens(3, 2), tokens(long, 3), tokens(4, 4)],
        (0..4).map(|i| tokens(1, 10 + i)).collect(),
        vec![tokens(2, 20), vec![], tokens(1, 21), tokens(2, 22)],
        vec![vec![], tokens(3, 30), vec![], vec![]],
        (0..4).map(|i| tokens(1, 40 + i)).collect(),
    ]
}
