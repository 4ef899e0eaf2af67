"""Session 42: a served stream's longest gap between tokens while another request brings a large JSON schema
(the grammar gate, a6ba6a8, against the session's start). Stdlib only (runs on the device as is).

python gate_served.py PORT PROPERTIES [MODEL] [MAX_TOKENS]: streams one completion (ignore_eos, MAX_TOKENS,
default 3000) and, 1 s in, sends a chat
request whose response_format is a schema of PROPERTIES optional integer properties; prints the stream's tokens,
its longest gap between SSE events and when it came, and the large request's status and time."""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time

MODEL, MAX_TOKENS = "qwen3-0.6b", 3000


def stream(port: int, out: dict) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    started = last = time.monotonic()
    events, worst, worst_at = 0, 0.0, 0.0
    for line in response:
        if not line.startswith(b"data: {"):
            continue
        now = time.monotonic()
        if now - last > worst:
            worst, worst_at = now - last, last - started
        last = now
        events += 1
    out.update(events=events, worst_gap_s=worst, worst_gap_at_s=worst_at, total_s=last - started,
               status=response.status)


def large(port: int, properties: int, out: dict) -> None:
    schema = {"type": "object", "properties": {f"p_{i}_{'x' * 20}": {"type": "integer"} for i in range(properties)}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    data = json.dumps(body)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    started = time.monotonic()
    conn.request("POST", "/v1/chat/completions", data, {"Content-Type": "application/json"})
    response = conn.getresponse()
    text = response.read().decode()
    out.update(status=response.status, seconds=time.monotonic() - started, body_bytes=len(data), answer=text[:160])


def main() -> None:
    global MODEL, MAX_TOKENS
    port, properties = int(sys.argv[1]), int(sys.argv[2])
    if len(sys.argv) > 3:
        MODEL, MAX_TOKENS = sys.argv[3], int(sys.argv[4])
    streamed: dict = {}
    big: dict = {}
    thread = threading.Thread(target=stream, args=(port, streamed))
    thread.start()
    time.sleep(1.0)  # the stream is decoding when the large request comes
    large(port, properties, big)
    thread.join()
    print(f"stream: {streamed}")
    print(f"large: {big}")


if __name__ == "__main__":
    main()
