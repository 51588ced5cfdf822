//! The shape and options of a decoder, read from an HF `config.json` or from GGUF metadata.
//!
//! One [`Config`] describes every supported family; the differences are a handful of flags:
//!
//! | family            | what differs                                                    |
//! |-------------------|-----------------------------------------------------------------|
//! | Llama 2           | nothing (the baseline)                                          |
//! | Llama 3/3.1/3.2   | `rope_scaling` of type `llama3` (3.1+), tied embeddings (3.2 1B/3B) |
//! | SmolLM2           | a Llama with tied embeddings                                    |
//! | Mistral           | `sliding_window` (attention only sees the last N keys)          |
//! | Qwen2 / Qwen2.5   | `attention_bias` (q/k/v projections have a bias)                |
//! | Qwen3             | `qk_norm` (RMSNorm over each head of q and k, before RoPE)      |

use std::f64::consts::PI;

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file;
use serde::Deserialize;

/// The model families this crate knows. Anything else is rejected at load time rather than
/// run with guessed semantics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
}

impl Architecture {
    /// From an HF `model_type` (`"llama"`) or an `architectures` entry (`"LlamaForCausalLM"`).
    pub fn from_hf_name(name: &str) -> Option<Self> {
        let lower = name.to_ascii_lowercase();
        let base = lower.strip_suffix("forcausallm").unwrap_or(&lower);
        match base {
            "llama" => Some(Self::Llama),
            "mistral" => Some(Self::Mistral),
            "qwen2" => Some(Self::Qwen2),
            "qwen3" => Some(Self::Qwen3),
            _ => None,
        }
    }
}

/// Llama 3.1-style frequency-dependent RoPE scaling: long wavelengths are stretched by
/// `factor`, short ones kept, and the band between interpolated smoothly.
#[derive(Debug, Clone, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

/// Everything the decoder needs to know about its shapes and options.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// GGUF files of Llama 3.1 carry the llama3 scaling precomputed as per-frequency divisors
    /// (`rope_freqs.weight`); when set, these replace `rope_scaling`.
    pub rope_freq_factors: Option<Vec<f32>>,
    /// Pairs rotated by RoPE: `true` for adjacent pairs (x0, x1), (x2, x3), ... which is the
    /// layout llama.cpp's converter gives q/k of `llama` GGUF files (it permutes their rows);
    /// `false` for HF's half-split pairs (x_i, x_{i + d/2}).
    pub rope_interleaved: bool,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub qk_norm: bool,
    pub sliding_window: Option<usize>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// The fields of an HF `config.json` that the supported families use.
#[derive(Debug, Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    #[serde(default)]
    architectures: Vec<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: f64,
    rope_theta: Option<f64>,
    rope_scaling: Option<serde_json::Value>,
    max_position_embeddings: Option<usize>,
    #[serde(default)]
    tie_word_embeddings: bool,
    attention_bias: Option<bool>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    bos_token_id: Option<serde_json::Value>,
    eos_token_id: Option<serde_json::Value>,
}

