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

/// An HF directory's chat template: from tokenizer_config.json, or from chat_template.jinja (where
/// newer transformers save it), which wins when both are there; EOS from tokenizer_config.json.
#[test]
fn hf_directory_chat_template_from_the_config_or_the_jinja_file() {
    let dir = std::env::temp_dir().join(format!("flash-llama-text-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tok = byte_tokenizer(None);
    tok.tokenizer.save(dir.join("tokenizer.json"), false).unwrap();
    let config = serde_json::json!({"chat_template": "config: {{ messages[0]['content'] }}", "eos_token": "!"});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let render = || {
        let tok = TextTokenizer::from_hf_dir(&dir, &[], None).unwrap();
        (
            tok.apply_chat_template(&[ChatMessage::user("hi")]).unwrap(),
            tok.eos_token_ids,
        )
    };
    let bang = tok.tokenizer.token_to_id("!").unwrap();
    assert_eq!(render(), ("config: hi".to_string(), vec![bang]));
    std::fs::write(dir.join("chat_template.jinja"), "jinja: {{ messages[0]['content'] }}").unwrap();
    assert_eq!(render(), ("jinja: hi".to_string(), vec![bang]));
    std::fs::remove_dir_all(&dir).unwrap();
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

/// The sampler orders only the head of the vocabulary it walks (a selection, then a sort of the
/// selected); it must draw what a full sort of the vocabulary draws. The reference below is the
/// sampler as it was with the full sort (session 19 replaced it): the same tokens for every seed,
/// filter and shape of distribution, ties included (equal probabilities are walked by token id).
#[test]
fn sampling_draws_what_a_full_sort_draws() {
    // SplitMix64, as the sampler's.
    struct Rng(u64);
    impl Rng {
        fn next_f64(&mut self) -> f64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (z >> 11) as f64 / (1u64 << 53) as f64
        }
    }
    fn reference(logits: &[f32], p: &SamplingParams, rng: &mut Rng) -> u32 {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, (((l - max) as f64) / p.temperature).exp()))
            .collect();
        probs.sort_by(|a, b| b.1.total_cmp(&a.1));
        if p.top_k > 0 {
            probs.truncate(p.top_k);
        }
        if p.top_p < 1.0 {
            let total: f64 = probs.iter().map(|x| x.1).sum();
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, x) in probs.iter().enumerate() {
                acc += x.1 / total;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep.max(1));
        }
        let total: f64 = probs.iter().map(|x| x.1).sum();
        let mut r = rng.next_f64() * total;
        for &(token, weight) in &probs {
            if r < weight {
                return token;
            }
            r -= weight;
        }
        probs[probs.len() - 1].0
    }

    let mut gen = Rng(42);
    let (mut cases, mut walked_far) = (0, 0);
    for vocab in [1usize, 2, 63, 64, 65, 1000, 5000, 40_000] {
        for shape in 0..4 {
            // Peaked (a few likely tokens), flat, quantised (many exact ties), and one spike.
            let logits: Vec<f32> = (0..vocab)
                .map(|i| {
                    let u = gen.next_f64() as f32;
                    match shape {
                        0 => 12.0 * u * u * u,
                        1 => u,
                        2 => (4.0 * u).floor(),
                        _ => {
                            if i == vocab / 2 {
                                9.0
                            } else {
                                u
                            }
                        }
                    }
                })
                .collect();
            let tensor = Tensor::new(logits.as_slice(), &Device::Cpu).unwrap();
            for (temperature, top_k, top_p) in [
                (1.0, 0, 1.0),
                (0.7, 0, 0.9),
                (1.3, 40, 1.0),
                (1.0, 50, 0.95),
                (0.5, 1, 1.0),
                (2.0, 0, 0.5),
                (1.0, vocab + 3, 0.999),
            ] {
                for seed in [1u64, 7, 299_792_458] {
                    let params = SamplingParams {
                        temperature,
                        top_k,
                        top_p,
                        seed,
                        ..SamplingParams::default()
                    };
                    let mut sampler = Sampler::new(params.clone());
                    let mut rng = Rng(seed);
                    for draw in 0..5 {
                        let got = sampler.sample(&tensor, &[]).unwrap();
                        let want = reference(&logits, &params, &mut rng);
                        assert_eq!(
                            got, want,
                            "vocab {vocab} shape {shape} T {temperature} top_k {top_k} top_p {top_p} seed {seed} draw {draw}"
                        );
                        cases += 1;
                        // Count draws past the first doubling of the ordered head (64).
                        let rank = logits.iter().filter(|&&l| l > logits[got as usize]).count();
                        walked_far += (rank >= 64) as usize;
                    }
                }
            }
        }
    }
    assert_eq!(cases, 8 * 4 * 7 * 3 * 5);
    // The comparison reached tokens beyond the first ordered head, where the walk grows.
    assert!(walked_far > 100, "{walked_far}");
}
