//! The generation side of the server: a worker thread that owns the model and runs the requests
//! in one continuous batch ([`flash_llama::Batcher`]): a request joins the running batch between
//! two steps when a slot is free (else it waits, in arrival order) and leaves it when it ends, so
//! each model step serves every request in flight. Each one's text streams as it comes.
//!
//! [`Backend`] is what the HTTP layer needs from it (a name, a context length, tokenization and a
//! streaming generation), so that the HTTP layer is tested without a model.

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread;

use candle_core::DType;
use flash_llama::{Batcher, ChatMessage, Finish, Llama, Request, SamplingParams, TextTokenizer, TokenStream};

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

/// How the engine batches.
#[derive(Debug, Clone, Copy)]
pub struct EngineOptions {
    /// Requests that share a step at most (the KV cache's sequences).
    pub slots: usize,
    /// Tokens (prompt and generated) a request may hold; the context the HTTP layer enforces is
    /// the smaller of this and the model's.
    pub max_seq: usize,
    /// The KV cache's dtype: `None` for the model's, or `Some(F8E4M3)`.
    pub kv_cache_dtype: Option<DType>,
    /// Prompt tokens a request feeds per step at most (chunked prefill; 0: whole prompts).
    pub prefill_chunk: usize,
    /// A paged KV cache: (pages in the pool, tokens per page); `None`: one slot of `max_seq`
    /// tokens per request. With pages, a request joins when the pool has room for all its
    /// tokens (else it waits), and its pages go back when it ends.
    pub paged: Option<(usize, usize)>,
    /// On the GPU, decode steps as replays of CUDA graphs where they apply
    /// ([`Batcher::cuda_graphs`]).
    pub cuda_graphs: bool,
}

/// The model's worker thread and its queue (module docs).
pub struct Engine {
    name: String,
    context_len: usize,
    tokenizer: Arc<TextTokenizer>,
    jobs: Sender<(Job, Sender<Event>)>,
}

impl Engine {
    /// Starts the worker thread, which owns `model` from now on, with its batch's KV cache
    /// allocated (an error if it cannot be).
    pub fn start(
        name: impl Into<String>,
        model: Llama,
        tokenizer: TextTokenizer,
        opts: EngineOptions,
    ) -> candle_core::Result<Self> {
        let context_len = model.config().max_position_embeddings.min(opts.max_seq);
        let (jobs, queue) = channel::<(Job, Sender<Event>)>();
        let tokenizer = Arc::new(tokenizer);
        let worker_tokenizer = Arc::clone(&tokenizer);
        let (ready, started) = channel::<candle_core::Result<()>>();
        // candle queues each thread's GPU work on that thread's own stream: the weights' uploads
        // and casts, queued by this thread, must be done before the worker's stream reads them.
        model.device().synchronize()?;
        thread::Builder::new()
            .name("flash-serve-engine".into())
            .spawn(move || {
                let kv_dtype = opts.kv_cache_dtype.unwrap_or(model.dtype());
                let batcher = match opts.paged {
                    None => Batcher::new(&model, opts.slots, opts.max_seq, kv_dtype),
                    Some((pages, page_size)) => model
                        .new_paged_cache(opts.slots, pages, page_size, opts.max_seq, kv_dtype)
                        .and_then(|cache| Batcher::with_cache(&model, cache)),
                };
                match batcher {
                    Ok(batcher) => {
                        let batcher = batcher.prefill_chunk(opts.prefill_chunk).cuda_graphs(opts.cuda_graphs);
                        let _ = ready.send(Ok(()));
                        run_batch(batcher, &worker_tokenizer, &queue);
                    }
                    Err(e) => {
                        let _ = ready.send(Err(e));
                    }
                }
            })
            .map_err(|e| candle_core::Error::msg(format!("spawning the engine thread: {e}")))?;
        started
            .recv()
            .map_err(|_| candle_core::Error::msg("the engine thread stopped while starting"))??;
        Ok(Self {
            name: name.into(),
            context_len,
            tokenizer,
            jobs,
        })
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

/// A request in the batch: where its text goes and what is still held back.
struct Live<'t> {
    events: Sender<Event>,
    stream: TokenStream<'t>,
    filter: StopFilter,
    prompt_tokens: usize,
    completion_tokens: usize,
}

impl Live<'_> {
    /// Sends the text held back (a possible start of a stop string, an incomplete character),
    /// unless a stop string turns up in it, then `Done`.
    fn finish(mut self, mut reason: FinishReason) {
        let rest = match self.stream.finish() {
            Ok(rest) => rest.unwrap_or_default(),
            Err(e) => {
                let _ = self.events.send(Event::Error(e.to_string()));
                return;
            }
        };
        let (mut text, stopped) = self.filter.push(&rest);
        match stopped {
            true => reason = FinishReason::Stop,
            false => text.push_str(&self.filter.flush()),
        }
        if !text.is_empty() && self.events.send(Event::Text(text)).is_err() {
            return;
        }
        self.done(reason);
    }