/// A token id or a list of them, as HF configs write `eos_token_id`.
pub(crate) fn token_ids(value: Option<&serde_json::Value>) -> Vec<u32> {
    match value {
        Some(serde_json::Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(serde_json::Value::Array(xs)) => xs.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect(),
        _ => Vec::new(),
    }
}

impl Config {
    /// Parses an HF `config.json`.
    pub fn from_hf_json(json: &str) -> Result<Self> {
        let hf: HfConfig = serde_json::from_str(json).context("config.json is not a valid model config")?;
        let names: Vec<&str> = hf
            .model_type
            .iter()
            .chain(hf.architectures.iter())
            .map(String::as_str)
            .collect();
        let Some(architecture) = names.iter().find_map(|n| Architecture::from_hf_name(n)) else {
            bail!(
                "unsupported architecture {names:?}: flash-llama runs llama, mistral, qwen2 and qwen3 (and their *ForCausalLM classes)"
            )
        };
        let rope_scaling = match &hf.rope_scaling {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => {
                let kind = v.get("rope_type").or_else(|| v.get("type")).and_then(|t| t.as_str());
                match kind {
                    Some("llama3") => {
                        let num = |key: &str| {
                            v.get(key)
                                .and_then(|x| x.as_f64())
                                .with_context(|| format!("rope_scaling of type llama3 lacks `{key}`"))
                        };
                        Some(Llama3RopeScaling {
                            factor: num("factor")?,
                            low_freq_factor: num("low_freq_factor")?,
                            high_freq_factor: num("high_freq_factor")?,
                            original_max_position_embeddings: num("original_max_position_embeddings")? as usize,
                        })
                    }
                    // "default" means no scaling.
                    Some("default") => None,
                    other => bail!("unsupported rope_scaling type {other:?}: only `llama3` is implemented"),
                }
            }
        };
        let heads = hf.num_attention_heads;
        let sliding_window = match architecture {
            // Mistral's config has the window whenever it applies (null for v0.2+).
            Architecture::Mistral => hf.sliding_window,
            // Qwen2 configs carry a window that is only used when use_sliding_window is set.
            _ if hf.use_sliding_window == Some(true) => hf.sliding_window,
            _ => None,
        };
        let cfg = Self {
            architecture,
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_hidden_layers: hf.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: hf.num_key_value_heads.unwrap_or(heads),
            head_dim: hf.head_dim.unwrap_or(hf.hidden_size.checked_div(heads).unwrap_or(0)),
            rms_norm_eps: hf.rms_norm_eps,
            rope_theta: hf.rope_theta.unwrap_or(10_000.0),
            rope_scaling,
            rope_freq_factors: None,
            rope_interleaved: false,
            max_position_embeddings: hf.max_position_embeddings.unwrap_or(4096),
            tie_word_embeddings: hf.tie_word_embeddings,
            // Qwen2 always has q/k/v biases; the others say so in attention_bias when they do.
            attention_bias: hf.attention_bias.unwrap_or(architecture == Architecture::Qwen2),
            qk_norm: architecture == Architecture::Qwen3,
            sliding_window,
            bos_token_id: token_ids(hf.bos_token_id.as_ref()).first().copied(),
            eos_token_ids: token_ids(hf.eos_token_id.as_ref()),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads the `{arch}.*` metadata of a GGUF file. Whether there are q/k/v biases, q/k norms
    /// or an untied output head is read from which tensors the file has.
    pub fn from_gguf(content: &gguf_file::Content) -> Result<Self> {
        let md = &content.metadata;
        let get = |key: &str| md.get(key).with_context(|| format!("GGUF metadata lacks `{key}`"));
        let arch_name = get("general.architecture")?.to_string()?.clone();
        let architecture = match arch_name.as_str() {
            // llama.cpp files Mistral (and SmolLM2) under the llama architecture.
            "llama" => Architecture::Llama,
            "qwen2" => Architecture::Qwen2,
            "qwen3" => Architecture::Qwen3,
            other => bail!("unsupported GGUF architecture `{other}`: flash-llama runs llama, qwen2 and qwen3"),
        };
        let usize_of = |key: &str| -> Result<usize> {
            let key = format!("{arch_name}.{key}");
            Ok(get(&key)?
                .to_u64()
                .with_context(|| format!("GGUF metadata `{key}` is not an integer"))? as usize)
        };
        let f64_of = |key: &str| -> Result<Option<f64>> {
            let key = format!("{arch_name}.{key}");
            match md.get(&key) {
                None => Ok(None),
                Some(v) => Ok(Some(
                    v.to_f32()
                        .with_context(|| format!("GGUF metadata `{key}` is not a float"))? as f64,
                )),
            }
        };
        let heads = usize_of("attention.head_count")?;
        let hidden_size = usize_of("embedding_length")?;
        let has = |name: &str| content.tensor_infos.contains_key(name);
        let vocab_size = match content.tensor_infos.get("token_embd.weight") {
            // candle reports GGUF shapes outermost first: (vocab, hidden).
            Some(info) => info.shape.dims()[0],
            None => bail!("GGUF file lacks the tensor `token_embd.weight`"),
        };
        let id = |key: &str| md.get(key).and_then(|v| v.to_u32().ok());
        let window = md
            .get(&format!("{arch_name}.attention.sliding_window"))
            .and_then(|v| v.to_u32().ok())
            .map(|w| w as usize);
        let cfg = Self {
            architecture,
            vocab_size,
            hidden_size,
            intermediate_size: usize_of("feed_forward_length")?,
            num_hidden_layers: usize_of("block_count")?,
            num_attention_heads: heads,
            num_key_value_heads: usize_of("attention.head_count_kv").unwrap_or(heads),
            head_dim: usize_of("attention.key_length").unwrap_or(hidden_size.checked_div(heads).unwrap_or(0)),
            rms_norm_eps: f64_of("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5),
            rope_theta: f64_of("rope.freq_base")?.unwrap_or(10_000.0),
            rope_scaling: None,
            rope_freq_factors: None,
            // llama.cpp permutes q/k rows of `llama` files only (its "normal" RoPE); qwen files
            // keep HF's layout (its "neox" RoPE).
            rope_interleaved: architecture == Architecture::Llama,
            max_position_embeddings: usize_of("context_length").unwrap_or(4096),
            tie_word_embeddings: !has("output.weight"),
            attention_bias: has("blk.0.attn_q.bias"),
            qk_norm: has("blk.0.attn_q_norm.weight"),
            sliding_window: window,
            bos_token_id: id("tokenizer.ggml.bos_token_id"),
            eos_token_ids: id("tokenizer.ggml.eos_token_id").into_iter().collect(),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Rejects shapes that would otherwise divide by zero or index out of bounds later.
    pub fn validate(&self) -> Result<()> {
        let c = self;
        for (name, v) in [
            ("vocab_size", c.vocab_size),
            ("hidden_size", c.hidden_size),
            ("intermediate_size", c.intermediate_size),
            ("num_hidden_layers", c.num_hidden_layers),
            ("num_attention_heads", c.num_attention_heads),
            ("num_key_value_heads", c.num_key_value_heads),
            ("head_dim", c.head_dim),
        ] {
            if v == 0 {
                bail!("invalid model config: {name} is 0")
            }
        }
        if c.num_attention_heads % c.num_key_value_heads != 0 {
            bail!(
                "invalid model config: num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                c.num_attention_heads,
                c.num_key_value_heads
            )
        }
        if c.head_dim % 2 != 0 || c.head_dim > flash_attn3::MAX_HEAD_DIM {
            bail!(
                "invalid model config: head_dim {} must be even and at most {}",
                c.head_dim,
                flash_attn3::MAX_HEAD_DIM
            )
        }
        if let Some(f) = &c.rope_freq_factors {
            if f.len() != c.head_dim / 2 {
                bail!(
                    "invalid model config: {} RoPE frequency factors for head_dim {}",
                    f.len(),
                    c.head_dim
                )
            }
        }
        if !(c.rms_norm_eps.is_finite() && c.rope_theta.is_finite() && c.rope_theta > 0.0) {
            bail!("invalid model config: rms_norm_eps and rope_theta must be finite (rope_theta > 0)")
        }
        Ok(())
    }

    /// The RoPE inverse frequencies θ_i = theta^(-2i/d), with Llama 3.1 scaling applied.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        (0..d / 2)
            .map(|i| {
                let freq = 1.0 / self.rope_theta.powf(2.0 * i as f64 / d as f64);
                let freq = match (&self.rope_freq_factors, &self.rope_scaling) {
                    (Some(factors), _) => freq / factors[i] as f64,
                    (None, Some(s)) => llama3_scale(freq, s),
                    (None, None) => freq,
                };
                freq as f32
            })
            .collect()
    }
}

/// Llama 3.1's `rope_type: llama3` rule for one frequency (as in HF transformers).
fn llama3_scale(freq: f64, s: &Llama3RopeScaling) -> f64 {
    let old = s.original_max_position_embeddings as f64;
    let low_freq_wavelen = old / s.low_freq_factor;
    let high_freq_wavelen = old / s.high_freq_factor;
    let wavelen = 2.0 * PI / freq;
    if wavelen < high_freq_wavelen {
        freq
    } else if wavelen > low_freq_wavelen {
        freq / s.factor
    } else {
        let smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        (1.0 - smooth) * freq / s.factor + smooth * freq
    }
}
