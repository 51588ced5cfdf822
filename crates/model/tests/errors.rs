//! Broken model files are errors that say what is wrong, never panics.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{temp_dir, weights, write_hf_dir, Family};
use flash_llama::loader::{load_gguf, load_hf_dir};
use flash_llama::Kernels;

fn hf_error(config_json: &str, weights: &std::collections::HashMap<String, Tensor>) -> String {
    let dir = temp_dir("err");
    write_hf_dir(&dir, config_json, weights);
    match load_hf_dir(&dir, DType::F32, &Device::Cpu, Kernels::Composed) {
        Ok(_) => panic!("loading should fail"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn missing_tensor_is_named() {
    let mut w = weights(Family::Llama);
    w.remove("model.layers.1.mlp.up_proj.weight");
    let err = hf_error(&Family::Llama.config_json(), &w);
    assert!(err.contains("model.layers.1.mlp.up_proj.weight"), "{err}");
}

#[test]
fn wrong_shape_is_named() {
    let mut w = weights(Family::Llama);
    w.insert(
        "model.layers.0.self_attn.k_proj.weight".into(),
        Tensor::zeros((7, 32), DType::F32, &Device::Cpu).unwrap(),
    );
    let err = hf_error(&Family::Llama.config_json(), &w);
    assert!(
        err.contains("shape mismatch") && err.contains("model.layers.0.self_attn.k_proj.weight"),
        "{err}"
    );
}

#[test]
fn unknown_architecture_is_rejected() {
    let json = Family::Llama.config_json().replace("\"llama\"", "\"gpt_neox\"");
    let err = hf_error(&json, &weights(Family::Llama));
    assert!(err.contains("unsupported architecture"), "{err}");

    let err = format!(
        "{:#}",
        flash_llama::Config::from_hf_json("{\"model_type\": \"llama\"}").unwrap_err()
    );
    assert!(err.contains("config"), "{err}");
    let bad_heads = Family::Llama
        .config_json()
        .replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3");
    let err = format!("{:#}", flash_llama::Config::from_hf_json(&bad_heads).unwrap_err());
    assert!(err.contains("multiple"), "{err}");
}

#[test]
fn truncated_safetensors_is_an_error() {
    let dir = common::hf_model(Family::Llama);
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = format!(
        "{:#}",
        load_hf_dir(&dir, DType::F32, &Device::Cpu, Kernels::Composed)
            .err()
            .unwrap()
    );
    assert!(err.contains("safetensors"), "{err}");
}

#[test]
fn truncated_or_garbage_gguf_is_an_error() {
    let dir = temp_dir("gguf-err");
    let path = dir.join("tiny.gguf");
    common::write_gguf(&path);
    let bytes = std::fs::read(&path).unwrap();
    let load = |p: &std::path::Path| {
        format!(
            "{:#}",
            load_gguf(p, DType::F32, &Device::Cpu, Kernels::Composed).err().unwrap()
        )
    };

    // Tensor data cut short.
    let cut = dir.join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() - 100]).unwrap();
    assert!(load(&cut).contains("truncated"), "{}", load(&cut));

    // Cut inside the header.
    std::fs::write(&cut, &bytes[..50]).unwrap();
    assert!(load(&cut).contains("not a readable GGUF"), "{}", load(&cut));

    // Not a GGUF file at all.
    let junk = dir.join("junk.gguf");
    std::fs::write(&junk, b"definitely not a model").unwrap();
    assert!(load(&junk).contains("not a readable GGUF"), "{}", load(&junk));

    // A missing path.
    let err = match flash_llama::load(&dir.join("nope.gguf"), DType::F32, &Device::Cpu, Kernels::Composed) {
        Ok(_) => panic!("a missing file must not load"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("no model at"), "{err}");
}

#[test]
fn gguf_with_unknown_architecture_is_rejected() {
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    let dir = temp_dir("gguf-arch");
    let path = dir.join("falcon.gguf");
    let arch = gguf_file::Value::String("falcon".into());
    let t = QTensor::quantize(
        &Tensor::zeros((4, 4), DType::F32, &Device::Cpu).unwrap(),
        GgmlDType::F32,
    )
    .unwrap();
    let mut file = std::fs::File::create(&path).unwrap();
    gguf_file::write(
        &mut file,
        &[("general.architecture", &arch)],
        &[("token_embd.weight", &t)],
    )
    .unwrap();
    drop(file);
    let err = format!(
        "{:#}",
        load_gguf(&path, DType::F32, &Device::Cpu, Kernels::Composed)
            .err()
            .unwrap()
    );
    assert!(err.contains("unsupported GGUF architecture `falcon`"), "{err}");
}

/// Interrupted downloads: a GGUF cut anywhere (header, metadata, tensor table, data) is an error.
#[test]
fn gguf_cut_anywhere_is_an_error() {
    let dir = temp_dir("gguf-cuts");
    let path = dir.join("tiny.gguf");
    common::write_gguf(&path);
    let bytes = std::fs::read(&path).unwrap();
    let cut = dir.join("cut.gguf");
    for len in (0..bytes.len()).step_by(251) {
        std::fs::write(&cut, &bytes[..len]).unwrap();
        let result = load_gguf(&cut, DType::F32, &Device::Cpu, Kernels::Composed);
        assert!(result.is_err(), "a file cut at {len} of {} bytes loaded", bytes.len());
    }
}

/// The same for safetensors files.
#[test]
fn safetensors_cut_anywhere_is_an_error() {
    let dir = common::hf_model(Family::Llama);
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    for len in (0..bytes.len()).step_by(251) {
        std::fs::write(&path, &bytes[..len]).unwrap();
        let result = load_hf_dir(&dir, DType::F32, &Device::Cpu, Kernels::Composed);
        assert!(result.is_err(), "a file cut at {len} of {} bytes loaded", bytes.len());
    }
}
