//! Training text: files read into one token stream, split into train and held-out parts, and
//! sampled as (input, target) windows by a seeded generator whose state is part of a checkpoint.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::tokenizer::TextTokenizer;

/// Token ids of the byte-level vocabulary: byte `b` is id `b`, then the specials.
pub const BYTE_END_OF_TEXT: u32 = 256;
/// 256 bytes + end-of-text, rounded up to a multiple of 8 (tensor-core friendly output head);
/// ids 257..263 never occur.
pub const BYTE_VOCAB_SIZE: usize = 264;

/// How text becomes token ids.
#[derive(Clone)]
pub enum Tokenization {
    /// One token per byte, `BYTE_END_OF_TEXT` between documents.
    Bytes,
    /// An HF tokenizer (tokenizer.json); its first EOS id, if any, separates documents.
    Hf(Box<TextTokenizer>),
}

impl Tokenization {
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Bytes => BYTE_VOCAB_SIZE,
            Self::Hf(t) => t.tokenizer.get_vocab_size(true),
        }
    }

    /// The id appended after every document, if there is one.
    pub fn end_of_text(&self) -> Option<u32> {
        match self {
            Self::Bytes => Some(BYTE_END_OF_TEXT),
            Self::Hf(t) => t.eos_token_ids.first().copied(),
        }
    }

    /// Ids of one document (not yet followed by the end-of-text id).
    pub fn encode(&self, bytes: &[u8]) -> Result<Vec<u32>> {
        match self {
            Self::Bytes => Ok(bytes.iter().map(|&b| b as u32).collect()),
            Self::Hf(t) => t.encode(&String::from_utf8_lossy(bytes), false),
        }
    }

    /// Text of `ids` (bytes that do not form UTF-8 are replaced; specials are dropped).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match self {
            Self::Bytes => {
                let bytes: Vec<u8> = ids.iter().filter(|&&t| t < 256).map(|&t| t as u8).collect();
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            Self::Hf(t) => t.decode(ids),
        }
    }

    /// A short description for logs and checkpoints (a resumed run must tokenize alike).
    pub fn describe(&self) -> String {
        match self {
            Self::Bytes => "bytes".into(),
            Self::Hf(_) => format!("hf tokenizer ({} ids)", self.vocab_size()),
        }
    }
}

/// Every file under `path` (itself if it is a file) whose extension is in `extensions`
/// (all files when `extensions` is empty), sorted so that the corpus is the same on every run.
/// Directories named in `skip_dirs` are not entered.
pub fn list_files(path: &Path, extensions: &[String], skip_dirs: &[&str]) -> Result<Vec<PathBuf>> {
    if path.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    if !path.is_dir() {
        bail!(
            "no training data at {}: pass a text file or a directory",
            path.display()
        )
    }
    let mut files = Vec::new();
    let mut dirs = vec![path.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let entries = std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))?;
        for entry in entries {
            let entry = entry.with_context(|| format!("listing {}", dir.display()))?;
            // file_type does not follow symlinks, so a link cycle cannot loop forever.
            let kind = entry.file_type()?;
            let p = entry.path();
            let name = entry.file_name();
            if kind.is_dir() {
                if !skip_dirs.iter().any(|s| name == *s) {
                    dirs.push(p);
                }
            } else if kind.is_file() {
                let ext = p.extension().and_then(|e| e.to_str()).unwrap_or("");
                if extensions.is_empty() || extensions.iter().any(|e| e == ext) {
                    files.push(p);
                }
            }
        }
    }
    files.sort();
    Ok(files)
}

/// A token stream split into a training part and a held-out part.
pub struct Corpus {
    pub train: Vec<u32>,
    pub eval: Vec<u32>,
    /// How many documents went to each part.
    pub train_docs: usize,
    pub eval_docs: usize,
    /// Bytes read.
    pub bytes: usize,
}

/// One document in `EVAL_EVERY` goes to the held-out part.
const EVAL_EVERY: usize = 20;

impl Corpus {
    /// Reads and tokenizes `files` (at most `max_bytes` bytes in all, if given).
    ///
    /// With at least `EVAL_EVERY` documents, every `EVAL_EVERY`-th document is held out (a spread
    /// of the corpus rather than whatever sorts last); with fewer, the last 1/`EVAL_EVERY` of the
    /// tokens is.
    pub fn from_files(files: &[PathBuf], tok: &Tokenization, max_bytes: Option<usize>) -> Result<Self> {
        let mut docs = Vec::new();
        let mut bytes = 0;
        for f in files {
            let mut data = std::fs::read(f).with_context(|| format!("reading {}", f.display()))?;
            if let Some(max) = max_bytes {
                data.truncate(max.saturating_sub(bytes));
            }
            if data.is_empty() {
                continue;
            }
            bytes += data.len();
            docs.push(
                tok.encode(&data)
                    .with_context(|| format!("tokenizing {}", f.display()))?,
            );
            if max_bytes.is_some_and(|max| bytes >= max) {
                break;
            }
        }
        if docs.iter().all(|d| d.is_empty()) {
            bail!("the training corpus is empty ({} files, no text)", files.len())
        }
        let mut c = Self::from_documents(docs, tok.end_of_text());
        c.bytes = bytes;
        Ok(c)
    }

