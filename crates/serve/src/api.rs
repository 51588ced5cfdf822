//! The OpenAI API's request bodies (the fields this server reads) and how they become a [`Job`].

use serde::Deserialize;

use flash_llama::{ChatMessage, SamplingParams};

use crate::engine::{Backend, Job};

/// `stop`: one string or a list of up to 4.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// The sampling fields that completions and chat completions share.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Sampling {
    pub max_tokens: Option<usize>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// Not in OpenAI's API; vLLM, llama.cpp and others take it.
    pub top_k: Option<usize>,
    pub stop: Option<Stop>,
    pub seed: Option<u64>,
    #[serde(default)]
    pub stream: bool,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: String,
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// A request the server refuses: the HTTP status, OpenAI's error `type` and `code`, a message.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub code: Option<&'static str>,
    pub message: String,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>) -> Self {
        Self {
            status: 400,
            kind: "invalid_request_error",
            code: None,
            message: message.into(),
        }
    }

    pub fn with_code(mut self, status: u16, code: &'static str) -> Self {
        self.status = status;
        self.code = Some(code);
        self
    }

    pub fn server(message: impl Into<String>) -> Self {
        Self {
            status: 500,
            kind: "server_error",
            code: None,
            message: message.into(),
        }
    }

    /// The JSON body: `{"error": {"message", "type", "code"}}`.
    pub fn body(&self) -> String {
        serde_json::json!({
            "error": { "message": self.message, "type": self.kind, "code": self.code }
        })
        .to_string()
    }
}

/// Max tokens of a completion when the request names none (OpenAI's default for completions).
pub const DEFAULT_COMPLETION_TOKENS: usize = 16;
/// ... and for a chat completion (bounded by the context left).
pub const DEFAULT_CHAT_TOKENS: usize = 512;

/// Checks the model name and the sampling fields, tokenizes `prompt` and builds the job.
pub fn job(
    backend: &dyn Backend,
    model: Option<&str>,
    prompt: &str,
    s: &Sampling,
    default_max_tokens: usize,
) -> Result<Job, ApiError> {
    if let Some(m) = model {
        if m != backend.model_name() {
            return Err(ApiError::invalid(format!(
                "the model `{m}` does not exist; this server has `{}`",
                backend.model_name()
            ))
            .with_code(404, "model_not_found"));
        }
    }
    let temperature = s.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(format!(
            "temperature must be in [0, 2], got {temperature}"
        )));
    }
    let top_p = s.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(format!("top_p must be in (0, 1], got {top_p}")));
    }
    let stop = match &s.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if stop.len() > 4 {
        return Err(ApiError::invalid(format!("at most 4 stop strings, got {}", stop.len())));
    }
    let tokens = backend.encode(prompt).map_err(ApiError::server)?;
    if tokens.is_empty() {
        return Err(ApiError::invalid("the prompt is empty"));
    }
    let context = backend.context_len();
    if tokens.len() >= context {
        return Err(ApiError::invalid(format!(
            "the prompt has {} tokens; the model's context is {context}",
            tokens.len()
        ))
        .with_code(400, "context_length_exceeded"));
    }
    let room = context - tokens.len();
    let max_tokens = match s.max_tokens {
        Some(0) => return Err(ApiError::invalid("max_tokens must be at least 1")),
        Some(n) if n > room => {
            return Err(ApiError::invalid(format!(
                "{} prompt tokens + max_tokens {n} exceed the model's context of {context}",
                tokens.len()
            ))
            .with_code(400, "context_length_exceeded"))
        }
        Some(n) => n,
        None => default_max_tokens.min(room),
    };
    let seed = s.seed.unwrap_or_else(|| {
        // No seed: a different sample per request, as OpenAI's API.
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    Ok(Job {
        prompt: tokens,
        max_tokens,
        sampling: SamplingParams {
            temperature,
            top_k: s.top_k.unwrap_or(0),
            top_p,
            seed,
            ..SamplingParams::default()
        },
        stop,
    })
}
