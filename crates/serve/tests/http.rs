//! The HTTP layer over a scripted backend (no model): routes, JSON and SSE answers, the request
//! checks (malformed JSON, unknown model, over-long prompts, bad sampling fields) and a client
//! that disconnects mid-stream, which must end its generation and leave the server serving.
//! scripts/serve-e2e.sh runs the real model behind the same routes with curl.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use flash_llama::ChatMessage;
use flash_serve::{Backend, Event, FinishReason, Job, Server, StopFilter};
use serde_json::Value;

/// Tokens are the prompt's bytes; a generation emits "w0 ", "w1 ", ... up to max_tokens, one
/// every `delay`, and records whether its client went away.
struct Scripted {
    delay: Duration,
    cancelled: Arc<AtomicBool>,
    jobs: Mutex<Vec<Job>>,
    running: Arc<AtomicUsize>,
}

impl Scripted {
    fn new(delay: Duration) -> Self {
        Self {
            delay,
            cancelled: Arc::new(AtomicBool::new(false)),
            jobs: Mutex::new(Vec::new()),
            running: Arc::new(AtomicUsize::new(0)),
        }
    }
}

impl Backend for Scripted {
    fn model_name(&self) -> &str {
        "scripted"
    }

    fn context_len(&self) -> usize {
        64
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        Ok(text.bytes().map(u32::from).collect())
    }

    fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<String, String> {
        Ok(messages.iter().map(|m| format!("{}:{}|", m.role, m.content)).collect())
    }

    fn submit(&self, job: Job) -> Result<Receiver<Event>, String> {
        self.jobs.lock().unwrap().push(job.clone());
        let (tx, rx) = channel();
        let (delay, cancelled, running) = (self.delay, Arc::clone(&self.cancelled), Arc::clone(&self.running));
        running.fetch_add(1, Ordering::SeqCst);
        thread::spawn(move || {
            let mut filter = StopFilter::new(job.stop.clone());
            let mut finish = FinishReason::Length;
            let mut n = 0;
            while n < job.max_tokens {
                thread::sleep(delay);
                let (text, stopped) = filter.push(&format!("w{n} "));
                n += 1;
                if !text.is_empty() && tx.send(Event::Text(text)).is_err() {
                    cancelled.store(true, Ordering::SeqCst);
                    running.fetch_sub(1, Ordering::SeqCst);
                    return;
                }
                if stopped {
                    finish = FinishReason::Stop;
                    break;
                }
            }
            let rest = filter.flush();
            if !rest.is_empty() {
                let _ = tx.send(Event::Text(rest));
            }
            let _ = tx.send(Event::Done {
                finish_reason: finish,
                prompt_tokens: job.prompt.len(),
                completion_tokens: n,
            });
            running.fetch_sub(1, Ordering::SeqCst);
        });
        Ok(rx)
    }
}

fn start(backend: Arc<Scripted>) -> SocketAddr {
    let server = Server::bind("127.0.0.1:0").unwrap();
    let addr = server.local_addr().unwrap();
    thread::spawn(move || server.run(backend));
    addr
}

/// One HTTP/1.0 exchange (the server closes the connection after it): status and body.
fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP answer");
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, body.to_string())
}

fn json(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

/// The `data:` payloads of an SSE body, `[DONE]` included.
fn sse(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

#[test]
fn health_models_and_unknown_routes() {
    let addr = start(Arc::new(Scripted::new(Duration::ZERO)));
    let (status, body) = request(addr, "GET", "/health", "");
    assert_eq!((status, json(&body)["status"].as_str()), (200, Some("ok")));
    let (status, body) = request(addr, "GET", "/v1/models", "");
    assert_eq!(status, 200);
    assert_eq!(json(&body)["data"][0]["id"], "scripted");
    let (status, body) = request(addr, "GET", "/v1/nothing", "");
    assert_eq!(
        (status, json(&body)["error"]["code"].as_str()),
        (404, Some("not_found"))
    );
    let (status, _) = request(addr, "GET", "/v1/completions", "");
    assert_eq!(status, 405);
}

#[test]
fn completion_and_chat_answers() {
    let backend = Arc::new(Scripted::new(Duration::ZERO));
    let addr = start(Arc::clone(&backend));
    let (status, body) = request(
        addr,
        "POST",
        "/v1/completions",
        r#"{"model": "scripted", "prompt": "hello", "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 11}"#,
    );
    assert_eq!(status, 200, "{body}");
    let v = json(&body);
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], "w0 w1 w2 ");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], 5);
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(v["usage"]["total_tokens"], 8);
    let job = backend.jobs.lock().unwrap().last().unwrap().clone();
    assert_eq!(job.prompt, b"hello".iter().map(|&b| b as u32).collect::<Vec<_>>());
    assert_eq!(
        (
            job.max_tokens,
            job.sampling.temperature,
            job.sampling.top_p,
            job.sampling.top_k,
            job.sampling.seed
        ),
        (3, 0.5, 0.9, 7, 11)
    );

    // A stop string cuts the text before it; finish_reason "stop".
    let (status, body) = request(
        addr,
        "POST",
        "/v1/completions",
        r#"{"prompt": "hi", "max_tokens": 10, "stop": ["w3", "zz"]}"#,
    );
    assert_eq!(status, 200, "{body}");
    let v = json(&body);
    assert_eq!(v["choices"][0]["text"], "w0 w1 w2 ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    // Chat: the template's prompt, the message in the answer; no max_tokens: the context left.
    let (status, body) = request(
        addr,
        "POST",
        "/v1/chat/completions",
        r#"{"model": "scripted", "messages": [{"role": "user", "content": "hey"}]}"#,
    );
    assert_eq!(status, 200, "{body}");
    let v = json(&body);
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let job = backend.jobs.lock().unwrap().last().unwrap().clone();
    let prompt = "user:hey|";
    assert_eq!(job.prompt.len(), prompt.len());
    assert_eq!(job.max_tokens, 64 - prompt.len());
    assert_eq!(v["usage"]["completion_tokens"], 64 - prompt.len());
}

