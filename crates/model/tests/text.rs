//! Chat templates, incremental detokenisation and sampling.

use candle_core::{Device, Tensor};
use flash_llama::{ChatMessage, Sampler, SamplingParams, TextTokenizer, TokenStream};
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::Tokenizer;

/// A byte-level tokenizer with one token per byte (no merges): every multi-byte character
/// spans several tokens, the hard case for streaming.
fn byte_tokenizer(chat_template: Option<&str>) -> TextTokenizer {
    let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
    alphabet.sort_unstable();
    let vocab: Vocab = alphabet
        .iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), i as u32))
        .collect();
    let bpe = BPE::builder().vocab_and_merges(vocab, vec![]).build().unwrap();
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    TextTokenizer {
        tokenizer,
        bos_token_id: None,
        eos_token_ids: vec![],
        chat_template: chat_template.map(String::from),
    }
}

const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

#[test]
fn chat_template_renders_with_generation_prompt() {
    let tok = byte_tokenizer(Some(SMOLLM2_TEMPLATE));
    let text = tok.apply_chat_template(&[ChatMessage::user("Hi there")]).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn chat_template_has_python_methods_and_raise_exception() {
    let source =
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first turn must be the user') }}{% endif %}\
                  [{{ messages[0]['content'].strip() }}]{% if messages[0]['content'].startswith(' ') %}!{% endif %}";
    let tok = byte_tokenizer(Some(source));
    assert_eq!(
        tok.apply_chat_template(&[ChatMessage::user("  padded  ")]).unwrap(),
        "[padded]!"
    );
    let system = ChatMessage {
        role: "system".into(),
        content: "x".into(),
    };
    let err = format!("{:#}", tok.apply_chat_template(&[system]).unwrap_err());
    assert!(err.contains("first turn must be the user"), "{err}");
    let err = format!("{:#}", byte_tokenizer(None).apply_chat_template(&[]).unwrap_err());
    assert!(err.contains("no chat template"), "{err}");
}

#[test]
fn token_stream_never_splits_characters() {
    let tok = byte_tokenizer(None);
    let text = "héllo wörld, ✓ 日本 🦀!";
    let ids = tok.encode(text, false).unwrap();
    assert!(
        ids.len() > text.chars().count(),
        "multi-byte characters span several tokens"
    );
    let mut stream = TokenStream::new(&tok);
    let mut out = String::new();
    for &id in &ids {
        if let Some(piece) = stream.push(id).unwrap() {
            assert!(!piece.contains('\u{FFFD}'), "emitted a partial character: {piece:?}");
            out.push_str(&piece);
        }
    }
    if let Some(rest) = stream.finish().unwrap() {
        out.push_str(&rest);
    }
    assert_eq!(out, text);
}

#[test]
fn sampling_is_greedy_filtered_and_reproducible() {
    let logits = Tensor::new(&[0.5f32, 3.0, 1.0, 2.9, -1.0], &Device::Cpu).unwrap();
    let mut greedy = Sampler::new(SamplingParams::default());
    assert_eq!(greedy.sample(&logits, &[]).unwrap(), 1);

    // The repeat penalty pushes the seen token 1 below token 3.
    let mut penalised = Sampler::new(SamplingParams {
        repeat_penalty: 1.5,
        ..SamplingParams::default()
    });
    assert_eq!(penalised.sample(&logits, &[1]).unwrap(), 3);

    let top1 = SamplingParams {
        temperature: 1.0,
        top_k: 1,
        ..SamplingParams::default()
    };
    let mut s = Sampler::new(top1);
    assert!((0..20).all(|_| s.sample(&logits, &[]).unwrap() == 1));

    let hot = SamplingParams {
        temperature: 2.0,
        top_p: 0.9,
        seed: 7,
        ..SamplingParams::default()
    };
    let draw = |params: &SamplingParams| {
        let mut s = Sampler::new(params.clone());
        (0..50).map(|_| s.sample(&logits, &[]).unwrap()).collect::<Vec<_>>()
    };
    let a = draw(&hot);
    assert_eq!(a, draw(&hot), "same seed, same tokens");
    assert!(
        a.iter().any(|&t| t != 1),
        "temperature 2 should not always pick the argmax"
    );
    assert!(a.iter().all(|&t| t != 4), "top-p 0.9 drops the least likely token");
}

/// The greedy rules the GPU's argmax kernel copies: the first of equal maxima, NaN never chosen.
#[test]
fn argmax_takes_the_first_maximum_and_skips_nan() {
    use flash_llama::sampling::argmax;
    assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]), 1);
    assert_eq!(argmax(&[f32::NAN, -1.0, 5.0, f32::NAN]), 2);
    assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
    assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY]), 1);
    assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
    assert_eq!(argmax(&[]), 0);
    assert!(SamplingParams::default().is_greedy());
    let penalised = SamplingParams {
        repeat_penalty: 1.1,
        ..SamplingParams::default()
    };
    assert!(!penalised.is_greedy());
}

