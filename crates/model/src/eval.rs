//! Perplexity of a text, measured the way generation reads the model: token by token through
//! the KV cache, so that the cache's dtype (fp8 or the model's) shows in the number.

use std::time::Instant;

use candle_core::{bail, DType, Result, Tensor, D};

use crate::model::Llama;

/// The result of [`perplexity`].
#[derive(Debug, Clone, Copy)]
pub struct Perplexity {
    /// Tokens predicted (the text's tokens but the first).
    pub predicted: usize,
    /// Mean negative log-likelihood of those tokens, in nats.
    pub mean_nll: f64,
    /// Wall time of the whole pass.
    pub secs: f64,
}

impl Perplexity {
    /// exp(mean negative log-likelihood).
    pub fn value(&self) -> f64 {
        self.mean_nll.exp()
    }

    /// Tokens fed per second.
    pub fn tokens_per_sec(&self) -> f64 {
        self.predicted as f64 / self.secs.max(1e-9)
    }
}

/// The perplexity of `tokens` under `model` with a KV cache of `kv_cache_dtype` (the model's
/// dtype or `F8E4M3`): token 0 is a one-token prefill, then each token is one decode step whose
/// logits predict the next, so every prediction after the first reads the cache. The
/// log-likelihoods stay on the device until the end (one copy to the host).
pub fn perplexity(model: &Llama, tokens: &[u32], kv_cache_dtype: DType) -> Result<Perplexity> {
    if tokens.len() < 2 {
        bail!("perplexity: the text needs at least 2 tokens, got {}", tokens.len())
    }
    let context = model.config().max_position_embeddings;
    if tokens.len() > context {
        bail!(
            "perplexity: {} tokens exceed the model's context of {context}",
            tokens.len()
        )
    }
    let start = Instant::now();
    let mut cache = model.new_cache_of(1, tokens.len(), kv_cache_dtype)?;
    let targets = Tensor::new(&tokens[1..], model.device())?;
    let mut log_probs = Vec::with_capacity(tokens.len() - 1);
    for (i, &token) in tokens[..tokens.len() - 1].iter().enumerate() {
        let logits = model.step(&[vec![token]], &mut cache)?; // (1, vocab) f32
        let lp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        log_probs.push(lp.gather(&targets.narrow(0, i, 1)?.unsqueeze(1)?, 1)?);
    }
    let log_probs = Tensor::cat(&log_probs, 0)?
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?;
    let predicted = log_probs.len();
    Ok(Perplexity {
        predicted,
        mean_nll: -log_probs.iter().sum::<f64>() / predicted as f64,
        secs: start.elapsed().as_secs_f64(),
    })
}
