//! Loading a model from an HF directory (config.json + safetensors) or a GGUF file.
//!
//! Both paths end in a `VarBuilder` over HF tensor names, so [`Llama::load`] has one naming
//! scheme: GGUF names (`blk.0.attn_q.weight`) are renamed on the way in, and GGUF tensors are
//! dequantised to the run dtype (this crate computes in f32/bf16/f16, not on quantised blocks).

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

use crate::config::Config;
use crate::model::Llama;
use crate::nn::Kernels;
use crate::parallel::Group;
use crate::tokenizer::TextTokenizer;

/// A model ready to generate: the decoder and its tokenizer.
pub struct LoadedModel {
    pub model: Llama,
    pub tokenizer: TextTokenizer,
}

/// Loads the model and tokenizer at `path`: an HF directory or a `.gguf` file.
pub fn load(path: &Path, dtype: DType, device: &Device, kernels: Kernels) -> Result<LoadedModel> {
    load_with(path, dtype, device, kernels, None)
}

/// [`load`] of this rank's shard for tensor-parallel inference over `group`
/// ([`Llama::load_tensor_parallel`]): every rank reads the same files and keeps its slice.
pub fn load_tensor_parallel(
    path: &Path,
    dtype: DType,
    device: &Device,
    kernels: Kernels,
    group: Group,
) -> Result<LoadedModel> {
    load_with(path, dtype, device, kernels, Some(group))
}

fn load_with(path: &Path, dtype: DType, device: &Device, kernels: Kernels, tp: Option<Group>) -> Result<LoadedModel> {
    if path.is_dir() {
        let model = load_hf_dir_with(path, dtype, device, kernels, tp)?;
        let cfg = model.config();
        let tokenizer = TextTokenizer::from_hf_dir(path, &cfg.eos_token_ids, cfg.bos_token_id)?;
        Ok(LoadedModel { model, tokenizer })
    } else if path.is_file() {
        let (model, content) = load_gguf_with_content(path, dtype, device, kernels, tp)?;
        let tokenizer = TextTokenizer::from_gguf(&content)?;
        Ok(LoadedModel { model, tokenizer })
    } else {
        bail!(
            "no model at {}: pass an HF model directory or a .gguf file (scripts/fetch-default-model.sh fetches the default one)",
            path.display()
        )
    }
}

/// The decoder alone at `path` (an HF directory or a `.gguf` file), for when the tokenizer comes
/// from elsewhere (e.g. a GGUF whose SentencePiece vocabulary candle cannot rebuild).
pub fn load_model(path: &Path, dtype: DType, device: &Device, kernels: Kernels) -> Result<Llama> {
    load_model_with(path, dtype, device, kernels, None)
}

/// [`load_model`] of this rank's shard for tensor-parallel inference over `group`.
pub fn load_model_tensor_parallel(
    path: &Path,
    dtype: DType,
    device: &Device,
    kernels: Kernels,
    group: Group,
) -> Result<Llama> {
    load_model_with(path, dtype, device, kernels, Some(group))
}

fn load_model_with(path: &Path, dtype: DType, device: &Device, kernels: Kernels, tp: Option<Group>) -> Result<Llama> {
    if path.is_dir() {
        load_hf_dir_with(path, dtype, device, kernels, tp)
    } else if path.is_file() {
        Ok(load_gguf_with_content(path, dtype, device, kernels, tp)?.0)
    } else {
        bail!(
            "no model at {}: pass an HF model directory or a .gguf file",
            path.display()
        )
    }
}

/// The decoder of an HF directory: `config.json` and `model.safetensors` or the shards listed by
/// `model.safetensors.index.json`.
pub fn load_hf_dir(dir: &Path, dtype: DType, device: &Device, kernels: Kernels) -> Result<Llama> {
    load_hf_dir_with(dir, dtype, device, kernels, None)
}

/// The decoder on `device` (or, with `tp`, this rank's shard of it) from the full tensors in
/// `vb`.
fn build(
    vb: VarBuilder,
    cfg: &Config,
    kernels: Kernels,
    tp: Option<Group>,
    device: &Device,
) -> candle_core::Result<Llama> {
    match tp {
        None => Llama::load(vb, cfg, kernels),
        Some(group) => Llama::load_tensor_parallel(vb, cfg, kernels, group, device),
    }
}

