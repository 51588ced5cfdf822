#!/usr/bin/env python3
"""Bounded load test of a running `serve` (or any OpenAI-compatible) server on loopback.

CLIENTS threads send REQUESTS streaming chat completions in all (each a short prompt, max_tokens
MAX_TOKENS, greedy), and every answer must be complete: HTTP 200, at least one content chunk, a
finish_reason, usage, and `data: [DONE]`. Prints requests/s, generated tokens/s (from each
answer's usage), and p50 / p99 of the time to first token (TTFT) and of the inter-token latency
(ITL: gaps between content chunks). Standard library only.

    target/release/examples/serve --cpu --port 8093 &
    python3 scripts/serve-load.py --url http://127.0.0.1:8093 --clients 32 --requests 200
"""

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
import urllib.parse

PROMPTS = [
    "What is the capital of France?",
    "Name three colours.",
    "Count from one to five.",
    "What is two plus two?",
    "Say hello in Spanish.",
    "Name a planet.",
    "What do bees make?",
    "Give me a word that rhymes with cat.",
]


def one_request(url, i, max_tokens):
    """Returns (ttft, [gaps], completion_tokens) or raises with the reason."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = json.dumps({
        "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    })
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"status {resp.status}: {resp.read()[:200]!r}")
    stamps, finish, usage, done = [], None, None, False
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"error event: {chunk['error']}")
        choice = chunk["choices"][0]
        if choice["delta"].get("content"):
            stamps.append(time.perf_counter())
        if choice.get("finish_reason"):
            finish = choice["finish_reason"]
            usage = chunk.get("usage")
    conn.close()
    if not (done and finish and usage and stamps):
        raise RuntimeError(f"incomplete answer: done={done} finish={finish} usage={usage} chunks={len(stamps)}")
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - t0, gaps, usage["completion_tokens"]


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8093")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()

    next_index, lock = [0], threading.Lock()
    ttfts, gaps, tokens, failures = [], [], [], []

    def client():
        while True:
            with lock:
                i = next_index[0]
                if i >= args.requests:
                    return
                next_index[0] += 1
            try:
                ttft, g, n = one_request(args.url, i, args.max_tokens)
                with lock:
                    ttfts.append(ttft)
                    gaps.extend(g)
                    tokens.append(n)
            except Exception as e:  # noqa: BLE001 - every failure is reported
                with lock:
                    failures.append(f"request {i}: {e}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0

    print(f"{args.requests} requests from {args.clients} clients, max_tokens {args.max_tokens}: "
          f"{len(ttfts)} complete, {len(failures)} failed, {wall:.1f} s")
    for f in failures[:10]:
        print("  FAILED", f)
    if ttfts:
        print("| requests/s | generated tokens/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |")
        print("|---|---|---|---|---|---|")
        itl = (f"{1e3 * percentile(gaps, 50):.1f} ms | {1e3 * percentile(gaps, 99):.1f} ms"
               if gaps else "– | –")
        print(f"| {len(ttfts) / wall:.2f} | {sum(tokens) / wall:.1f} | "
              f"{percentile(ttfts, 50):.2f} s | {percentile(ttfts, 99):.2f} s | {itl} |")
        print(f"(mean generated tokens per answer {statistics.mean(tokens):.1f})")
    sys.exit(1 if failures or len(ttfts) != args.requests else 0)


if __name__ == "__main__":
    main()
