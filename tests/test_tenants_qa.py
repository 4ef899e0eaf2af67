"""Tenants as a hostile or careless client (or operator) meets them: keys files that do not load, model allow-lists,
quota charging and the usage log's status for every ending. Plain objects first, then the api process against the
fake tokenizer of test_api."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagoda.services.api.tenants import KeyTable, add_key, hash_key, parse_keys, read_keys_file
from pagoda.shared.errors import ConfigError
from tests.harness import HTTP, parse_metrics, wait_until
from tests.test_api import API_KEY, MODEL, MODEL_PATH, Stack, start_stack, stop_stack

# ---------------------------------------------------------------- plain objects


def test_keys_files_that_are_not_keys_files_are_config_errors(tmp_path: Path) -> None:
    """Every broken keys file is a ConfigError (the reload logs it and keeps the old keys): a key naming its tenant
    by a list used to raise TypeError, a file that is not UTF-8 UnicodeDecodeError, deep nesting RecursionError."""
    digest = "0" * 64
    for document in [
        {"tenants": {"a": {}}, "keys": [{"id": "x", "sha256": digest, "tenant": ["a"]}]},
        {"tenants": {"a": {}}, "keys": [{"id": "x", "sha256": digest, "tenant": {"a": 1}}]},
        # one key for two tenants: which one it would serve is an accident of the file's order
        {"tenants": {"a": {}, "b": {}}, "keys": [{"id": "x", "sha256": digest, "tenant": "a"},
                                                 {"id": "y", "sha256": digest, "tenant": "b"}]},
    ]:
        with pytest.raises(ConfigError):
            parse_keys(document)
    for limits in [{"weight": float("nan")}, {"weight": float("inf")}, {"weight": -1.0}, {"weight": 1e7},
                   {"weight": "2"}, {"weight": True}, {"priority": 1.5}, {"priority": "high"}, {"priority": 1 << 21},
                   {"priority": -(1 << 21)}, {"max_concurrent": 1e3}, {"requests_per_minute": -1},
                   {"tokens_per_minute": 1 << 40}, {"models": "*"}, {"models": [""]}]:
        with pytest.raises(ConfigError):
            parse_keys({"tenants": {"a": limits}, "keys": []})
    path = tmp_path / "keys.json"
    path.write_text('{"tenants": {"a": {"weight": NaN}}, "keys": []}')  # Python's json reads NaN
    with pytest.raises(ConfigError):
        read_keys_file(path)
    for content in [b"\xff\xfe{}", b"[" * 100_000 + b"]" * 100_000]:
        path.write_bytes(content)
        with pytest.raises(ConfigError):
            read_keys_file(path)
        with pytest.raises(ConfigError):  # `pagoda keys add` on it: one line, not a traceback
            add_key(path, "a", {})


def _keys_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pagoda.cli", "keys", *args], capture_output=True, text=True,
                          timeout=60)


def test_a_key_without_an_id_is_listed_and_revoked_by_the_id_it_serves_under(tmp_path: Path) -> None:
    """A key the file gives no id serves under its digest's first 8 digits (the usage log's key_id), but `pagoda keys
    list` failed on it with a KeyError traceback and `pagoda keys revoke` said there was no such key: it could not
    be revoked but by editing the file. An id that is not a string (a number, null) was served as its str()."""
    path = tmp_path / "keys.json"
    digest = hash_key("k1")
    path.write_text(json.dumps({"tenants": {"a": {}}, "keys": [{"sha256": digest, "tenant": "a"}]}))
    assert read_keys_file(path)[digest][0] == digest[:8]
    listed = _keys_cli("list", str(path))
    assert listed.returncode == 0 and digest[:8] in listed.stdout, listed.stderr
    revoked = _keys_cli("revoke", str(path), digest[:8])
    assert revoked.returncode == 0, revoked.stderr
    assert read_keys_file(path) == {}
    for bad_id in [7, None, "", ["x"]]:
        with pytest.raises(ConfigError, match="id"):
            parse_keys({"tenants": {"a": {}}, "keys": [{"id": bad_id, "sha256": digest, "tenant": "a"}]})


def test_a_name_given_twice_in_the_keys_file_is_refused_not_the_last_one_taken(tmp_path: Path) -> None:
    """JSON lets an object name a member twice and Python's json keeps the last: a tenant written twice (a limited
    entry, then an unlimited one pasted below it), a limit given twice or a second 'keys' list silently replaced the
    first, at start-up and on every reload. Each is a ConfigError naming the name, for the server and `pagoda keys`."""
    path = tmp_path / "keys.json"
    key = {"id": "k", "sha256": hash_key("k"), "tenant": "acme"}
    for text, name in [
        ('{"tenants": {"acme": {"max_concurrent": 2}, "acme": {}}, "keys": [%s]}', "acme"),
        ('{"tenants": {"acme": {"max_concurrent": 2, "max_concurrent": 0}}, "keys": [%s]}', "max_concurrent"),
        ('{"tenants": {"acme": {}}, "keys": [%s], "keys": []}', "keys"),
        ('{"tenants": {"acme": {}}, "keys": [{"id": "k", "id": "j", "sha256": "%s", "tenant": "acme"}]}', "id"),
    ]:
        path.write_text(text % (json.dumps(key) if "%s]" in text else key["sha256"]))
        with pytest.raises(ConfigError, match=f"{name!r} twice"):
            read_keys_file(path)
        with pytest.raises(ConfigError, match=f"{name!r} twice"):
            add_key(path, "acme", {})


# ---------------------------------------------------------------- the api process


def _post(stack: Stack, key: str, prompt: str = "hello there", path: str = "/v1/completions",
          **body: object) -> object:
    return stack.post(path, {"model": MODEL, "prompt": prompt, **body}, headers={"Authorization": f"Bearer {key}"})


@pytest.fixture(scope="module")
def qa_stack(tmp_path_factory: pytest.TempPathFactory) -> object:
    folder = tmp_path_factory.mktemp("tenants_qa")
    keys_path = folder / "keys.json"
    keys = {"open": add_key(keys_path, "open", {})[1]}
    usage_path = folder / "usage.jsonl"
    stack = start_stack("--api-keys-file", str(keys_path), "--usage-log", str(usage_path), "--request-timeout", "3")
    yield stack, keys, keys_path, usage_path
    stop_stack(stack)


def test_a_keys_file_that_fails_oddly_keeps_the_watch_alive(qa_stack: tuple) -> None:
    """A keys file whose key names its tenant by a list raised TypeError out of the reload, which ended the task that
    polls the file: every later change, a revocation included, went unnoticed until a SIGHUP or a restart."""
    stack, keys, keys_path, _ = qa_stack
    key_id, doomed = add_key(keys_path, "doomed", {})
    wait_until(lambda: _post(stack, doomed, max_tokens=1).status_code == 200, 10, "the new key to work")
    good = json.loads(keys_path.read_text())
    broken = json.loads(keys_path.read_text())
    broken["keys"][0]["tenant"] = ["open"]
    keys_path.write_text(json.dumps(broken))
    wait_until(lambda: "keys file not reloaded" in stack.log(), 10, "the broken file to be logged")
    assert _post(stack, keys["open"], max_tokens=1).status_code == 200  # the old keys stay
    good["keys"] = [entry for entry in good["keys"] if entry["id"] != key_id]  # the revocation
    keys_path.write_text(json.dumps(good))
    wait_until(lambda: _post(stack, doomed, max_tokens=1).status_code == 401, 10, "the revoked key to be refused")
    assert hash_key(doomed) not in keys_path.read_text()


def test_a_tenant_may_name_only_the_aliases_its_models_list(tmp_path: Path) -> None:
    """`models` lists served model names: a tenant allowed alias-b used to run under alias-a too (any listed name
    opened every name), and saw alias-a's card in /v1/models and /v1/models/alias-a."""
    keys_path = tmp_path / "keys.json"
    key = add_key(keys_path, "narrow", {"models": ["alias-b"]})[1]
    by_path = add_key(keys_path, "by-path", {"models": [MODEL_PATH]})[1]  # the path is the first served name
    stack = start_stack("--api-keys-file", str(keys_path), "--served-model-name", "alias-a,alias-b")
    try:
        auth = {"Authorization": f"Bearer {key}"}
        chat = [{"role": "user", "content": "hi"}]
        for path, body in [("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                           ("/v1/chat/completions", {"messages": chat, "max_tokens": 1}),
                           ("/invocations", {"messages": chat, "max_tokens": 1}),
                           ("/v1/responses", {"input": "hi", "max_output_tokens": 16}),
                           ("/v1/messages", {"messages": chat, "max_tokens": 1}),
                           ("/v1/messages/count_tokens", {"messages": chat}),
                           ("/v1/responses/input_tokens", {"input": "hi"}),
                           ("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})]:
            refused = stack.post(path, {"model": "alias-a", **body}, headers=auth)
            assert refused.status_code == 404 and "model" in refused.text, (path, refused.text)
            served = stack.post(path, {"model": "alias-b", **body}, headers=auth)
            assert served.status_code == 200, (path, served.text)
            assert served.json().get("model", "alias-b") == "alias-b"  # never the alias it may not use
        unknown = stack.post("/v1/completions", {"model": "nope", "prompt": "hi"}, headers=auth)
        assert unknown.status_code == 404 and "alias-a" not in unknown.text and "alias-b" in unknown.text
        hidden = stack.post("/v1/completions", {"model": "alias-a", "prompt": "hi"}, headers=auth)
        assert hidden.text.replace("alias-a", "nope") == unknown.text  # a served name it may not use: no tell
        listed = HTTP.get(stack.url + "/v1/models", headers=auth).json()["data"]
        assert [card["id"] for card in listed] == ["alias-b"]
        assert HTTP.get(stack.url + "/v1/models/alias-a", headers=auth).status_code == 404
        assert HTTP.get(stack.url + "/v1/models/alias-b", headers=auth).status_code == 200
        omitted = stack.post("/v1/completions", {"prompt": "hi", "max_tokens": 1}, headers=auth)
        assert omitted.status_code == 200 and omitted.json()["model"] == "alias-b"
        path_auth = {"Authorization": f"Bearer {by_path}"}
        listed = HTTP.get(stack.url + "/v1/models", headers=path_auth).json()["data"]
        assert [card["id"] for card in listed] == ["alias-a"]
        for name, status in [("alias-a", 200), (MODEL_PATH, 200), ("alias-b", 404)]:
            answer = stack.post("/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 1}, headers=path_auth)
            assert answer.status_code == status, (name, answer.text)
    finally:
        stop_stack(stack)


def _usage_line(usage_path: Path, request_id: str) -> dict:
    """The usage log's line for a request, once written (the api writes it as the request ends)."""
    def line() -> dict | None:
        lines = [json.loads(text) for text in usage_path.read_text().splitlines()] if usage_path.exists() else []
        return next((entry for entry in lines if entry["request_id"] == request_id), None)
    wait_until(lambda: line() is not None, 10, f"the usage line of {request_id}")
    return line()  # type: ignore[return-value]


def _tenant_requests(stack: Stack, tenant: str, status: int) -> float:
    text = HTTP.get(stack.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    return parse_metrics(text).get(f'pagoda_tenant_requests_total{{status="{status}",tenant="{tenant}"}}', 0.0)


def test_a_stream_that_ends_in_an_error_is_logged_with_its_error(qa_stack: tuple) -> None:
    """A stream cut by --request-timeout sends 200 and then an error event: its usage line and the tenant's
    requests_total said 200, as if it had finished, where the same request unstreamed says 408."""
    stack, _, keys_path, usage_path = qa_stack
    key = add_key(keys_path, "streams", {})[1]
    wait_until(lambda: _post(stack, key, max_tokens=1).status_code == 200, 10, "the new key to work")
    response = _post(stack, key, prompt="slow story", max_tokens=400, stream=True)
    assert response.status_code == 200 and '"code":"request_timeout"' in response.text.replace(" ", "")
    request_id = json.loads(response.text.split("data: ", 2)[1].split("\n")[0])["id"]
    line = _usage_line(usage_path, request_id)
    assert line["status"] == 408 and line["tenant"] == "streams" and 0 < line["completion_tokens"] < 400
    assert _tenant_requests(stack, "streams", 408) == 1 and _tenant_requests(stack, "streams", 200) == 1


def test_a_beam_search_is_charged_for_its_beams(qa_stack: tuple) -> None:
    """best_of 64 beams with n 1 runs 64 beams, but only the one returned hypothesis was charged to the tenant's
    tokens_per_minute: a 64th of the engine's work."""
    stack, _, keys_path, usage_path = qa_stack
    key = add_key(keys_path, "beams", {"tokens_per_minute": 100})[1]
    wait_until(lambda: _post(stack, key, "hi", max_tokens=1).status_code == 200, 10, "the new key to work")
    beam = _post(stack, key, "hi", max_tokens=4, use_beam_search=True, best_of=64, n=1)
    assert beam.status_code == 200, beam.text  # type: ignore[attr-defined]
    assert beam.json()["usage"]["completion_tokens"] == 4  # type: ignore[attr-defined]  # what it returned
    refused = _post(stack, key, "hi", max_tokens=1)
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "tokens"  # type: ignore[attr-defined]
    line = _usage_line(usage_path, beam.json()["id"])  # type: ignore[attr-defined]
    assert line["completion_tokens"] == 4 and line["charged_tokens"] == 1 + 64 * 4


@pytest.mark.parametrize("beams", [{"best_of": 8, "n": 1}, {"n": 8}, {"best_of": 8, "n": 8}])
def test_a_beam_search_cut_short_is_charged_its_budget(qa_stack: tuple, beams: dict[str, int]) -> None:
    """A beam search's hypotheses come back only when it ends: one cut by --request-timeout (or a client leaving
    just before the end) was charged its prompt alone, however long its beams had run. With n equal to the beam
    width (vLLM's way: n beams, best_of unset) it still was: only best_of > n was charged for its beams."""
    stack, _, keys_path, usage_path = qa_stack
    tenant = "cut-beams-" + "-".join(f"{name}{value}" for name, value in beams.items())
    key = add_key(keys_path, tenant, {"tokens_per_minute": 1_000_000})[1]
    wait_until(lambda: _post(stack, key, "hi", max_tokens=1).status_code == 200, 10, "the new key to work")
    cut = _post(stack, key, "slow story", max_tokens=400, use_beam_search=True, **beams)
    assert cut.status_code == 408, cut.text  # type: ignore[attr-defined]  # the stack's 3 s request timeout
    lines = [json.loads(line) for line in usage_path.read_text().splitlines()]
    line = next(line for line in reversed(lines) if line["tenant"] == tenant and line["status"] == 408)
    assert line["prompt_tokens"] > 0 and line["charged_tokens"] == line["prompt_tokens"] + 8 * 400


def test_a_client_that_leaves_a_stream_gives_its_concurrency_slot_back(qa_stack: tuple) -> None:
    stack, _, keys_path, usage_path = qa_stack
    key = add_key(keys_path, "leaver", {"max_concurrent": 1})[1]
    wait_until(lambda: _post(stack, key, max_tokens=1).status_code == 200, 10, "the new key to work")
    with HTTP.stream("POST", stack.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=10,
                     json={"model": MODEL, "prompt": "slow story", "max_tokens": 400, "stream": True}) as response:
        lines = response.iter_lines()  # one iterator: closing it (a new one each time) would close the stream
        first = next(line for line in lines if line.startswith("data: "))
        request_id = json.loads(first[len("data: "):])["id"]
        assert _post(stack, key, max_tokens=1).status_code == 429  # the stream holds the only slot
    line = _usage_line(usage_path, request_id)  # written as the api sees the client go
    assert line["status"] == 499 and line["completion_tokens"] < 400
    assert line["charged_tokens"] == line["prompt_tokens"] + line["completion_tokens"]
    assert _post(stack, key, max_tokens=1).status_code == 200  # the slot came back with the line


def test_a_key_revoked_or_tenant_removed_mid_request_ends_cleanly(qa_stack: tuple) -> None:
    """The revoked key is refused from its next request; the request it has in flight runs to its end, is charged to
    its tenant and logged; the tenant, added again under the same name, finds its slot given back."""
    stack, _, keys_path, usage_path = qa_stack
    key_id, key = add_key(keys_path, "removed", {"max_concurrent": 1})
    wait_until(lambda: _post(stack, key, max_tokens=1).status_code == 200, 10, "the new key to work")
    before = json.loads(keys_path.read_text())
    with HTTP.stream("POST", stack.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=10,
                     json={"model": MODEL, "prompt": "slow story", "max_tokens": 60, "stream": True}) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        document = json.loads(keys_path.read_text())
        del document["tenants"]["removed"]
        document["keys"] = [entry for entry in document["keys"] if entry["id"] != key_id]
        keys_path.write_text(json.dumps(document))
        stack.proc.send_signal(1)  # SIGHUP: reloaded at once
        wait_until(lambda: _post(stack, key, max_tokens=1).status_code == 401, 10, "the revoked key to be refused")
        rest = "\n".join(lines)
    assert "[DONE]" in rest and '"error"' not in rest
    line = _usage_line(usage_path, json.loads(first[len("data: "):])["id"])
    assert line["status"] == 200 and line["tenant"] == "removed" and line["completion_tokens"] == 60
    keys_path.write_text(json.dumps(before))  # the tenant and its key again
    stack.proc.send_signal(1)
    wait_until(lambda: _post(stack, key, max_tokens=1).status_code == 200, 10, "the key to work again")


def test_a_keys_file_emptied_then_removed_then_broken_never_stops_the_reloads(tmp_path: Path) -> None:
    """KeyTable took 'no signature and no keys' for start-up: once every key was revoked and the file went missing
    (a deploy that rewrites it), the next broken version raised out of the reload, ending the polling task."""
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": {}, "keys": []}))
    table = KeyTable(str(path))
    path.unlink()
    assert not table.maybe_reload()  # logged: the old (empty) keys stay
    path.write_text("{ not json")
    assert not table.maybe_reload()
    key = add_key(tmp_path / "fresh.json", "back", {})[1]
    (tmp_path / "fresh.json").replace(path)
    assert table.maybe_reload() and table.lookup(key) is not None
    with pytest.raises(ConfigError):
        KeyTable(str(tmp_path / "missing.json"))  # at start-up a missing file is still an error


def test_a_long_request_counts_against_tokens_per_minute_while_it_runs(qa_stack: tuple) -> None:
    """Tokens were charged only when a request ended: a tenant whose stream had used its minute's tokens many times
    over could still start new requests until that stream finished (or for ever, with streams long enough)."""
    stack, _, keys_path, _ = qa_stack
    key = add_key(keys_path, "long", {"tokens_per_minute": 10})[1]
    wait_until(lambda: _post(stack, key, "a", max_tokens=1).status_code == 200, 10, "the new key to work")
    with HTTP.stream("POST", stack.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=10,
                     json={"model": MODEL, "prompt": "slow story", "max_tokens": 400, "stream": True}) as response:
        lines = response.iter_lines()
        num_tokens = 0
        while num_tokens < 12:  # 2 prompt tokens + 12 generated: past the minute's 10 (the api charges, then sends)
            num_tokens += next(lines).startswith("data: ")
        refused = _post(stack, key, "a", max_tokens=1)
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "tokens"  # type: ignore[attr-defined]


def _raw(stack: Stack, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes = b"") -> int:
    """The status of a request written byte by byte (spellings an HTTP client would refuse to send)."""
    import socket

    with socket.create_connection(("127.0.0.1", stack.port), timeout=10) as sock:
        head = b"".join(name + b": " + value + b"\r\n" for name, value in headers)
        sock.sendall(b"%s %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n%s\r\n%s" % (method.encode(), path.encode(), len(body), head, body))
        answer = b""
        while b"\r\n" not in answer and (chunk := sock.recv(4096)):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


def test_key_spellings_and_path_spellings_that_must_not_pass(qa_stack: tuple) -> None:
    """Held: the scheme in any case and spaces around the key pass; anything else, conflicting headers, and
    percent-encoded spellings of protected paths are refused."""
    stack, keys, _, _ = qa_stack
    key = keys["open"].encode()
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    chat = json.dumps({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}).encode()
    auth = b"Authorization"
    for headers, status in [
        ([(auth, b"bearer " + key)], 200), ([(auth, b"BEARER   " + key + b"  ")], 200),
        ([(auth, key)], 401), ([(auth, b"Bearer\t" + key)], 401), ([(auth, b"Basic " + key)], 401),
        ([(auth, b"Bearer " + key + b"x")], 401), ([(auth, b"Bearer " + key[:-1])], 401),
        ([(auth, b"Bearer " + key), (auth, b"Bearer " + API_KEY.encode())], 401),  # two keys: neither
        ([(auth, b"Bearer " + key), (auth, b"Bearer " + key)], 200),
        ([(auth, "Bearer pgk-ключ".encode())], 401), ([(auth, b"Bearer \xff\xfe")], 401),
        ([(b"x-api-key", key)], 401),  # Anthropic's header only under /v1/messages
    ]:
        assert _raw(stack, "POST", "/v1/completions", headers, body) == status, headers
    assert _raw(stack, "POST", "/v1/completions", [(auth, b"Bearer " + b"k" * 20_000)], body) in (400, 431)
    assert _raw(stack, "POST", "/v1/completions", [(auth, b"Bearer " + key + b"\x00")], body) in (400, 401)
    assert _raw(stack, "POST", "/v1/completions", [(auth, b"Bearer \x00" + key)], body) in (400, 401)
    assert _raw(stack, "POST", "/v1/messages", [(b"x-api-key", key)], chat) == 200
    assert _raw(stack, "POST", "/v1/messages", [(b"x-api-key", key), (auth, b"Bearer " + API_KEY.encode())],
                chat) == 401
    for path in ["/%761/completions", "/v1/%63ompletions", "/v1//completions", "/%74okenize", "/%69nvocations",
                 "/%63onsole/api/info", "/console/%61pi/requests", "/%6detrics", "/v1/models/%2e%2e"]:
        method = "POST" if "completions" in path or "tokenize" in path or "invocations" in path else "GET"
        assert _raw(stack, method, path, [], body if method == "POST" else b"") in (401, 404), path


def test_requests_per_minute_covers_the_tokenizer_routes(qa_stack: tuple) -> None:
    """/tokenize, /detokenize, /tokenizer_info and count_tokens make the shared tokenizers work (a chat template, up
    to --max-prompt-bytes of text) but took nothing from requests_per_minute: a tenant held to 2 requests a minute
    could send them without end, slowing every other tenant's prompts."""
    stack, _, keys_path, _ = qa_stack
    key = add_key(keys_path, "tokenizing", {"requests_per_minute": 3})[1]
    auth = {"Authorization": f"Bearer {key}"}
    wait_until(lambda: HTTP.get(stack.url + "/v1/models", headers=auth).status_code == 200, 10, "the key to work")
    assert stack.post("/tokenize", {"model": MODEL, "prompt": "hi"}, headers=auth).status_code == 200
    assert stack.post("/detokenize", {"model": MODEL, "tokens": [1]}, headers=auth).status_code == 200
    counted = stack.post("/v1/messages/count_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                         headers={"x-api-key": key})
    assert counted.status_code == 200, counted.text
    refused = stack.post("/tokenize", {"model": MODEL, "prompt": "hi"}, headers=auth)
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "requests"
    assert 1 <= int(refused.headers["Retry-After"]) <= 20
    assert _post(stack, key, max_tokens=1).status_code == 429  # one bucket for every route
    assert HTTP.get(stack.url + "/v1/models", headers=auth).status_code == 200  # listing models is free


def test_refusals_by_the_tokenizer_are_usage_logged_and_quota_refusals_are_not(qa_stack: tuple) -> None:
    """docs/tenants.md: a request admitted by its tenant's quotas gets a usage line however it ends (a tokenizer's
    400 included, with no tokens); one refused before that (429) only counts in pagoda_tenant_requests_total."""
    stack, _, keys_path, usage_path = qa_stack
    key = add_key(keys_path, "refusals", {"requests_per_minute": 2})[1]
    wait_until(lambda: _post(stack, key, "reject this", max_tokens=1).status_code == 400, 10, "the key to work")
    assert _post(stack, key, "fine", max_tokens=1).status_code == 200
    assert _post(stack, key, "fine", max_tokens=1).status_code == 429
    lines = [json.loads(text) for text in usage_path.read_text().splitlines()]
    mine = [(line["status"], line["charged_tokens"]) for line in lines if line["tenant"] == "refusals"]
    assert mine == [(400, 0), (200, 2)]  # the fake counts a prompt word as a token: 1 + 1 generated
    assert _tenant_requests(stack, "refusals", 429) == 1 and _tenant_requests(stack, "refusals", 400) == 1


@pytest.mark.extended  # test_tenants.py::test_tenant_isolation_salts_every_tenants_requests_with_its_tenant (each
# tenant's own salt forwarded) and test_offline_api.py::test_prompt_dicts_take_vllms_cache_salt (a salt hits only
# its own chain) cover its two halves in the default run, without a server of its own
def test_the_engine_keeps_tenants_cached_prefixes_apart(smollm2_dir: Path, tmp_path: Path) -> None:
    """--prefix-cache-isolation tenant, end to end on SmolLM2: a prompt tenant A sent is cached for A, and tenant B
    (or the operator) sending it learns nothing (cached_tokens 0), whatever cache_salt B sends."""
    from tests.harness import SERVED, running_server

    keys_path = tmp_path / "keys.json"
    key_a, key_b = (add_key(keys_path, name, {})[1] for name in ("a", "b"))
    prompt = "The quick brown fox jumps over the lazy dog. " * 12  # several blocks
    with running_server(smollm2_dir, "--api-keys-file", str(keys_path), "--prefix-cache-isolation", "tenant",
                        "--api-key", "operator") as server:
        def cached(key: str, **body: object) -> int:
            response = HTTP.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                 json={"model": SERVED, "prompt": prompt, "max_tokens": 1, **body}, timeout=120)
            assert response.status_code == 200, response.text
            return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached(key_a) == 0
        assert cached(key_a) > 0  # the control: A's own repeat hits
        assert cached(key_b) == cached(key_b, cache_salt="x") == cached("operator") == 0


def test_the_operator_runs_at_the_weight_and_tier_of_a_default_tenant_that_has_no_key(qa_stack: tuple) -> None:
    """docs/tenants.md: the operator's key runs in the share of a keys-file tenant named default, at its weight and
    tier. Only a tenant some key named was kept, so a file that defines `default` for the operator alone (no key of
    its own, the natural way to give the operator's key a tier) was ignored: weight 1, tier 0."""
    stack, _, keys_path, _ = qa_stack
    document = json.loads(keys_path.read_text())
    document["tenants"]["default"] = {"priority": -1, "weight": 3.0}
    num_loads = stack.log().count("keys file loaded")
    keys_path.write_text(json.dumps(document))
    stack.proc.send_signal(1)  # SIGHUP: reloaded at once

    def forwarded() -> tuple:
        response = _post(stack, API_KEY, max_tokens=1)
        assert response.status_code == 200, response.text  # type: ignore[attr-defined]
        request_id = response.json()["id"]  # type: ignore[attr-defined]
        sent = next(r for r in stack.tokenizer.requests.values() if r.render and r.render.response_id == request_id)
        return sent.tenant, sent.tenant_weight, sent.tenant_priority

    wait_until(lambda: stack.log().count("keys file loaded") > num_loads, 10, "the keys file to be read again")
    assert forwarded() == ("default", 3.0, -1)


def test_headers_that_hold_one_key_in_two_spellings_pass(qa_stack: tuple) -> None:
    """Every Authorization header (and x-api-key under /v1/messages) must hold the same key, but their whole values
    were compared: `bearer KEY` beside `Bearer KEY` (a proxy that adds its own), or beside x-api-key KEY, was a 401,
    though each alone passes. Two different keys are still refused."""
    stack, keys, _, _ = qa_stack
    key = keys["open"].encode()
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    chat = json.dumps({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}).encode()
    auth = b"Authorization"
    assert _raw(stack, "POST", "/v1/completions", [(auth, b"bearer " + key), (auth, b"Bearer  " + key)], body) == 200
    assert _raw(stack, "POST", "/v1/messages", [(auth, b"bearer " + key), (b"x-api-key", key)], chat) == 200
    assert _raw(stack, "POST", "/v1/completions", [(auth, b"bearer " + key), (auth, b"Basic " + key)], body) == 401
    assert _raw(stack, "POST", "/v1/messages", [(auth, b"bearer " + key), (b"x-api-key", key + b"x")], chat) == 401


def test_a_key_id_two_keys_share_is_never_revoked_for_both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Key ids are 8 hex digits of the key's digest: among 10,000 keys two share one about once in a hundred files,
    and a hand-written id may repeat another. `pagoda keys revoke ID` removed every key of that id, another tenant's
    included, and said nothing. Now `keys add` never makes an id the file has, and a revoke naming several keys
    removes none and says so; the sha256 names one."""
    from pagoda.services.api import tenants

    path = tmp_path / "keys.json"
    made = iter(["pgk-first", "pgk-second"])
    monkeypatch.setattr(tenants, "new_key", lambda: next(made))
    taken = hash_key("pgk-first")[:8]
    path.write_text(json.dumps({"tenants": {"other": {}}, "keys": [
        {"id": taken, "sha256": hash_key("pgk-other"), "tenant": "other"}]}))
    key_id, key = add_key(path, "acme", {})
    assert key == "pgk-second" and key_id == hash_key("pgk-second")[:8] != taken
    document = json.loads(path.read_text())
    document["keys"].append({"id": taken, "sha256": hash_key("pgk-third"), "tenant": "acme"})  # hand-written
    path.write_text(json.dumps(document))
    with pytest.raises(ConfigError, match="2 keys"):
        tenants.revoke_key(path, taken)
    assert len(read_keys_file(path)) == 3
    assert tenants.revoke_key(path, hash_key("pgk-third"))
    assert set(read_keys_file(path)) == {hash_key("pgk-other"), hash_key("pgk-second")}


def test_a_request_the_engine_refuses_after_its_prompt_was_charged_costs_nothing(qa_stack: tuple) -> None:
    """The prompt is charged to tokens_per_minute once the tokenizer accepts it, before the scheduler admits it: a
    request the scheduler then refused (503 overloaded, --max-waiting-requests) kept its prompt's charge. Under
    overload every retry of a long prompt drained its tenant's minute (on SmolLM2, 4 refused 101-token prompts: 404
    of a 1000-token minute) until it got 429 for tokens it never used. Given back now, and logged charged 0."""
    stack, _, keys_path, usage_path = qa_stack
    key = add_key(keys_path, "overloaded", {"tokens_per_minute": 10})[1]
    wait_until(lambda: _post(stack, key, "a", max_tokens=1).status_code == 200, 10, "the new key to work")
    refused = _post(stack, key, "overload " * 12, max_tokens=1)  # 12 prompt tokens: past the minute's 10
    assert refused.status_code == 503, refused.text  # type: ignore[attr-defined]
    assert _post(stack, key, "a", max_tokens=1).status_code == 200  # the minute is as it was
    lines = [json.loads(text) for text in usage_path.read_text().splitlines()]
    line = next(line for line in lines if line["tenant"] == "overloaded" and line["status"] == 503)
    assert line["prompt_tokens"] == 12 and line["charged_tokens"] == 0


def test_the_gate_gives_back_a_charge_the_request_ended_below() -> None:
    """QuotaGate.release with fewer tokens than were charged as the request ran gives the difference back (never past
    the bucket's minute); with more, it charges the rest as before."""
    from pagoda.services.api.tenants import QuotaGate, Tenant

    gate, tenant = QuotaGate(), Tenant("t", tokens_per_minute=100)
    lease = gate.admit(tenant, 0.0)
    gate.charge(lease, 150, 0.0)
    gate.release(lease, 0, 0.0)
    assert gate.usage["t"].tokens.level == 100  # type: ignore[union-attr]
    lease = gate.admit(tenant, 0.0)
    gate.charge(lease, 30, 0.0)
    gate.release(lease, 50, 0.0)
    assert gate.usage["t"].tokens.level == 50  # type: ignore[union-attr]


def test_a_tenant_name_with_a_control_character_or_a_space_at_an_end_is_refused() -> None:
    """A tenant's name labels its metrics, usage-log lines and console rows: "acme " (a stray space) was another
    tenant than "acme", and a name holding a newline or an escape passed into all of them."""
    for name in ["acme ", " acme", "ac\nme", "acme\x1b[31m", "\u200facme\u2028"]:
        with pytest.raises(ConfigError, match="control character"):
            parse_keys({"tenants": {name: {}}, "keys": []})
    parse_keys({"tenants": {"acme corp": {}, "équipe-β": {}}, "keys": []})  # spaces inside, any script: fine


def test_keys_file_edits_hold_a_lock_from_read_to_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two `pagoda keys add` at once (a provisioning script) both read the old file and the second write dropped
    the first one's key. An edit holds a lock beside the file from its read to its write: here, a second taker
    trying the lock while the edit has the file read finds it taken, for add and for revoke."""
    import fcntl

    from pagoda.services.api import tenants

    path = tmp_path / "keys.json"
    load = tenants.load_document
    held: list[bool] = []

    def load_and_try_the_lock(at: Path) -> dict:
        with open(tmp_path / ".keys.json.lock", "a") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held.append(True)
            else:
                fcntl.flock(other, fcntl.LOCK_UN)
                held.append(False)
        return load(at)

    monkeypatch.setattr(tenants, "load_document", load_and_try_the_lock)
    key_id, _ = add_key(path, "acme", {})
    assert tenants.revoke_key(path, key_id)
    assert held == [True, True]
    add_key(path, "acme", {})  # the lock was let go: the next edit goes through
    assert len(read_keys_file(path)) == 1
