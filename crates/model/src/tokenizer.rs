//! Text in and out: a `tokenizers` tokenizer plus what generation needs around it (BOS/EOS ids,
//! the chat template), read from an HF directory or from GGUF metadata.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::quantized::gguf_file;
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use serde::{Deserialize, Serialize};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::tokenizer::SplitDelimiterBehavior;
use tokenizers::Tokenizer;

/// Llama 3's pre-tokenizer regex (its tokenizer.json; the same as candle's for `llama3`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// One turn of a conversation, as chat templates expect it (and as OpenAI's API sends it).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn user(content: impl Into<String>) -> Self {
        Self {
            role: "user".into(),
            content: content.into(),
        }
    }
}

/// A tokenizer with its special tokens and chat template.
#[derive(Clone)]
pub struct TextTokenizer {
    pub tokenizer: Tokenizer,
    pub bos_token_id: Option<u32>,
    /// Any of these ends a generation (`<|im_end|>`, `<|eot_id|>`, ...).
    pub eos_token_ids: Vec<u32>,
    /// A Jinja template over `messages` (see [`TextTokenizer::apply_chat_template`]).
    pub chat_template: Option<String>,
}

impl TextTokenizer {
    /// From GGUF metadata: a byte-level BPE built from `tokenizer.ggml.tokens`/`merges`
    /// (candle's `TokenizerFromGguf`), plus the ids and template stored beside them.
    pub fn from_gguf(content: &gguf_file::Content) -> Result<Self> {
        let md = &content.metadata;
        let kind = md
            .get("tokenizer.ggml.model")
            .and_then(|v| v.to_string().ok())
            .map(String::as_str);
        if kind == Some("llama") {
            // SentencePiece vocabularies (Llama 2, Mistral): candle has no builder for these.
            return Ok(Self {
                tokenizer: crate::spm::tokenizer_from_gguf(content)
                    .context("building the tokenizer from GGUF metadata")?,
                ..Self::gguf_extras(content)
            });
        }
        let mut tokenizer = Tokenizer::from_gguf(content).context("building the tokenizer from GGUF metadata")?;
        let pre = md
            .get("tokenizer.ggml.pre")
            .and_then(|v| v.to_string().ok())
            .map(String::as_str);
        // candle's builder knows the qwen2 and llama3 pre-tokenizers; for the others it falls back
        // to GPT-2's ByteLevel, which *adds a leading space* to the text. llama.cpp does not (and
        // neither do the HF tokenizers of these models), so prompts would differ by one token.
        match pre {
            Some("qwen2" | "llama3" | "smaug-bpe" | "lfm2") => {}
            // llama.cpp's name for Llama 3's pre-tokenizer, which candle does not map.
            Some("llama-bpe") => {
                let split = Split::new(
                    SplitPattern::Regex(LLAMA3_SPLIT.into()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .map_err(|e| anyhow!("building the llama3 pre-tokenizer: {e}"))?;
                let byte_level = ByteLevel::new(false, true, false);
                tokenizer.with_pre_tokenizer(Some(Sequence::new(vec![split.into(), byte_level.into()])));
            }
            // SmolLM splits digits one by one before the byte-level regex.
            Some("smollm") => {
                let byte_level = ByteLevel::new(false, true, true);
                tokenizer.with_pre_tokenizer(Some(Sequence::new(vec![Digits::new(true).into(), byte_level.into()])));
            }
            _ => {
                tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
            }
        }
        Ok(Self {
            tokenizer,
            ..Self::gguf_extras(content)
        })
    }

    /// BOS/EOS ids and the chat template stored beside a GGUF vocabulary, with an empty tokenizer.
    fn gguf_extras(content: &gguf_file::Content) -> Self {
        let md = &content.metadata;
        let id = |key: &str| md.get(key).and_then(|v| v.to_u32().ok());
        Self {
            tokenizer: Tokenizer::new(tokenizers::models::bpe::BPE::default()),
            bos_token_id: id("tokenizer.ggml.bos_token_id"),
            eos_token_ids: id("tokenizer.ggml.eos_token_id").into_iter().collect(),
            chat_template: md
                .get("tokenizer.chat_template")
                .and_then(|v| v.to_string().ok())
                .cloned(),
        }
    }

    /// From an HF model directory: `tokenizer.json`, plus `tokenizer_config.json` (chat template,
    /// special tokens), `chat_template.jinja` (where newer transformers save the chat template;
    /// it wins over tokenizer_config.json's) and `generation_config.json` (EOS ids) when present.
    pub fn from_hf_dir(dir: &Path, config_eos: &[u32], config_bos: Option<u32>) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let tokenizer =
            Tokenizer::from_file(&path).map_err(|e| anyhow!("reading the tokenizer {}: {e}", path.display()))?;
        let read_json = |name: &str| -> Result<Option<serde_json::Value>> {
            let path = dir.join(name);
            if !path.exists() {
                return Ok(None);
            }
            let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
            let json = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
            Ok(Some(json))
        };
        let tok_cfg = read_json("tokenizer_config.json")?;
        let gen_cfg = read_json("generation_config.json")?;

        let jinja = dir.join("chat_template.jinja");
        let jinja = match jinja.exists() {
            true => Some(std::fs::read_to_string(&jinja).with_context(|| format!("reading {}", jinja.display()))?),
            false => None,
        };
        let chat_template = jinja.or_else(|| {
            tok_cfg.as_ref().and_then(|c| match c.get("chat_template")? {
                serde_json::Value::String(s) => Some(s.clone()),
                // A list of named templates: take the default one.
                serde_json::Value::Array(list) => list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .or(list.first())
                    .and_then(|t| t.get("template")?.as_str().map(String::from)),
                _ => None,
            })
        });
        // A special token named in tokenizer_config.json, as a string or {"content": ...}.
        let named_token = |key: &str| -> Option<u32> {
            let v = tok_cfg.as_ref()?.get(key)?;
            let text = v.as_str().or_else(|| v.get("content")?.as_str())?;
            tokenizer.token_to_id(text)
        };
        let mut eos_token_ids = crate::config::token_ids(gen_cfg.as_ref().and_then(|g| g.get("eos_token_id")));
        eos_token_ids.extend(config_eos);
        eos_token_ids.extend(named_token("eos_token"));
        eos_token_ids.sort_unstable();
        eos_token_ids.dedup();
        let bos_token_id = config_bos.or_else(|| named_token("bos_token"));
        Ok(Self {
            tokenizer,
            bos_token_id,
            eos_token_ids,
            chat_template,
        })
    }

    /// Token ids of `text`. `add_special_tokens` lets the tokenizer's post-processor add BOS
    /// (and whatever else it adds); rendered chat templates already contain their special
    /// tokens, so they are encoded without.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer
            .encode(text, add_special_tokens)
            .map_err(|e| anyhow!("tokenizing the prompt: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| anyhow!("decoding tokens: {e}"))
    }

    fn token_text(&self, id: Option<u32>) -> String {
        id.and_then(|id| self.tokenizer.id_to_token(id)).unwrap_or_default()
    }

    /// Renders the chat template over `messages` with `add_generation_prompt = true`, so the
    /// text ends where the assistant's answer starts.
    pub fn apply_chat_template(&self, messages: &[ChatMessage]) -> Result<String> {
        let Some(source) = &self.chat_template else {
            bail!("this model has no chat template (run without --chat)")
        };
        let mut env = minijinja::Environment::new();
        // HF templates are Python-flavoured Jinja: `.strip()`, `.startswith()`, `raise_exception`.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
            },
        );
        let template = env.template_from_str(source).context("parsing the chat template")?;
        let text = template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => self.token_text(self.bos_token_id),
                eos_token => self.token_text(self.eos_token_ids.first().copied()),
            })
            .context("rendering the chat template")?;
        Ok(text)
    }
}

