"""Tenants at the api: the keys file, quotas (429 + Retry-After), per-tenant metrics, the usage log and reloads,
first as plain objects, then through the api process against the fake tokenizer of test_api."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pagoda.services.api.errors import RateLimitError
from pagoda.services.api.tenants import (
    KeyTable,
    QuotaGate,
    Tenant,
    add_key,
    hash_key,
    parse_keys,
    read_keys_file,
    revoke_key,
    tenant_cache_salt,
)
from pagoda.shared.config import ServerConfig
from pagoda.shared.errors import ConfigError
from tests.harness import HTTP, parse_metrics, wait_until
from tests.test_api import API_KEY, MODEL, Stack, start_stack, stop_stack

# ---------------------------------------------------------------- plain objects


def test_keys_file_is_checked_and_holds_only_hashes(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    key_id, key = add_key(path, "acme", {"max_concurrent": 2, "weight": 2.0, "models": ["m1"]})
    text = path.read_text()
    assert key not in text and hash_key(key) in text  # the key itself is stored nowhere
    assert path.stat().st_mode & 0o777 == 0o600
    found = read_keys_file(path)[hash_key(key)]
    assert found == (key_id, Tenant("acme", ("m1",), max_concurrent=2, weight=2.0))
    _, key2 = add_key(path, "acme", {"requests_per_minute": 60})  # a second key, the tenant's limits updated
    table = read_keys_file(path)
    assert table[hash_key(key)][1] == table[hash_key(key2)][1] and table[hash_key(key2)][1].requests_per_minute == 60
    assert revoke_key(path, key_id) and hash_key(key) not in read_keys_file(path)
    bad_documents = [
        [],
        {"tenants": {"a": {"weight": 0}}, "keys": []},
        {"tenants": {"a": {"max_concurrent": -1}}, "keys": []},
        {"tenants": {"a": {"unknown_field": 1}}, "keys": []},
        {"tenants": {"a": {"models": []}}, "keys": []},
        {"tenants": {}, "keys": [{"id": "x", "sha256": "0" * 64, "tenant": "missing"}]},
        {"tenants": {"a": {}}, "keys": [{"id": "x", "sha256": "not-hex", "tenant": "a"}]},
        {"tenants": {"x" * 200: {}}, "keys": []},
    ]
    for document in bad_documents:
        with pytest.raises(ConfigError):
            parse_keys(document)


def test_quota_gate_concurrency_requests_and_tokens() -> None:
    gate = QuotaGate()
    tenant = Tenant("a", max_concurrent=2, requests_per_minute=3, tokens_per_minute=120)
    first, second = gate.admit(tenant, 0.0), gate.admit(tenant, 0.0)
    with pytest.raises(RateLimitError) as busy:
        gate.admit(tenant, 0.0)
    assert busy.value.http_status == 429 and busy.value.code == "concurrency_limit_exceeded"
    gate.release(first, 100, 0.0)
    gate.release(first, 100, 0.0)  # twice: counted once
    third = gate.admit(tenant, 0.0)  # the third request of the minute
    gate.release(second, 30, 0.0)  # 120 - 130: in debt
    gate.release(third, 0, 0.0)
    with pytest.raises(RateLimitError) as tokens:
        gate.admit(tenant, 0.0)
    assert tokens.value.error_type == "tokens" and tokens.value.retry_after_s == 5  # 10 tokens at 2 per second
    with pytest.raises(RateLimitError) as requests:
        gate.admit(tenant, 5.0)  # the debt refilled, but 3 requests a minute: one more after 20 s
    assert requests.value.error_type == "requests" and requests.value.retry_after_s == 15
    gate.release(gate.admit(tenant, 20.0), 0, 20.0)
    # a quota changed in the file applies at once; 0 lifts it
    gate.admit(Tenant("a", requests_per_minute=0), 20.0)


def test_key_table_reloads_on_change_and_keeps_the_old_keys_when_broken(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    _, key_a = add_key(path, "a", {})
    table = KeyTable(str(path))
    assert table.lookup(key_a) is not None and not table.maybe_reload()
    _, key_b = add_key(path, "b", {})
    assert table.maybe_reload() and table.lookup(key_b) is not None
    path.write_text("{ not json")
    assert not table.maybe_reload()
    assert table.lookup(key_a) is not None and table.lookup(key_b) is not None
    with pytest.raises(ConfigError):
        KeyTable(str(path))  # at start-up a broken file is an error


def test_tenant_cache_salts_keep_tenants_and_their_clients_salts_apart() -> None:
    salts = {tenant_cache_salt(tenant, salt) for tenant in ("acme", "beta", "default") for salt in ("", "x", "y")}
    assert len(salts) == 9
    assert tenant_cache_salt("acme", "x") == tenant_cache_salt("acme", "x")  # stable: in every api process
    assert tenant_cache_salt("a", "bc") != tenant_cache_salt("ab", "c")  # the pair, not its concatenation
    assert len(tenant_cache_salt("t" * 128, "s" * 1024)) < 100  # far within the wire's bound
    with pytest.raises(ConfigError) as caught:
        ServerConfig(prefix_cache_isolation="per-key")
    assert caught.value.param == "prefix_cache_isolation"


# ---------------------------------------------------------------- the api process


@pytest.fixture(scope="module")
def tenant_stack(tmp_path_factory: pytest.TempPathFactory) -> object:
    folder = tmp_path_factory.mktemp("tenants")
    keys_path = folder / "keys.json"
    keys = {
        "one": add_key(keys_path, "one", {"max_concurrent": 1, "weight": 2.0, "priority": 1})[1],
        "rpm": add_key(keys_path, "rpm", {"requests_per_minute": 2})[1],
        "tpm": add_key(keys_path, "tpm", {"tokens_per_minute": 10})[1],
        "other": add_key(keys_path, "other", {"models": ["some-other-model"]})[1],
    }
    usage_path = folder / "usage.jsonl"
    stack = start_stack("--api-keys-file", str(keys_path), "--usage-log", str(usage_path))
    yield stack, keys, keys_path, usage_path
    stop_stack(stack)
    print(stack.log())


def _post(stack: Stack, key: str, prompt: str = "hello there", **body: object) -> object:
    return stack.post("/v1/completions", {"model": MODEL, "prompt": prompt, **body},
                      headers={"Authorization": f"Bearer {key}"})


def test_keys_name_tenants_that_reach_the_tokenizer(tenant_stack: tuple) -> None:
    stack, keys, _, usage_path = tenant_stack
    assert _post(stack, "pgk-unknown").status_code == 401
    assert _post(stack, API_KEY).status_code == 200  # --api-key beside the file: tenant "default"
    response = _post(stack, keys["one"], max_tokens=3)
    assert response.status_code == 200, response.text
    request_id = response.json()["id"]
    forwarded = next(r for r in stack.tokenizer.requests.values() if r.render and r.render.response_id == request_id)
    assert (forwarded.tenant, forwarded.tenant_weight, forwarded.tenant_priority) == ("one", 2.0, 1)
    lines = [json.loads(line) for line in usage_path.read_text().splitlines()]
    record = next(line for line in lines if line["request_id"] == request_id)
    assert record["tenant"] == "one" and record["status"] == 200
    assert record["prompt_tokens"] == 2 and record["completion_tokens"] == 3  # the fake counts words, max_tokens
    assert record["duration_s"] >= record["first_token_s"] >= 0


def _forwarded(stack: Stack, response: object) -> object:
    """The GenerateRequest the api sent the tokenizer for this response."""
    request_id = response.json()["id"]  # type: ignore[attr-defined]
    return next(r for r in stack.tokenizer.requests.values() if r.render and r.render.response_id == request_id)


def test_shared_prefix_cache_passes_the_clients_salt_as_it_is(tenant_stack: tuple) -> None:
    stack, keys, _, _ = tenant_stack
    for key in (keys["one"], API_KEY):
        response = _post(stack, key, max_tokens=1, cache_salt="mine")
        assert response.status_code == 200, response.text
        assert _forwarded(stack, response).cache_salt == "mine"
    assert _forwarded(stack, _post(stack, keys["one"], max_tokens=1)).cache_salt == ""


def test_tenant_isolation_salts_every_tenants_requests_with_its_tenant(tmp_path: Path) -> None:
    """--prefix-cache-isolation tenant: each tenant's requests carry a salt of their own (the client's salt within
    it), so that no tenant shares (or can time) another's cached prompts; the operator's key is tenant default."""
    keys_path = tmp_path / "keys.json"
    keys = {name: add_key(keys_path, name, {})[1] for name in ("acme", "beta")}
    stack = start_stack("--api-keys-file", str(keys_path), "--prefix-cache-isolation", "tenant")
    try:
        def salt_of(key: str, **body: object) -> str:
            response = _post(stack, key, max_tokens=1, **body)
            assert response.status_code == 200, response.text
            return _forwarded(stack, response).cache_salt  # type: ignore[attr-defined]

        assert salt_of(keys["acme"]) == salt_of(keys["acme"]) == tenant_cache_salt("acme", "")
        assert salt_of(keys["beta"]) == tenant_cache_salt("beta", "")
        assert salt_of(keys["acme"], cache_salt="x") == tenant_cache_salt("acme", "x")
        # another tenant naming acme's salt, or a client sending it raw, still gets a chain of its own
        assert salt_of(keys["beta"], cache_salt=tenant_cache_salt("acme", "")) != tenant_cache_salt("acme", "")
        assert salt_of(API_KEY) == tenant_cache_salt("default", "")
        assert _post(stack, keys["acme"], cache_salt="").json()["error"]["param"] == "cache_salt"
    finally:
        stop_stack(stack)


def test_over_quota_is_429_with_retry_after(tenant_stack: tuple) -> None:
    stack, keys, _, _ = tenant_stack
    # concurrency: one slow stream holds the tenant's only slot
    holder = threading.Thread(target=lambda: _post(stack, keys["one"], prompt="slow story", max_tokens=40))
    holder.start()
    wait_until(lambda: any(r.prompt_text == "slow story" for r in stack.tokenizer.requests.values()), 10,
               "the slow request to arrive")
    busy = _post(stack, keys["one"])
    holder.join(30)
    assert busy.status_code == 429 and int(busy.headers["Retry-After"]) >= 1
    assert busy.json()["error"]["code"] == "concurrency_limit_exceeded"
    # requests per minute
    statuses = [_post(stack, keys["rpm"], max_tokens=1).status_code for _ in range(3)]
    assert statuses == [200, 200, 429]
    # tokens per minute (charged when a request ends): 2 prompt + 8 generated = the minute's 10, then in debt
    assert [_post(stack, keys["tpm"]).status_code for _ in range(3)] == [200, 200, 429]
    refused = _post(stack, keys["tpm"])
    error = refused.json()["error"]
    assert refused.status_code == 429 and error["type"] == "tokens" and error["code"] == "rate_limit_exceeded"
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    # beside a keys file /metrics takes the operator's key alone (--metrics-access auto): tenants must not read
    # each other's names and usage there
    for refused in ({}, {"Authorization": f"Bearer {keys['one']}"}):
        response = HTTP.get(stack.url + "/metrics", headers=refused)
        assert response.status_code == 401 and "tenant=" not in response.text
    metrics = parse_metrics(HTTP.get(stack.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text)
    assert metrics['pagoda_tenant_rejections_total{reason="concurrency",tenant="one"}'] == 1
    assert metrics['pagoda_tenant_rejections_total{reason="requests",tenant="rpm"}'] == 1
    assert metrics['pagoda_tenant_rejections_total{reason="tokens",tenant="tpm"}'] == 2
    assert metrics['pagoda_tenant_requests_total{status="200",tenant="tpm"}'] == 2
    assert metrics['pagoda_tenant_prompt_tokens_total{tenant="tpm"}'] == 4
    assert metrics['pagoda_tenant_generation_tokens_total{tenant="tpm"}'] == 16


def test_a_tenant_sees_only_its_models(tenant_stack: tuple) -> None:
    stack, keys, _, _ = tenant_stack
    assert _post(stack, keys["other"]).status_code == 404
    listed = HTTP.get(stack.url + "/v1/models", headers={"Authorization": f"Bearer {keys['other']}"})
    assert listed.status_code == 200 and listed.json()["data"] == []
    listed = HTTP.get(stack.url + "/v1/models", headers={"Authorization": f"Bearer {keys['one']}"})
    assert [card["id"] for card in listed.json()["data"]] == [MODEL]


def test_keys_reload_on_change_and_on_sighup(tenant_stack: tuple) -> None:
    stack, keys, keys_path, _ = tenant_stack
    key_id, fresh = add_key(keys_path, "late", {})
    wait_until(lambda: _post(stack, fresh, max_tokens=1).status_code == 200, 10, "the new key to work")
    assert revoke_key(keys_path, key_id)
    stack.proc.send_signal(signal.SIGHUP)  # at once, without waiting for the file watch
    wait_until(lambda: _post(stack, fresh, max_tokens=1).status_code == 401, 10, "the revoked key to be refused")
    assert stack.proc.poll() is None


def test_keys_cli_prints_the_key_once(tmp_path: Path) -> None:
    path = tmp_path / "k.json"
    out = subprocess.run([sys.executable, "-m", "pagoda.cli", "keys", "add", str(path), "--tenant", "t",
                          "--max-concurrent", "3", "--weight", "0.5"], capture_output=True, text=True, check=True)
    key = out.stdout.strip()
    assert key.startswith("pgk-") and key not in path.read_text()
    assert read_keys_file(path)[hash_key(key)][1] == Tenant("t", max_concurrent=3, weight=0.5)
    bad = subprocess.run([sys.executable, "-m", "pagoda.cli", "keys", "add", str(path), "--tenant", "t",
                          "--weight", "-1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "weight" in bad.stderr


@pytest.mark.parametrize("content", [None, "{broken",
                                     '{"tenants": {}, "keys": [{"id": "x", "sha256": "00", "tenant": "t"}]}'])
def test_serve_and_the_api_process_refuse_a_bad_keys_file_in_one_line(tmp_path: Path, content: str | None,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A missing, non-JSON or inconsistent keys file is the operator's error: `pagoda serve` says so in one line and
    exits 2 before it starts any process (it used to start them all and print the api's traceback, exit 1)."""
    from pagoda.cli import build_parser

    path = tmp_path / "keys.json"
    if content is not None:
        path.write_text(content)
    args = build_parser().parse_args(["serve", "--api-keys-file", str(path), "--runtime-dir", str(tmp_path)])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagoda: error:") and err.count("\n") == 1 and "key" in err, err
    assert not list(tmp_path.glob("*.sock"))  # nothing was started
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")}
    api = subprocess.run([sys.executable, "-m", "pagoda.services.api", "--api-keys-file", str(path),
                          "--runtime-dir", str(tmp_path)], capture_output=True, text=True, timeout=60, env=env)
    assert api.returncode == 2 and "(api_keys_file)" in api.stderr and "Traceback" not in api.stderr, api.stderr


