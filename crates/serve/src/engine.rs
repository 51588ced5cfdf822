//! The generation side of the server: a worker thread that owns the model and runs the queued
//! requests one after the other, streaming each one's text as it comes.
//!
//! [`Backend`] is what the HTTP layer needs from it (a name, a context length, tokenization and a
//! streaming generation), so that the HTTP layer is tested without a model.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread;

use candle_core::DType;
use flash_llama::{generate, ChatMessage, Flow, GenerateOptions, Llama, SamplingParams, TextTokenizer, TokenStream};

/// One generation request, tokenized.
#[derive(Debug, Clone)]
pub struct Job {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Strings that end the generation; the text stops before the first one found.
    pub stop: Vec<String>,
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl FinishReason {
    /// The OpenAI API's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What a running generation reports, in order: text pieces, then `Done` or `Error`.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Text(String),
    Done {
        finish_reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    Error(String),
}

/// What the HTTP layer needs from a model.
pub trait Backend: Send + Sync + 'static {
    /// The name clients give as `model`.
    fn model_name(&self) -> &str;
    /// Prompt plus generated tokens at most.
    fn context_len(&self) -> usize;
    /// Text to token ids (with the tokenizer's special tokens, e.g. BOS).
    fn encode(&self, text: &str) -> Result<Vec<u32>, String>;
    /// Chat messages to the prompt text, through the model's chat template.
    fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<String, String>;
    /// Queues a generation. Its events arrive on the returned receiver; dropping the receiver
    /// (the client went away) ends the generation at its next token.
    fn submit(&self, job: Job) -> Result<Receiver<Event>, String>;
}

/// The model's worker thread and its queue: requests run one at a time, in arrival order.
pub struct Engine {
    name: String,
    context_len: usize,
    tokenizer: Arc<TextTokenizer>,
    jobs: Sender<(Job, Sender<Event>)>,
}

impl Engine {
    /// Starts the worker thread, which owns `model` from now on; each request's KV cache holds
    /// `kv_cache_dtype` (the model's dtype, or `F8E4M3`).
    pub fn start(name: impl Into<String>, model: Llama, tokenizer: TextTokenizer, kv_cache_dtype: DType) -> Self {
        let context_len = model.config().max_position_embeddings;
        let (jobs, queue) = channel::<(Job, Sender<Event>)>();
        let tokenizer = Arc::new(tokenizer);
        let worker_tokenizer = Arc::clone(&tokenizer);
        thread::Builder::new()
            .name("flash-serve-engine".into())
            .spawn(move || {
                for (job, events) in queue {
                    run_job(&model, &worker_tokenizer, kv_cache_dtype, job, &events);
                }
            })
            .expect("spawning the engine thread");
        Self {
            name: name.into(),
            context_len,
            tokenizer,
            jobs,
        }
    }
}

impl Backend for Engine {
    fn model_name(&self) -> &str {
        &self.name
    }

    fn context_len(&self) -> usize {
        self.context_len
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.tokenizer.encode(text, true).map_err(|e| e.to_string())
    }

    fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<String, String> {
        self.tokenizer.apply_chat_template(messages).map_err(|e| e.to_string())
    }

    fn submit(&self, job: Job) -> Result<Receiver<Event>, String> {
        let (events, receiver) = channel();
        self.jobs
            .send((job, events))
            .map_err(|_| "the engine thread has stopped".to_string())?;
        Ok(receiver)
    }
}

/// Runs one job on the worker thread, streaming its text into `events`.
fn run_job(model: &Llama, tokenizer: &TextTokenizer, kv_cache_dtype: DType, job: Job, events: &Sender<Event>) {
    let opts = GenerateOptions {
        max_tokens: job.max_tokens,
        sampling: job.sampling.clone(),
        stop_tokens: tokenizer.eos_token_ids.clone(),
        kv_cache_dtype: Some(kv_cache_dtype),
    };
    let mut stream = TokenStream::new(tokenizer);
    let mut filter = StopFilter::new(job.stop.clone());
    let mut finish = FinishReason::Length;
    let mut completion_tokens = 0;
    let mut client_gone = false;
    // A stop string ended the text: what the filter held back is not part of the answer.
    let mut cut = false;
    let result = generate(model, std::slice::from_ref(&job.prompt), &opts, |_, token| {
        completion_tokens += 1;
        if tokenizer.eos_token_ids.contains(&token) {
            finish = FinishReason::Stop;
            return Ok(Flow::Stop);
        }
        let piece = stream
            .push(token)
            .map_err(|e| candle_core::Error::msg(format!("{e:#}")))?
            .unwrap_or_default();
        let (text, stopped) = filter.push(&piece);
        if !text.is_empty() && events.send(Event::Text(text)).is_err() {
            client_gone = true;
            return Ok(Flow::Stop);
        }
        if stopped {
            cut = true;
            finish = FinishReason::Stop;
            return Ok(Flow::Stop);
        }
        Ok(Flow::Continue)
    });
    if client_gone {
        return;
    }
    let event = match result {
        Ok(_) => {
            // The text held back (a possible start of a stop string, an incomplete character)
            // goes out after max_tokens and after an end-of-sequence token alike.
            if !cut {
                let rest = match stream.finish() {
                    Ok(rest) => rest.unwrap_or_default(),
                    Err(e) => {
                        let _ = events.send(Event::Error(e.to_string()));
                        return;
                    }
                };
                let (mut text, stopped) = filter.push(&rest);
                match stopped {
                    true => finish = FinishReason::Stop,
                    false => text.push_str(&filter.flush()),
                }
                if !text.is_empty() && events.send(Event::Text(text)).is_err() {
                    return;
                }
            }
            Event::Done {
                finish_reason: finish,
                prompt_tokens: job.prompt.len(),
                completion_tokens,
            }
        }
        Err(e) => Event::Error(e.to_string()),
    };
    let _ = events.send(event);
}

/// Cuts a stream of text at the first of some stop strings. Text that may be the start of a stop
/// string is held back until the next piece decides it.
#[derive(Debug, Clone)]
pub struct StopFilter {
    stop: Vec<String>,
    held: String,
}

impl StopFilter {
    pub fn new(stop: Vec<String>) -> Self {
        let stop = stop.into_iter().filter(|s| !s.is_empty()).collect();
        Self {
            stop,
            held: String::new(),
        }
    }

    /// Adds `piece`; returns the text that can go out now and whether a stop string was found
    /// (the text then ends right before it, and nothing more should be pushed).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        self.held.push_str(piece);
        let first_stop = self.stop.iter().filter_map(|s| self.held.find(s.as_str())).min();
        if let Some(at) = first_stop {
            let text = self.held[..at].to_string();
            self.held.clear();
            return (text, true);
        }
        // Hold back the longest tail of the text that begins some stop string.
        let keep = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| self.stop.iter().any(|s| s.starts_with(&self.held[i..])))
            .unwrap_or(self.held.len());
        let text = self.held[..keep].to_string();
        self.held.drain(..keep);
        (text, false)
    }

    /// The text still held back (the generation ended without a stop string).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}