/// Turns a stream of token ids into text pieces as they come.
///
/// Decoding tokens one at a time is wrong for byte-level BPE: a character can span several
/// tokens, and some tokenizers drop or add spaces at token boundaries. So the stream decodes a
/// short window ending at the newest token and emits only what the window's text gained, once it
/// no longer ends in an incomplete character.
pub struct TokenStream<'a> {
    tokenizer: &'a TextTokenizer,
    tokens: Vec<u32>,
    /// Start of the window being decoded.
    prev: usize,
    /// End of the text already emitted (as a token index).
    current: usize,
}

impl<'a> TokenStream<'a> {
    pub fn new(tokenizer: &'a TextTokenizer) -> Self {
        Self {
            tokenizer,
            tokens: Vec::new(),
            prev: 0,
            current: 0,
        }
    }

    /// Adds a token; returns the new text it completes, if any.
    pub fn push(&mut self, token: u32) -> Result<Option<String>> {
        let before = self.tokenizer.decode(&self.tokens[self.prev..self.current])?;
        self.tokens.push(token);
        let after = self.tokenizer.decode(&self.tokens[self.prev..])?;
        // U+FFFD at the end: the last token ends inside a multi-byte character; wait for more.
        if after.len() > before.len() && !after.ends_with('\u{FFFD}') {
            if let Some(new) = after.strip_prefix(before.as_str()) {
                let new = new.to_string();
                self.prev = self.current;
                self.current = self.tokens.len();
                return Ok(Some(new));
            }
        }
        Ok(None)
    }

    /// Whatever text is still held back (an incomplete character at the very end).
    pub fn finish(&mut self) -> Result<Option<String>> {
        let before = self.tokenizer.decode(&self.tokens[self.prev..self.current])?;
        let after = self.tokenizer.decode(&self.tokens[self.prev..])?;
        self.prev = self.tokens.len();
        self.current = self.tokens.len();
        Ok(after
            .strip_prefix(before.as_str())
            .filter(|s| !s.is_empty())
            .map(String::from))
    }
}
