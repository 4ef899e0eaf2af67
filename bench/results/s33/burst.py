"""Mixed + hostile traffic against pagoda for DURATION s at CONCURRENCY; per-kind outcome counts -> JSON."""
import asyncio, collections, json, random, socket, sys, time
import aiohttp

BASE = "http://127.0.0.1:8410"
MODEL = "smollm2-135m-instruct"
DURATION = float(sys.argv[1]) if len(sys.argv) > 1 else 1500
CONC = int(sys.argv[2]) if len(sys.argv) > 2 else 8
OUT = sys.argv[3] if len(sys.argv) > 3 else "/tmp/soak/load_result.json"
CLIENT_TIMEOUT = 120
WORDS = ("apple river stone cloud paper engine quiet orange silver window garden planet music yellow "
         "forest copper mirror candle winter summer ocean bridge tiger lemon castle rocket violet").split()
SYSTEM = "You are a helpful assistant. Answer briefly and precisely."  # shared prefix -> prefix cache hits
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"]}

counts = collections.Counter()          # (kind, outcome)
failures = []                           # details of unexpected outcomes
latency = collections.defaultdict(list)

def words(k): return " ".join(random.choice(WORDS) for _ in range(k))
def mt(): return random.randint(4, 24)
def chat_msgs(): return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Tell me about {words(random.randint(2, 30))}"}]

# ---- normal kinds: (route, body) ----
def n_chat():       return "/v1/chat/completions", {"messages": chat_msgs(), "max_tokens": mt()}
def n_chat_stream(): return "/v1/chat/completions", {"messages": chat_msgs(), "max_tokens": mt(), "stream": True,
                                                    "stream_options": {"include_usage": True}}
def n_comp():       return "/v1/completions", {"prompt": words(random.randint(3, 60)), "max_tokens": mt(), "temperature": 0.8, "seed": random.randint(0, 1 << 30)}
def n_comp_stream(): return "/v1/completions", {"prompt": words(random.randint(3, 60)), "max_tokens": mt(), "stream": True}
def n_n2():         return random.choice(["/v1/chat/completions", "/v1/completions"]), None
def n_logprobs_chat(): return "/v1/chat/completions", {"messages": chat_msgs(), "max_tokens": mt(), "logprobs": True, "top_logprobs": 3, "stream": random.random() < .5}
def n_logprobs_comp(): return "/v1/completions", {"prompt": words(10), "max_tokens": mt(), "logprobs": 3, "stream": random.random() < .5}
def n_echo():       return "/v1/completions", {"prompt": words(random.randint(3, 20)), "max_tokens": random.choice([0, 4]), "echo": True, "logprobs": 1}
def n_stop():       return "/v1/completions", {"prompt": words(8), "max_tokens": mt(), "stop": [" the", ".", "\n"], "stream": random.random() < .5}
def n_regex():      return "/v1/completions", {"prompt": "Phone:", "max_tokens": 12, "guided_regex": r"\d{3}-\d{4}", "stream": random.random() < .5}
def n_json():       return "/v1/chat/completions", {"messages": chat_msgs(), "max_tokens": 24, "stream": random.random() < .5,
                                                    "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}
def n_tools():      return "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Weather in {random.choice(WORDS)}?"}],
                                                    "tools": TOOLS, "tool_choice": random.choice(["auto", "none", "required", {"type": "function", "function": {"name": "get_weather"}}]),
                                                    "max_tokens": 24, "stream": random.random() < .5}
def n_seed():       return "/v1/chat/completions", {"messages": chat_msgs(), "max_tokens": mt(), "temperature": 1.0, "top_p": 0.9, "seed": 7}
def n_choice():     return "/v1/completions", {"prompt": "Color:", "max_tokens": 8, "guided_choice": ["red", "green", "blue"]}

def _n2():
    route = random.choice(["/v1/chat/completions", "/v1/completions"])
    body = {"max_tokens": mt(), "n": 2, "temperature": 0.9, "stream": random.random() < .5}
    body.update({"messages": chat_msgs()} if "chat" in route else {"prompt": words(12)})
    return route, body

NORMAL = {"chat": n_chat, "chat_stream": n_chat_stream, "comp": n_comp, "comp_stream": n_comp_stream, "n2": _n2,
          "logprobs_chat": n_logprobs_chat, "logprobs_comp": n_logprobs_comp, "echo": n_echo, "stop": n_stop,
          "regex": n_regex, "json_schema": n_json, "tools": n_tools, "seed": n_seed, "choice": n_choice}

async def read_body(resp, stream):
    if not stream:
        return await resp.read()
    done = False
    async for line in resp.content:
        if line.strip() == b"data: [DONE]":
            done = True
    return done

