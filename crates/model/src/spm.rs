//! SentencePiece vocabularies of GGUF files (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral),
//! rebuilt as the `tokenizers` BPE that HF's `LlamaTokenizerFast` uses.
//!
//! GGUF keeps the pieces and their scores but no merge list. SentencePiece-BPE merges, at each
//! step, the adjacent pair whose joined piece has the best score; a BPE with every
//! (left, right) split of each piece, ranked by the joined piece's score, does the same. That is
//! how HF converts slow Llama tokenizers (`SentencePieceExtractor`). Around the model:
//! spaces become `▁` with one prepended (normaliser), unknown bytes fall back to `<0xNN>` pieces,
//! and decoding undoes both.

use std::collections::HashMap;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::quantized::gguf_file;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{NormalizerWrapper, Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, Tokenizer};

/// llama.cpp's token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
const NORMAL: u32 = 1;
const CONTROL: u32 = 3;

fn strings(md: &HashMap<String, gguf_file::Value>, key: &str) -> Result<Vec<String>> {
    let values = md
        .get(key)
        .with_context(|| format!("GGUF metadata lacks `{key}`"))?
        .to_vec()
        .with_context(|| format!("`{key}` is not an array"))?;
    values
        .iter()
        .map(|v| {
            v.to_string()
                .cloned()
                .map_err(|_| anyhow!("`{key}` holds a non-string"))
        })
        .collect()
}

fn numbers<T>(
    md: &HashMap<String, gguf_file::Value>,
    key: &str,
    f: impl Fn(&gguf_file::Value) -> Option<T>,
) -> Option<Vec<T>> {
    md.get(key)?.to_vec().ok()?.iter().map(f).collect()
}

/// Builds the tokenizer of a GGUF file whose vocabulary is SentencePiece's.
pub fn tokenizer_from_gguf(content: &gguf_file::Content) -> Result<Tokenizer> {
    let md = &content.metadata;
    let pieces = strings(md, "tokenizer.ggml.tokens")?;
    let Some(scores) = numbers(md, "tokenizer.ggml.scores", |v| v.to_f32().ok()) else {
        bail!("GGUF metadata lacks `tokenizer.ggml.scores` (needed for a SentencePiece vocabulary)")
    };
    if scores.len() != pieces.len() {
        bail!("GGUF has {} tokens but {} scores", pieces.len(), scores.len())
    }
    let types = numbers(md, "tokenizer.ggml.token_type", |v| v.to_i32().ok().map(|t| t as u32))
        .unwrap_or_else(|| vec![NORMAL; pieces.len()]);
    let id = |key: &str| md.get(key).and_then(|v| v.to_u32().ok());
    let flag = |key: &str, default: bool| md.get(key).and_then(|v| v.to_bool().ok()).unwrap_or(default);

    let vocab: Vocab = pieces.iter().enumerate().map(|(i, p)| (p.clone(), i as u32)).collect();
    // Every split of every normal piece into two known pieces, best joined score first (ties:
    // the order of the joined piece, then of the halves, as HF's extractor).
    let mut merges: Vec<(f32, u32, u32, String, String)> = Vec::new();
    for (i, piece) in pieces.iter().enumerate() {
        if types.get(i).copied().unwrap_or(NORMAL) != NORMAL {
            continue;
        }
        for (at, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(at);
            if let (Some(&l), Some(&r)) = (vocab.get(left), vocab.get(right)) {
                merges.push((scores[i], l, r, left.to_string(), right.to_string()));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let merges = merges.into_iter().map(|(_, _, _, l, r)| (l, r)).collect();

    let mut bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = id("tokenizer.ggml.unknown_token_id").and_then(|i| pieces.get(i as usize)) {
        bpe = bpe.unk_token(unk.clone());
    }
    let mut tokenizer = Tokenizer::new(
        bpe.build()
            .map_err(|e| anyhow!("building the SentencePiece BPE: {e}"))?,
    );

    let space = Replace::new(" ", "▁").map_err(|e| anyhow!("{e}"))?;
    let prefix = flag("tokenizer.ggml.add_space_prefix", true);
    let normalizer: NormalizerWrapper = if prefix {
        NormalizerSequence::new(vec![Prepend::new("▁".into()).into(), space.into()]).into()
    } else {
        space.into()
    };
    tokenizer
        .with_normalizer(Some(normalizer))
        .map_err(|e| anyhow!("setting the normaliser: {e}"))?;
    let mut decoders = vec![
        DecoderWrapper::Replace(Replace::new("▁", " ").map_err(|e| anyhow!("{e}"))?),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ];
    if prefix {
        decoders.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
    }
    tokenizer.with_decoder(Some(DecoderSequence::new(decoders)));

    // Control tokens (<s>, </s>, [INST] in some files) are matched whole in text and skipped
    // when decoding.
    let specials: Vec<AddedToken> = pieces
        .iter()
        .zip(&types)
        .filter(|(_, &t)| t == CONTROL)
        .map(|(p, _)| AddedToken::from(p.clone(), true))
        .collect();
    tokenizer
        .add_special_tokens(specials)
        .map_err(|e| anyhow!("adding the control tokens: {e}"))?;

    let bos = id("tokenizer.ggml.bos_token_id").and_then(|i| Some((pieces.get(i as usize)?.clone(), i)));
    if let (true, Some((bos, bos_id))) = (flag("tokenizer.ggml.add_bos_token", true), bos) {
        let template = TemplateProcessing::builder()
            .try_single(format!("{bos} $A"))
            .and_then(|b| b.try_pair(format!("{bos} $A {bos} $B")))
            .map_err(|e| anyhow!("building the BOS template: {e}"))?
            .special_tokens(vec![(bos, bos_id)])
            .build()
            .map_err(|e| anyhow!("building the BOS template: {e}"))?;
        tokenizer.with_post_processor(Some(template));
    }
    Ok(tokenizer)
}
