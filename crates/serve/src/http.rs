//! The HTTP side: OpenAI's routes over a [`Backend`], one thread per request (tiny_http), JSON
//! answers or server-sent events.
//!
//! Routes: `GET /health`, `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`.
//! A malformed body, an unknown model or an over-long prompt gets a 4xx with OpenAI's error body;
//! a client that disconnects mid-stream ends its generation at the next token.

use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::thread;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use tiny_http::{HTTPVersion, Header, Method, Request, Response, StatusCode};

use crate::api::{self, ApiError, ChatRequest, CompletionRequest};
use crate::engine::{Backend, Event, FinishReason};

/// Request bodies larger than this are refused (413).
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// A bound HTTP server; [`Server::run`] serves until the process ends.
pub struct Server {
    http: tiny_http::Server,
}

impl Server {
    /// Binds `addr` (`host:port`; port 0 picks a free one).
    pub fn bind(addr: &str) -> io::Result<Self> {
        let http = tiny_http::Server::http(addr).map_err(|e| io::Error::other(format!("binding {addr}: {e}")))?;
        Ok(Self { http })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.http
            .server_addr()
            .to_ip()
            .ok_or_else(|| io::Error::other("not an IP listener"))
    }

    /// Answers requests, each on its own thread, forever.
    pub fn run(self, backend: Arc<dyn Backend>) {
        let ids = Arc::new(AtomicU64::new(0));
        for request in self.http.incoming_requests() {
            let (backend, ids) = (Arc::clone(&backend), Arc::clone(&ids));
            let spawned = thread::Builder::new()
                .name("flash-serve-request".into())
                .spawn(move || handle(request, &*backend, &ids));
            if let Err(e) = spawned {
                eprintln!("flash-serve: cannot start a request thread: {e}");
            }
        }
    }
}

fn json_header() -> Header {
    Header::from_bytes("Content-Type", "application/json").expect("a valid header")
}

fn respond_json(request: Request, status: u16, body: String) {
    let response = Response::from_string(body)
        .with_status_code(StatusCode(status))
        .with_header(json_header());
    // A client that hung up is no error of ours.
    let _ = request.respond(response);
}

fn respond_error(request: Request, e: &ApiError) {
    respond_json(request, e.status, e.body());
}

fn handle(mut request: Request, backend: &dyn Backend, ids: &AtomicU64) {
    let path = request.url().split('?').next().unwrap_or("").to_string();
    let method = request.method().clone();
    match (method, path.as_str()) {
        (Method::Get, "/health") => respond_json(request, 200, json!({ "status": "ok" }).to_string()),
        (Method::Get, "/v1/models") => {
            let body = json!({
                "object": "list",
                "data": [{ "id": backend.model_name(), "object": "model", "created": now(), "owned_by": "flash-llama" }]
            });
            respond_json(request, 200, body.to_string())
        }
        (Method::Post, "/v1/completions") => match read_json::<CompletionRequest>(&mut request) {
            Ok(req) => completion(request, backend, ids, req),
            Err(e) => respond_error(request, &e),
        },
        (Method::Post, "/v1/chat/completions") => match read_json::<ChatRequest>(&mut request) {
            Ok(req) => chat(request, backend, ids, req),
            Err(e) => respond_error(request, &e),
        },
        (_, "/health" | "/v1/models" | "/v1/completions" | "/v1/chat/completions") => {
            let e = ApiError::invalid(format!("{} is not allowed on {path}", request.method()));
            respond_error(request, &e.with_code(405, "method_not_allowed"))
        }
        _ => {
            let e = ApiError::invalid(format!("no route {path}")).with_code(404, "not_found");
            respond_error(request, &e)
        }
    }
}

fn read_json<T: DeserializeOwned>(request: &mut Request) -> Result<T, ApiError> {
    let mut body = Vec::new();
    let read = request
        .as_reader()
        .take(MAX_BODY_BYTES as u64 + 1)
        .read_to_end(&mut body);
    if let Err(e) = read {
        return Err(ApiError::invalid(format!("reading the body: {e}")));
    }
    if body.len() > MAX_BODY_BYTES {
        return Err(
            ApiError::invalid(format!("the body is over {MAX_BODY_BYTES} bytes")).with_code(413, "body_too_large")
        );
    }
    serde_json::from_slice(&body).map_err(|e| ApiError::invalid(format!("malformed request body: {e}")))
}

/// OpenAI's `usage` object.
fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens
    })
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The two endpoints' differences: the object names and where the text goes in a choice.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Completion,
    Chat,
}

impl Kind {
    fn id(self, n: u64) -> String {
        match self {
            Kind::Completion => format!("cmpl-{n}"),
            Kind::Chat => format!("chatcmpl-{n}"),
        }
    }

    /// A whole (non-streamed) choice.
    fn choice(self, text: &str, finish: FinishReason) -> Value {
        match self {
            Kind::Completion => json!({ "index": 0, "text": text, "logprobs": null, "finish_reason": finish.as_str() }),
            Kind::Chat => json!({
                "index": 0,
                "message": { "role": "assistant", "content": text },
                "finish_reason": finish.as_str()
            }),
        }
    }