    /// Splits tokenized documents (see [`Corpus::from_files`]), each followed by `end_of_text`.
    pub fn from_documents(docs: Vec<Vec<u32>>, end_of_text: Option<u32>) -> Self {
        let mut c = Corpus {
            train: Vec::new(),
            eval: Vec::new(),
            train_docs: 0,
            eval_docs: 0,
            bytes: 0,
        };
        let by_document = docs.len() >= EVAL_EVERY;
        for (i, doc) in docs.into_iter().enumerate() {
            let held_out = by_document && i % EVAL_EVERY == EVAL_EVERY - 1;
            let (part, count) = if held_out {
                (&mut c.eval, &mut c.eval_docs)
            } else {
                (&mut c.train, &mut c.train_docs)
            };
            part.extend(doc);
            part.extend(end_of_text);
            *count += 1;
        }
        if !by_document {
            let split = c.train.len() - c.train.len() / EVAL_EVERY;
            c.eval = c.train.split_off(split);
        }
        c
    }

    /// Fails unless both parts hold at least one window of `seq_len` inputs plus its target.
    pub fn check_fits(&self, seq_len: usize) -> Result<()> {
        for (name, part) in [("training", &self.train), ("held-out", &self.eval)] {
            if part.len() <= seq_len {
                bail!(
                    "the {name} part of the corpus has {} tokens, fewer than one window of seq_len {seq_len} + 1: \
                     use more data or a shorter --seq-len",
                    part.len()
                )
            }
        }
        Ok(())
    }

    /// A digest of both token streams, stored in checkpoints so that `--resume` on different data
    /// (or data tokenized differently) is refused instead of silently changing the run.
    pub fn fingerprint(&self) -> String {
        // FNV-1a over the ids: fast, stable across platforms and versions.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &t in self.train.iter().chain(&[u32::MAX]).chain(&self.eval) {
            for b in t.to_le_bytes() {
                h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
            }
        }
        format!("{}+{} tokens, fnv1a {h:016x}", self.train.len(), self.eval.len())
    }

    /// `batch` random training windows: inputs and the targets one token later, each
    /// batch × seq_len ids, row-major.
    pub fn sample_batch(&self, rng: &mut Rng, batch: usize, seq_len: usize) -> (Vec<u32>, Vec<u32>) {
        let starts: Vec<usize> = (0..batch).map(|_| rng.below(self.train.len() - seq_len)).collect();
        windows(&self.train, &starts, seq_len)
    }

    /// Held-out batch `i` of `n`: the `n · batch` windows are spread evenly over the held-out
    /// part and are the same at every evaluation, so eval losses are comparable step to step.
    pub fn eval_batch(&self, i: usize, n: usize, batch: usize, seq_len: usize) -> (Vec<u32>, Vec<u32>) {
        let windows_total = n * batch;
        let last_start = self.eval.len() - seq_len - 1;
        let starts: Vec<usize> = (i * batch..(i + 1) * batch)
            .map(|w| w * last_start / (windows_total - 1).max(1))
            .collect();
        windows(&self.eval, &starts, seq_len)
    }
}

fn windows(tokens: &[u32], starts: &[usize], seq_len: usize) -> (Vec<u32>, Vec<u32>) {
    let mut inputs = Vec::with_capacity(starts.len() * seq_len);
    let mut targets = Vec::with_capacity(starts.len() * seq_len);
    for &s in starts {
        inputs.extend_from_slice(&tokens[s..s + seq_len]);
        targets.extend_from_slice(&tokens[s + 1..s + seq_len + 1]);
    }
    (inputs, targets)
}

/// SplitMix64: a tiny generator whose whole state is one u64, so a checkpoint can store it and
/// a resumed run draws exactly the batches the uninterrupted run would have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in 0..n (n > 0); the modulo bias is below 2⁻⁴⁰ for any corpus size here.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal samples (Box-Muller).
    pub fn normals(&mut self, n: usize, std: f64) -> Vec<f32> {
        let mut out = Vec::with_capacity(n + 1);
        while out.len() < n {
            let r = (-2.0 * self.unit().ln()).sqrt() * std;
            let theta = 2.0 * std::f64::consts::PI * self.unit();
            out.push((r * theta.cos()) as f32);
            out.push((r * theta.sin()) as f32);
        }
        out.truncate(n);
        out
    }
}