def test_the_console_takes_the_operators_key_not_a_tenants(tenant_stack: tuple) -> None:
    stack, keys, _, _ = tenant_stack
    url = stack.url + "/console/api/info"
    assert HTTP.get(url, headers={"Authorization": f"Bearer {keys['one']}"}).status_code == 401
    assert HTTP.get(url, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_operator_key_is_refused_not_taken_for_no_key(key: str) -> None:
    """`--api-key "$UNSET"` in a script served every route without authentication (the api process read "" as no
    key); the launcher's config refuses it before any process starts."""
    with pytest.raises(ConfigError, match="api-key is empty") as refused:
        ServerConfig(api_key=key)
    assert refused.value.param == "api_key"
    result = subprocess.run([sys.executable, "-m", "pagoda.cli", "serve", "--model", "tiny", "--load-format", "dummy",
                             "--api-key", key], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "api-key is empty" in result.stderr


def test_the_operator_key_loses_surrounding_whitespace() -> None:
    """A key from a secret made with --from-file ends in a newline: compared as given, every request got a 401."""
    assert ServerConfig(api_key="s3cret\n").api_key == "s3cret"


@pytest.mark.parametrize("key", ["two\nlines", "tab\tthen\x00nul", "bell\x07", "del\x7f"])
def test_an_operator_key_no_header_can_carry_is_refused_at_start(key: str, tmp_path: Path) -> None:
    """A key with a line break inside (a key file holding a comment line and the key, two keys) or another control
    character cannot be sent in an HTTP header: the server started and answered every request with 401, the
    operator's included."""
    with pytest.raises(ConfigError, match="control character") as refused:
        ServerConfig(api_key=key)
    assert refused.value.param == "api_key"
    path = tmp_path / "key"
    path.write_text(f"\n{key}\n")
    with pytest.raises(ConfigError, match="control character") as refused:
        ServerConfig(api_key_file=str(path))
    assert refused.value.param == "api_key_file"
    assert ServerConfig(api_key="inner space\tand tab").api_key == "inner space\tand tab"  # a header carries these