#[test]
fn streamed_completion_and_chat() {
    let addr = start(Arc::new(Scripted::new(Duration::from_millis(1))));
    let (status, body) = request(
        addr,
        "POST",
        "/v1/completions",
        r#"{"prompt": "abc", "max_tokens": 4, "stream": true}"#,
    );
    assert_eq!(status, 200);
    let events = sse(&body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| json(e)).collect();
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(text, "w0 w1 w2 w3 ");
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["usage"]["completion_tokens"], 4);
    assert!(chunks[..chunks.len() - 1]
        .iter()
        .all(|c| c["choices"][0]["finish_reason"].is_null()));

    let (status, body) = request(
        addr,
        "POST",
        "/v1/chat/completions",
        r#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": true}"#,
    );
    assert_eq!(status, 200);
    let events = sse(&body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| json(e)).collect();
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, "w0 w1 ");
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "length");
}

#[test]
fn bad_requests_get_4xx() {
    let addr = start(Arc::new(Scripted::new(Duration::ZERO)));
    let cases: &[(&str, &str, u16, &str)] = &[
        ("/v1/completions", r#"{"prompt": "x""#, 400, "malformed"),
        ("/v1/completions", r#"{"max_tokens": 3}"#, 400, "prompt"),
        ("/v1/completions", r#"{"model": "gpt-9", "prompt": "x"}"#, 404, "gpt-9"),
        (
            "/v1/completions",
            &format!(r#"{{"prompt": "{}"}}"#, "y".repeat(64)),
            400,
            "context",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "abcd", "max_tokens": 61}"#,
            400,
            "exceed",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "max_tokens": 0}"#,
            400,
            "max_tokens",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "temperature": 3}"#,
            400,
            "temperature",
        ),
        ("/v1/completions", r#"{"prompt": "x", "top_p": 0}"#, 400, "top_p"),
        (
            "/v1/completions",
            r#"{"prompt": "x", "stop": ["a","b","c","d","e"]}"#,
            400,
            "stop",
        ),
        ("/v1/completions", r#"{"prompt": ""}"#, 400, "empty"),
        ("/v1/chat/completions", r#"{"messages": []}"#, 400, "messages"),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user"}]}"#,
            400,
            "content",
        ),
    ];
    for (path, body, want_status, needle) in cases {
        let (status, answer) = request(addr, "POST", path, body);
        assert_eq!(status, *want_status, "{body}: {answer}");
        let message = json(&answer)["error"]["message"].as_str().unwrap().to_string();
        assert!(message.contains(needle), "{body}: {message:?} lacks {needle:?}");
    }
    // A body over the limit.
    let big = format!(r#"{{"prompt": "{}"}}"#, "z".repeat(flash_serve::http::MAX_BODY_BYTES));
    assert_eq!(request(addr, "POST", "/v1/completions", &big).0, 413);
    // Still serving.
    assert_eq!(request(addr, "GET", "/health", "").0, 200);
}

#[test]
fn client_disconnect_ends_the_generation() {
    let backend = Arc::new(Scripted::new(Duration::from_millis(5)));
    let addr = start(Arc::clone(&backend));
    let body = r#"{"prompt": "go", "max_tokens": 60, "stream": true}"#;
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Wait for the first event, then hang up.
    let mut first = [0u8; 256];
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let n = s.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
    drop(s);
    let t0 = Instant::now();
    while !backend.cancelled.load(Ordering::SeqCst) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the generation went on after its client left"
        );
        thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(backend.running.load(Ordering::SeqCst), 0);
    assert_eq!(request(addr, "GET", "/health", "").0, 200);
}

#[test]
fn stop_filter_holds_back_partial_matches() {
    let mut f = StopFilter::new(vec!["END".into(), "xyz".into()]);
    assert_eq!(f.push("abc E"), ("abc ".to_string(), false));
    assert_eq!(f.push("N"), (String::new(), false));
    assert_eq!(f.push("X"), ("ENX".to_string(), false));
    assert_eq!(f.push("1 EN"), ("1 ".to_string(), false));
    assert_eq!(f.push("D tail"), (String::new(), true));
    let mut f = StopFilter::new(vec!["é!".into()]);
    assert_eq!(f.push("café"), ("caf".to_string(), false));
    assert_eq!(f.flush(), "é");
    let mut none = StopFilter::new(vec![]);
    assert_eq!(none.push("anything"), ("anything".to_string(), false));
}