    /// A streamed chunk's choice: a text piece, or the end.
    fn delta(self, text: Option<&str>, finish: Option<FinishReason>) -> Value {
        let finish = finish.map(FinishReason::as_str);
        match self {
            Kind::Completion => {
                json!({ "index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish })
            }
            Kind::Chat => {
                let delta = match text {
                    Some(t) => json!({ "content": t }),
                    None => json!({}),
                };
                json!({ "index": 0, "delta": delta, "finish_reason": finish })
            }
        }
    }

    fn object(self, streamed: bool) -> &'static str {
        match (self, streamed) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }
}

fn completion(request: Request, backend: &dyn Backend, ids: &AtomicU64, req: CompletionRequest) {
    let job = api::job(
        backend,
        req.model.as_deref(),
        &req.prompt,
        &req.sampling,
        api::DEFAULT_COMPLETION_TOKENS,
    );
    run(request, backend, ids, job, Kind::Completion, req.sampling.stream);
}

fn chat(request: Request, backend: &dyn Backend, ids: &AtomicU64, req: ChatRequest) {
    if req.messages.is_empty() {
        return respond_error(request, &ApiError::invalid("messages is empty"));
    }
    let job = backend
        .chat_prompt(&req.messages)
        .map_err(|e| ApiError::invalid(format!("applying the chat template: {e}")))
        .and_then(|prompt| {
            api::job(
                backend,
                req.model.as_deref(),
                &prompt,
                &req.sampling,
                api::DEFAULT_CHAT_TOKENS,
            )
        });
    run(request, backend, ids, job, Kind::Chat, req.sampling.stream);
}

fn run(
    request: Request,
    backend: &dyn Backend,
    ids: &AtomicU64,
    job: Result<crate::engine::Job, ApiError>,
    kind: Kind,
    stream: bool,
) {
    let job = match job {
        Ok(job) => job,
        Err(e) => return respond_error(request, &e),
    };
    let events = match backend.submit(job) {
        Ok(events) => events,
        Err(e) => return respond_error(request, &ApiError::server(e)),
    };
    let head = Head {
        id: kind.id(ids.fetch_add(1, Ordering::Relaxed)),
        created: now(),
        model: backend.model_name().to_string(),
        kind,
    };
    if stream {
        return stream_events(request, head, events);
    }
    let mut text = String::new();
    for event in events {
        match event {
            Event::Text(t) => text.push_str(&t),
            Event::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
            } => {
                let mut body = head.json(false);
                body["choices"] = json!([kind.choice(&text, finish_reason)]);
                body["usage"] = usage(prompt_tokens, completion_tokens);
                return respond_json(request, 200, body.to_string());
            }
            Event::Error(e) => return respond_error(request, &ApiError::server(e)),
        }
    }
    respond_error(request, &ApiError::server("the generation ended without a result"));
}

/// The fields every answer of one request repeats.
struct Head {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
}

impl Head {
    fn json(&self, streamed: bool) -> Value {
        json!({
            "id": self.id,
            "object": self.kind.object(streamed),
            "created": self.created,
            "model": self.model,
        })
    }

    fn chunk(&self, choice: Value) -> String {
        let mut v = self.json(true);
        v["choices"] = json!([choice]);
        format!("data: {v}\n\n")
    }
}

/// The streamed body: one `data: {chunk}` event per text piece, a last chunk with the finish
/// reason (and usage), then `data: [DONE]`.
struct SseBody {
    head: Head,
    events: Option<Receiver<Event>>,
    started: bool,
}

impl SseBody {
    fn new(head: Head, events: Receiver<Event>) -> Self {
        Self {
            head,
            events: Some(events),
            started: false,
        }
    }

    /// The next event's bytes; None at the end of the stream.
    fn next_bytes(&mut self) -> Option<String> {
        let events = self.events.as_ref()?;
        let mut out = String::new();
        if !self.started && self.head.kind == Kind::Chat {
            // The chat stream opens with the role.
            out += &self
                .head
                .chunk(json!({ "index": 0, "delta": { "role": "assistant", "content": "" }, "finish_reason": null }));
        }
        self.started = true;
        match events.recv() {
            Ok(Event::Text(t)) => out += &self.head.chunk(self.head.kind.delta(Some(&t), None)),
            Ok(Event::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
            }) => {
                let mut last = self.head.json(true);
                last["choices"] = json!([self.head.kind.delta(None, Some(finish_reason))]);
                last["usage"] = usage(prompt_tokens, completion_tokens);
                out += &format!("data: {last}\n\ndata: [DONE]\n\n");
                self.events = None;
            }
            Ok(Event::Error(e)) => {
                out += &format!("data: {}\n\ndata: [DONE]\n\n", ApiError::server(e).body());
                self.events = None;
            }
            Err(_) => {
                out += &format!(
                    "data: {}\n\ndata: [DONE]\n\n",
                    ApiError::server("the generation ended without a result").body()
                );
                self.events = None;
            }
        }
        Some(out)
    }
}

/// Writes the event stream straight to the socket, flushing each event as it comes (tiny_http's
/// own chunked writer would hold 8 KiB back): chunked for HTTP/1.1, the connection's end for
/// HTTP/1.0. A failed write means the client went away: returning drops the events receiver,
/// which ends the generation at its next token.
fn stream_events(request: Request, head: Head, events: Receiver<Event>) {
    let chunked = *request.http_version() != HTTPVersion(1, 0);
    let mut out = request.into_writer();
    let mut head_lines =
        String::from("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n");
    head_lines += if chunked {
        "Transfer-Encoding: chunked\r\n\r\n"
    } else {
        "Connection: close\r\n\r\n"
    };
    if out.write_all(head_lines.as_bytes()).and_then(|_| out.flush()).is_err() {
        return;
    }
    let mut body = SseBody::new(head, events);
    while let Some(bytes) = body.next_bytes() {
        let written = if chunked {
            write!(out, "{:x}\r\n{bytes}\r\n", bytes.len())
        } else {
            out.write_all(bytes.as_bytes())
        };
        if written.and_then(|_| out.flush()).is_err() {
            return;
        }
    }
    if chunked {
        let _ = out.write_all(b"0\r\n\r\n").and_then(|_| out.flush());
    }
}