async def normal(session, kind):
    route, body = NORMAL[kind]()
    body["model"] = MODEL
    stream = body.get("stream", False)
    t = time.monotonic()
    try:
        async with session.post(BASE + route, json=body, timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT)) as r:
            res = await read_body(r, stream)
            if r.status == 200:
                if stream and not res:
                    failures.append((kind, "stream without [DONE]"))
                    return "stream_no_done"
                if stream:
                    return "ok"
                data = json.loads(res)
                if "choices" not in data:
                    failures.append((kind, "no choices", res[:200]))
                    return "bad_body"
                if any(c.get("finish_reason") == "error" for c in data["choices"]):
                    failures.append((kind, "finish error", res[:300]))
                return "ok"
            if r.status < 500:
                failures.append((kind, r.status, (res if isinstance(res, bytes) else b"")[:300].decode("utf-8", "replace")))
                return f"{r.status}"
            failures.append((kind, r.status, (res if isinstance(res, bytes) else b"")[:300].decode("utf-8", "replace")))
            return f"{r.status}"
    except asyncio.TimeoutError:
        failures.append((kind, "timeout", body))
        return "timeout"
    finally:
        latency[kind].append(time.monotonic() - t)

# ---- hostile kinds ----
async def post_raw(session, route, data, ctype="application/json", timeout=CLIENT_TIMEOUT):
    async with session.post(BASE + route, data=data, headers={"Content-Type": ctype},
                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        body = await r.read()
        return r.status, body

def enc(d): return json.dumps(d).encode()

async def h_disconnect(session):
    """stream, read a couple of chunks, drop the connection"""
    route = random.choice(["/v1/chat/completions", "/v1/completions"])
    body = {"model": MODEL, "max_tokens": 200, "stream": True, "ignore_eos": True, "n": random.choice([1, 2])}
    body.update({"messages": chat_msgs()} if "chat" in route else {"prompt": words(20)})
    async with session.post(BASE + route, json=body, timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT)) as r:
        if r.status != 200:
            return f"{r.status}"
        k = 0
        async for _ in r.content:
            k += 1
            if k >= random.randint(1, 6):
                break
        r.close()  # abort: connection dropped mid-stream
    return "client_abort"

async def h_cancel(session):
    """task cancelled at a random moment (before / during the answer)"""
    route = random.choice(["/v1/chat/completions", "/v1/completions"])
    body = {"model": MODEL, "max_tokens": 64, "stream": random.random() < .5, "ignore_eos": True}
    body.update({"messages": chat_msgs()} if "chat" in route else {"prompt": words(20)})
    async def go():
        async with session.post(BASE + route, json=body) as r:
            await r.read()
            return r.status
    task = asyncio.ensure_future(go())
    await asyncio.sleep(random.uniform(0.0, 0.8))
    if task.done():
        return f"{task.result()}_before_cancel"
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return "client_abort"

async def h_client_deadline(session):
    """client deadline that fires (aiohttp timeout) while the server still generates"""
    body = {"model": MODEL, "prompt": words(30), "max_tokens": 300, "ignore_eos": True, "stream": random.random() < .5}
    try:
        async with session.post(BASE + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=random.uniform(0.2, 1.5))) as r:
            await r.read()
            return f"{r.status}_before_deadline"
    except asyncio.TimeoutError:
        return "client_abort"

async def h_server_deadline(session):
    """server --request-timeout 15 fires: long generation -> 408 (or stream ends with an error)"""
    body = {"model": MODEL, "prompt": words(10), "max_tokens": 4000, "ignore_eos": True, "stream": random.random() < .5}
    async with session.post(BASE + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT)) as r:
        data = await r.read()
        if r.status == 200 and body["stream"]:
            return "200_stream_" + ("error_event" if b'"error"' in data else "noerror") + ("_done" if b"[DONE]" in data else "")
        return f"{r.status}"

async def h_oversize(session):
    n = random.choice([9000, 12000])
    if random.random() < .5:
        body = {"model": MODEL, "prompt": "hello " * n, "max_tokens": 4}
        route = "/v1/completions"
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * n}], "max_tokens": 4, "stream": random.random() < .5}
        route = "/v1/chat/completions"
    s, _ = await post_raw(session, route, enc(body))
    return f"{s}"

async def h_overflow_tokens(session):
    """prompt fits but prompt + max_tokens does not"""
    body = {"model": MODEL, "prompt": "hello " * 4000, "max_tokens": 8000}
    s, _ = await post_raw(session, "/v1/completions", enc(body))
    return f"{s}"

async def h_malformed(session):
    data = random.choice([b'{"model": "x", "prompt": "hi"', b"not json at all", b"", b"[1,2,3]", b"null", b'{"prompt": }'])
    s, _ = await post_raw(session, random.choice(["/v1/completions", "/v1/chat/completions"]), data)
    return f"{s}"

async def h_wrong_types(session):
    body = random.choice([
        {"model": MODEL, "prompt": "hi", "max_tokens": "ten"},
        {"model": MODEL, "messages": "hello", "max_tokens": 4},
        {"model": MODEL, "prompt": "hi", "temperature": "hot"},
        {"model": MODEL, "prompt": {"a": 1}},
        {"model": MODEL, "messages": [{"role": 5, "content": None}]},
        {"model": MODEL, "prompt": "hi", "stop": 12},
        {"model": MODEL, "prompt": "hi", "n": -1},
        {"model": MODEL, "prompt": "hi", "logprobs": 99},
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 50, "logprobs": True},
        {"model": 123, "prompt": "hi"},
        {"model": "nope-model", "prompt": "hi", "max_tokens": 2},
    ])
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    s, _ = await post_raw(session, route, enc(body))
    return f"{s}"