    fn done(self, finish_reason: FinishReason) {
        let _ = self.events.send(Event::Done {
            finish_reason,
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
        });
    }
}

/// The worker's loop: queued requests join the batch in arrival order while slots (and pages)
/// allow (waiting for one when nothing runs), one step, each request's new text streamed; until
/// the queue closes.
fn run_batch(mut batcher: Batcher, tokenizer: &TextTokenizer, queue: &Receiver<(Job, Sender<Event>)>) {
    let mut live: HashMap<u64, Live> = HashMap::new();
    let mut waiting: VecDeque<(Job, Sender<Event>)> = VecDeque::new();
    let mut next_id = 0u64;
    loop {
        let mut admit = |(job, events): (Job, Sender<Event>), batcher: &mut Batcher| {
            let id = next_id;
            next_id += 1;
            let request = Request {
                prompt: job.prompt.clone(),
                max_tokens: job.max_tokens,
                sampling: job.sampling.clone(),
                stop_tokens: tokenizer.eos_token_ids.clone(),
            };
            match batcher.join(id, request) {
                Ok(()) => {
                    let state = Live {
                        events,
                        stream: TokenStream::new(tokenizer),
                        filter: StopFilter::new(job.stop),
                        prompt_tokens: job.prompt.len(),
                        completion_tokens: 0,
                    };
                    live.insert(id, state);
                }
                Err(e) => {
                    let _ = events.send(Event::Error(e.to_string()));
                }
            }
        };
        // Everything queued joins the waiting line (blocking for one when nothing runs).
        if batcher.running() == 0 && waiting.is_empty() {
            match queue.recv() {
                Ok(job) => waiting.push_back(job),
                Err(_) => return,
            }
        }
        while let Ok(job) = queue.try_recv() {
            waiting.push_back(job);
        }
        // Then joins the batch in arrival order, as slots (and a paged cache's pages) allow.
        while let Some((job, events)) = waiting.pop_front() {
            let tokens = job.prompt.len() + job.max_tokens;
            if !batcher.could_fit(tokens) {
                let _ = events.send(Event::Error(format!(
                    "the request's {tokens} tokens do not fit the server's KV cache"
                )));
                continue;
            }
            if !batcher.fits(tokens) {
                waiting.push_front((job, events));
                break;
            }
            admit((job, events), &mut batcher);
        }
        if batcher.running() == 0 {
            continue;
        }
        let emitted = match batcher.step() {
            Ok(emitted) => emitted,
            Err(e) => {
                // The batcher dropped every sequence.
                for (_, state) in live.drain() {
                    let _ = state.events.send(Event::Error(e.to_string()));
                }
                continue;
            }
        };
        for e in emitted {
            let Some(mut state) = live.remove(&e.id) else { continue };
            state.completion_tokens += 1;
            if e.finish == Some(Finish::Stop) {
                // An end-of-sequence token: not part of the text.
                state.finish(FinishReason::Stop);
                continue;
            }
            let piece = match state.stream.push(e.token) {
                Ok(piece) => piece.unwrap_or_default(),
                Err(err) => {
                    let _ = state.events.send(Event::Error(format!("{err:#}")));
                    batcher.cancel(e.id);
                    continue;
                }
            };
            let (text, stopped) = state.filter.push(&piece);
            if !text.is_empty() && state.events.send(Event::Text(text)).is_err() {
                // The client went away: its slot is free for the next request.
                batcher.cancel(e.id);
                continue;
            }
            if stopped {
                // A stop string ended the text: what the filter held back is not part of it.
                batcher.cancel(e.id);
                state.done(FinishReason::Stop);
            } else if e.finish == Some(Finish::Length) {
                state.finish(FinishReason::Length);
            } else {
                live.insert(e.id, state);
            }
        }
    }
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