fn load_hf_dir_with(dir: &Path, dtype: DType, device: &Device, kernels: Kernels, tp: Option<Group>) -> Result<Llama> {
    let config_path = dir.join("config.json");
    let json = std::fs::read_to_string(&config_path).with_context(|| format!("reading {}", config_path.display()))?;
    let cfg = Config::from_hf_json(&json).with_context(|| format!("in {}", config_path.display()))?;
    let files = safetensors_files(dir)?;
    // SAFETY: the files are memory-mapped read-only; like every mmap-based loader this assumes
    // nobody truncates or rewrites them while the model is loaded.
    // A shard reads its slices from the map on the CPU and copies only them to the device.
    let map_device = if tp.is_some() { &Device::Cpu } else { device };
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, map_device) }
        .with_context(|| format!("reading the safetensors weights in {}", dir.display()))?;
    build(vb, &cfg, kernels, tp, device).with_context(|| format!("loading the weights in {}", dir.display()))
}

fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let index_path = dir.join("model.safetensors.index.json");
    if !index_path.exists() {
        bail!(
            "{} has neither model.safetensors nor model.safetensors.index.json",
            dir.display()
        )
    }
    let text = std::fs::read_to_string(&index_path).with_context(|| format!("reading {}", index_path.display()))?;
    let index: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", index_path.display()))?;
    let Some(map) = index.get("weight_map").and_then(|m| m.as_object()) else {
        bail!("{} has no weight_map", index_path.display())
    };
    let mut files: Vec<PathBuf> = Vec::new();
    for shard in map.values() {
        let Some(name) = shard.as_str() else {
            bail!("{}: weight_map values must be file names", index_path.display())
        };
        let path = dir.join(name);
        if !files.contains(&path) {
            files.push(path);
        }
    }
    Ok(files)
}

/// The HF name of a llama.cpp tensor name, or None for tensors the decoder does not use.
pub fn gguf_to_hf_name(name: &str) -> Option<String> {
    let fixed = match name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(n) = fixed {
        return Some(n.to_string());
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, param) = rest.rsplit_once('.')?;
    let hf = match module {
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{param}"))
}

/// The decoder of a GGUF file.
pub fn load_gguf(path: &Path, dtype: DType, device: &Device, kernels: Kernels) -> Result<Llama> {
    Ok(load_gguf_with_content(path, dtype, device, kernels, None)?.0)
}

fn load_gguf_with_content(
    path: &Path,
    dtype: DType,
    device: &Device,
    kernels: Kernels,
    tp: Option<Group>,
) -> Result<(Llama, gguf_file::Content)> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let file_len = file.metadata()?.len();
    let mut reader = BufReader::new(file);
    let content = gguf_file::Content::read(&mut reader)
        .with_context(|| format!("{} is not a readable GGUF file", path.display()))?;
    let mut cfg = Config::from_gguf(&content).with_context(|| format!("in {}", path.display()))?;

    // A truncated download must be an error up front, not a failed read halfway through.
    for (name, info) in &content.tensor_infos {
        let dt = info.ggml_dtype;
        let bytes = (info.shape.elem_count() / dt.block_size() * dt.type_size()) as u64;
        let end = content.tensor_data_offset + info.offset + bytes;
        if end > file_len {
            bail!(
                "{} is truncated: tensor `{name}` ends at byte {end} but the file has {file_len} bytes",
                path.display()
            )
        }
    }

    let mut tensors = HashMap::new();
    for name in content.tensor_infos.keys() {
        let mut read = |device: &Device| -> Result<Tensor> {
            let q = content
                .tensor(&mut reader, name, device)
                .with_context(|| format!("reading tensor `{name}` of {}", path.display()))?;
            Ok(q.dequantize(device)?)
        };
        if name == "rope_freqs.weight" {
            // Llama 3.1 files: the llama3 RoPE scaling as per-frequency divisors.
            cfg.rope_freq_factors = Some(read(&Device::Cpu)?.to_vec1::<f32>()?);
        } else if let Some(hf) = gguf_to_hf_name(name) {
            tensors.insert(hf, read(device)?);
        }
    }
    cfg.validate().with_context(|| format!("in {}", path.display()))?;
    let vb = VarBuilder::from_tensors(tensors, dtype, device);
    let model = build(vb, &cfg, kernels, tp, device).with_context(|| {
        format!(
            "loading the weights of {} (named here by their HF names)",
            path.display()
        )
    })?;
    Ok((model, content))
}