async def h_unknown_fields(session):
    body = {"model": MODEL, "prompt": words(5), "max_tokens": 4, "frobnicate": True, "x_extra": {"a": [1, 2]}}
    s, _ = await post_raw(session, "/v1/completions", enc(body))
    return f"{s}"

async def h_huge_n(session):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "n": random.choice([1000, 100000, 2 ** 40])}
    s, _ = await post_raw(session, "/v1/completions", enc(body))
    return f"{s}"

async def h_bad_regex(session):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "guided_regex": random.choice(["([a-z", "a{5,2}", "(?P<", "\\"]),
            "stream": random.random() < .5}
    s, _ = await post_raw(session, "/v1/completions", enc(body))
    return f"{s}"

async def h_bad_schema(session):
    body = {"model": MODEL, "messages": chat_msgs(), "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "nonsense", "properties": 5}}}}
    s, _ = await post_raw(session, "/v1/chat/completions", enc(body))
    return f"{s}"

async def h_bad_utf8(session):
    data = random.choice([b'{"model": "%s", "prompt": "\xff\xfe\xfd", "max_tokens": 4}' % MODEL.encode(),
                          b'{"model": "%s", "messages": [{"role": "user", "content": "caf\xc3"}], "max_tokens": 4}' % MODEL.encode(),
                          b'\xef\xbb\xbf{"model": "%s", "prompt": "bom", "max_tokens": 4}' % MODEL.encode()])
    s, _ = await post_raw(session, random.choice(["/v1/completions", "/v1/chat/completions"]), data)
    return f"{s}"

async def h_half_body(session):
    """raw socket: announce a body, send half of it, close"""
    body = enc({"model": MODEL, "prompt": words(20), "max_tokens": 8})
    reader, writer = await asyncio.open_connection("127.0.0.1", 8410)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                 + body[: len(body) // 2])
    await writer.drain()
    await asyncio.sleep(random.uniform(0, 0.3))
    writer.close()
    return "client_abort"

HOSTILE = {"disconnect": h_disconnect, "cancel": h_cancel, "client_deadline": h_client_deadline,
           "server_deadline": h_server_deadline, "oversize": h_oversize, "overflow_tokens": h_overflow_tokens,
           "malformed": h_malformed, "wrong_types": h_wrong_types, "unknown_fields": h_unknown_fields,
           "huge_n": h_huge_n, "bad_regex": h_bad_regex, "bad_schema": h_bad_schema, "bad_utf8": h_bad_utf8,
           "half_body": h_half_body}
HOSTILE_W = {k: 1.0 for k in HOSTILE}
HOSTILE_W["server_deadline"] = 0.15   # each holds a slot 15 s
HOSTILE_W["oversize"] = 0.5

ONLY = sys.argv[4].split(",") if len(sys.argv) > 4 else None
async def worker(session, end):
    hk = [k for k in HOSTILE_W if ONLY is None or k in ONLY]
    hw = [HOSTILE_W[k] for k in hk]
    while time.monotonic() < end:
        if ONLY is not None or random.random() < 0.2:
            kind = random.choices(hk, hw)[0]
            try:
                out = await asyncio.wait_for(HOSTILE[kind](session), CLIENT_TIMEOUT + 10)
                if out.startswith("5"):
                    failures.append((kind, out))
            except asyncio.TimeoutError:
                out = "timeout"; failures.append((kind, "timeout"))
            except Exception as e:
                out = "exc:" + type(e).__name__; failures.append((kind, repr(e)[:200]))
        else:
            kind = random.choice(list(NORMAL))
            try:
                out = await normal(session, kind)
            except Exception as e:
                out = "exc:" + type(e).__name__; failures.append((kind, repr(e)[:200]))
        counts[(kind, out)] += 1

async def main():
    end = time.monotonic() + DURATION
    conn = aiohttp.TCPConnector(limit=CONC * 2, force_close=random.random() < 0)  # keep-alive pool
    async with aiohttp.ClientSession(connector=conn) as session:
        async def reporter():
            while time.monotonic() < end:
                await asyncio.sleep(60)
                dump()
        rep = asyncio.ensure_future(reporter())
        await asyncio.gather(*(worker(session, end) for _ in range(CONC)))
        rep.cancel()
    dump()

def dump():
    res = {"counts": {f"{k}|{o}": v for (k, o), v in sorted(counts.items())},
           "total": sum(counts.values()),
           "failures_n": len(failures), "failures": [repr(f)[:400] for f in failures[-300:]],
           "latency_p50": {k: sorted(v)[len(v) // 2] for k, v in latency.items() if v}}
    with open(OUT, "w") as f:
        json.dump(res, f, indent=1)

if __name__ == "__main__":
    asyncio.run(main())