/// A GGUF file holding only a byte-level vocabulary plus the token "12" (merge "1 2"), with the
/// given `tokenizer.ggml.pre`, read back into a TextTokenizer.
fn gguf_tokenizer(pre: &str) -> TextTokenizer {
    use candle_core::quantized::gguf_file::{self, Value};
    let mut tokens: Vec<String> = ByteLevel::alphabet().into_iter().map(String::from).collect();
    tokens.sort_unstable();
    tokens.push("12".into());
    let strings = |xs: &[String]| Value::Array(xs.iter().map(|x| Value::String(x.clone())).collect());
    let metadata = [
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String(pre.into())),
        ("tokenizer.ggml.tokens", strings(&tokens)),
        ("tokenizer.ggml.merges", strings(&["1 2".to_string()])),
        ("tokenizer.ggml.eos_token_id", Value::U32(0)),
    ];
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let mut bytes = std::io::Cursor::new(Vec::new());
    gguf_file::write(&mut bytes, &md, &[]).unwrap();
    bytes.set_position(0);
    let content = gguf_file::Content::read(&mut bytes).unwrap();
    TextTokenizer::from_gguf(&content).unwrap()
}

#[test]
fn gguf_tokenizers_follow_their_pre_tokenizer() {
    for pre in ["smollm", "llama-bpe", "gpt2"] {
        let tok = gguf_tokenizer(pre);
        let id = |s: &str| tok.tokenizer.token_to_id(s).unwrap();
        // No GPT-2 style leading space: "hi" starts with the token "h", not "Ġh".
        assert_eq!(tok.encode("hi", false).unwrap(), vec![id("h"), id("i")], "{pre}");
        let digits = tok.encode("x12", false).unwrap();
        let expected = match pre {
            // SmolLM splits digits one by one, so "1 2" never merges.
            "smollm" => vec![id("x"), id("1"), id("2")],
            _ => vec![id("x"), id("12")],
        };
        assert_eq!(digits, expected, "{pre}");
        let text = "héllo 12, wörld";
        assert_eq!(tok.decode(&tok.encode(text, false).unwrap()).unwrap(), text, "{pre}");
        assert_eq!(tok.eos_token_ids, vec![0]);
    }
}

/// A SentencePiece vocabulary (`tokenizer.ggml.model = "llama"`, as Llama 2 and Mistral GGUFs
/// have): merges come from the scores, unknown characters fall back to byte pieces.
#[test]
fn gguf_sentencepiece_vocabulary() {
    use candle_core::quantized::gguf_file::{self, Value};
    let mut pieces: Vec<(String, f32, i32)> = vec![
        ("<unk>".into(), 0.0, 2),
        ("<s>".into(), 0.0, 3),
        ("</s>".into(), 0.0, 3),
    ];
    pieces.extend((0..=255u8).map(|b| (format!("<0x{b:02X}>"), 0.0, 6)));
    let normal = [
        "▁", "h", "e", "l", "o", "w", "r", "d", "ll", "▁h", "▁he", "llo", "▁hello",
    ];
    pieces.extend(
        normal
            .iter()
            .enumerate()
            .map(|(i, p)| (p.to_string(), -(i as f32) - 1.0, 1)),
    );
    let metadata = [
        ("tokenizer.ggml.model", Value::String("llama".into())),
        (
            "tokenizer.ggml.tokens",
            Value::Array(pieces.iter().map(|p| Value::String(p.0.clone())).collect()),
        ),
        (
            "tokenizer.ggml.scores",
            Value::Array(pieces.iter().map(|p| Value::F32(p.1)).collect()),
        ),
        (
            "tokenizer.ggml.token_type",
            Value::Array(pieces.iter().map(|p| Value::I32(p.2)).collect()),
        ),
        ("tokenizer.ggml.unknown_token_id", Value::U32(0)),
        ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ("tokenizer.ggml.eos_token_id", Value::U32(2)),
    ];
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let mut bytes = std::io::Cursor::new(Vec::new());
    gguf_file::write(&mut bytes, &md, &[]).unwrap();
    bytes.set_position(0);
    let content = gguf_file::Content::read(&mut bytes).unwrap();
    let tok = TextTokenizer::from_gguf(&content).unwrap();
    let id = |s: &str| tok.tokenizer.token_to_id(s).unwrap();

    let ids = tok.encode("hello world", true).unwrap();
    let expected: Vec<u32> = ["<s>", "▁hello", "▁", "w", "o", "r", "l", "d"]
        .iter()
        .map(|p| id(p))
        .collect();
    assert_eq!(ids, expected);
    // é is no piece: its UTF-8 bytes are.
    let ids = tok.encode("hé", false).unwrap();
    assert_eq!(ids, vec![id("▁h"), id("<0xC3>"), id("<0xA9>")]);
    assert_eq!(tok.decode(&ids).unwrap(), "hé");
    assert_eq!(
        tok.decode(&tok.encode("hello world", true).unwrap()).unwrap(),
        "hello world"
    );
    // Control tokens written in the text (chat templates) are matched whole.
    assert_eq!(tok.encode("<s>hello", false).unwrap()[0], 1);
    assert_eq!((tok.bos_token_id, tok.eos_token_ids.clone()), (Some(1), vec![2]));
}
