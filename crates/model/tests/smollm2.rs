//! End to end on the real default model, when it has been fetched (scripts/fetch-default-model.sh).
//! Ignored by default so that `cargo test` never depends on a download:
//!
//!     cargo test --release -p flash-llama --test smollm2 -- --ignored
//!
//! It also checks the HF-directory path on real weights: the GGUF is converted to an HF
//! directory (q/k rows un-permuted back to HF's layout, tokenizer.json, tokenizer_config.json)
//! and both must compute the same logits and answer the same thing.

mod common;

use std::path::PathBuf;

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};
use flash_llama::loader::gguf_to_hf_name;
use flash_llama::{generate, ChatMessage, Flow, GenerateOptions, Kernels, SamplingParams, TextTokenizer};

fn model_path() -> Option<PathBuf> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.exists() {
        Some(path)
    } else {
        eprintln!(
            "skipped: {} is missing (run scripts/fetch-default-model.sh)",
            path.display()
        );
        None
    }
}

/// Inverse of llama.cpp's q/k row permutation: (heads, d/2, 2, in) → (heads, 2, d/2, in).
fn unpermute(w: &Tensor, heads: usize) -> Tensor {
    let (out, inp) = w.dims2().unwrap();
    w.reshape((heads, out / heads / 2, 2, inp))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .reshape((out, inp))
        .unwrap()
}

fn answer(model: &flash_llama::LoadedModel, question: &str) -> (Vec<u32>, String) {
    let tok = &model.tokenizer;
    let text = tok.apply_chat_template(&[ChatMessage::user(question)]).unwrap();
    let prompt = tok.encode(&text, false).unwrap();
    let opts = GenerateOptions {
        max_tokens: 24,
        sampling: SamplingParams::default(),
        stop_tokens: tok.eos_token_ids.clone(),
        kv_cache_dtype: None,
        cuda_graphs: true,
    };
    let out = generate(&model.model, &[prompt], &opts, |_, _| Ok(Flow::Continue)).unwrap();
    let tokens = out.tokens[0].clone();
    let text = tok.decode(&tokens).unwrap();
    (tokens, text)
}

#[test]
#[ignore = "needs models/SmolLM2-135M-Instruct.Q4_1.gguf"]
fn smollm2_answers_and_hf_directory_matches_gguf() {
    let Some(path) = model_path() else { return };
    let dev = Device::Cpu;
    let gguf = flash_llama::load(&path, DType::F32, &dev, Kernels::Fused).unwrap();
    let (_, text) = answer(&gguf, "What is the capital of France?");
    assert!(text.contains("Paris"), "{text:?}");

    // The same model as an HF directory.
    let cfg = gguf.model.config().clone();
    let dir = common::temp_dir("smollm2-hf");
    let mut reader = std::io::BufReader::new(std::fs::File::open(&path).unwrap());
    let content = gguf_file::Content::read(&mut reader).unwrap();
    let mut tensors = std::collections::HashMap::new();
    for name in content.tensor_infos.keys() {
        let Some(hf) = gguf_to_hf_name(name) else { continue };
        let t = content
            .tensor(&mut reader, name, &dev)
            .unwrap()
            .dequantize(&dev)
            .unwrap();
        let t = if name.ends_with("attn_q.weight") {
            unpermute(&t, cfg.num_attention_heads)
        } else if name.ends_with("attn_k.weight") {
            unpermute(&t, cfg.num_key_value_heads)
        } else {
            t
        };
        tensors.insert(hf, t);
    }
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": true,
        "bos_token_id": 1, "eos_token_id": 2,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let tok = TextTokenizer::from_gguf(&content).unwrap();
    tok.tokenizer.save(dir.join("tokenizer.json"), false).unwrap();
    let tok_config = serde_json::json!({
        "chat_template": tok.chat_template,
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>"},
    });
    std::fs::write(dir.join("tokenizer_config.json"), tok_config.to_string()).unwrap();

    let hf = flash_llama::load(&dir, DType::F32, &dev, Kernels::Fused).unwrap();
    assert!(!hf.model.config().rope_interleaved);
    assert_eq!(hf.tokenizer.eos_token_ids, vec![2]);
    let ids = Tensor::new(
        vec![gguf.tokenizer.encode("The capital of France is", false).unwrap()],
        &dev,
    )
    .unwrap();
    let diff = common::max_diff(&gguf.model.forward(&ids).unwrap(), &hf.model.forward(&ids).unwrap());
    assert!(diff < 1e-3, "GGUF and HF logits differ by {diff}");
    let question = "Name three colours of the rainbow.";
    assert_eq!(answer(&gguf, question), answer(&hf, question));
}
