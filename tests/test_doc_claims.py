"""Claims of the docs (README.md, docs/tenants.md, docs/security.md, docs/operations.md) checked against the api
process, where no other test checks them: tenants' models, the operator's key beside a keys file, what the
per-tenant metrics count. One api process over the fake tokenizer of test_api serves the module."""

from __future__ import annotations

import httpx
import pytest

from pagoda.services.api.tenants import add_key
from pagoda.services.protocol.tools import default_tool_parser
from tests.harness import HTTP, parse_metrics
from tests.test_api import API_KEY, MODEL, MODEL_PATH, Stack, start_stack, stop_stack

REPLY_TIMEOUT_S = 10.0  # an answer the api gives by itself comes at once; the fake tokenizer never answers some asks


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> object:
    folder = tmp_path_factory.mktemp("doc_claims")
    keys_path = folder / "keys.json"
    keys = {
        "other": add_key(keys_path, "other", {"models": ["some-other-model"]})[1],
        # a keys-file tenant that shares its name with the operator's key (docs/tenants.md: "tenant default")
        "default": add_key(keys_path, "default", {"requests_per_minute": 1, "weight": 2.0, "priority": 1})[1],
        "plain": add_key(keys_path, "plain", {})[1],
        "counted": add_key(keys_path, "counted", {})[1],  # test_tenant_requests_count_... alone
    }
    running = start_stack("--api-keys-file", str(keys_path))
    yield running, keys
    stop_stack(running)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _complete(stack: Stack, key: str, **body: object) -> httpx.Response:
    return stack.post("/v1/completions", {"model": MODEL, "prompt": "hello there", "max_tokens": 1, **body},
                      headers=_auth(key))


def test_tokenizer_info_refuses_a_tenant_that_may_not_use_the_model(stack: tuple) -> None:
    """docs/tenants.md: another model is a 404 model_not_found for a tenant. /tokenize, /detokenize and
    /v1/models/{id} said so; /tokenizer_info answered the model's tokenizer and chat template to any tenant."""
    api, keys = stack
    response = HTTP.get(api.url + "/tokenizer_info", headers=_auth(keys["other"]), timeout=REPLY_TIMEOUT_S)
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == "model_not_found"
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        assert api.post(path, body, headers=_auth(keys["other"])).status_code == 404


def test_a_tenant_that_may_not_use_the_model_is_not_told_its_name(stack: tuple) -> None:
    """docs/tenants.md: /v1/models lists only the models a tenant may use. The 404 for a name the server does not
    serve said which one it does (`this server serves ...`), and the 404 of a request that named no model named the
    served one, to tenants that may not use it."""
    api, keys = stack
    refusals = [_complete(api, keys["other"], model="no-such-model"), _complete(api, keys["other"], model=None),
                api.post("/tokenize", {"prompt": "hi"}, headers=_auth(keys["other"])),
                HTTP.get(api.url + "/v1/models/no-such-model", headers=_auth(keys["other"])),
                HTTP.get(api.url + "/tokenizer_info", headers=_auth(keys["other"]), timeout=REPLY_TIMEOUT_S)]
    for response in refusals:
        assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found", response.text
        assert MODEL not in response.text and MODEL_PATH not in response.text, response.text
    # a tenant that may use it is still told what the server serves
    assert MODEL in _complete(api, keys["plain"], model="no-such-model").json()["error"]["message"]


def test_the_operators_key_leaves_a_tenant_named_default_its_own_quota(stack: tuple) -> None:
    """The operator's key (--api-key beside the keys file) is tenant "default" without limits. Its requests went
    through the quota gate under that name: each one dropped the buckets of a keys-file tenant named "default"
    (limits 0: no bucket), which then started the minute again full, and its requests in flight counted against
    that tenant's max_concurrent."""
    api, keys = stack
    assert _complete(api, keys["default"]).status_code == 200  # the tenant's one request of the minute
    for _ in range(2):
        assert _complete(api, API_KEY).status_code == 200  # the operator: no limits
    refused = _complete(api, keys["default"])
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["type"] == "requests"



def test_the_operators_requests_run_in_the_share_of_the_tenant_named_default(stack: tuple) -> None:
    """The operator's key is tenant "default" (docs/tenants.md). Its requests told the scheduler tenant "default"
    had weight 1 and tier 0, and the scheduler's record of a tenant follows its latest request: an operator's request
    rewrote the weight and tier of a keys-file tenant named "default". They now carry that tenant's."""
    api, _ = stack
    response = _complete(api, API_KEY)
    assert response.status_code == 200, response.text
    request_id = response.json()["id"]
    forwarded = next(r for r in api.tokenizer.requests.values() if r.render and r.render.response_id == request_id)
    assert (forwarded.tenant, forwarded.tenant_weight, forwarded.tenant_priority) == ("default", 2.0, 1)


def test_tenant_requests_count_every_answered_generation_request(stack: tuple) -> None:
    """docs/tenants.md: pagoda_tenant_requests_total{tenant, status} counts generation requests answered, by HTTP
    status. Only those that reached the handler's accounting were counted: a tenant's bad bodies, models it may not
    use and unknown models (400, 404) left no trace in its series."""
    api, keys = stack
    assert _complete(api, keys["counted"]).status_code == 200
    assert _complete(api, keys["counted"], n=0).status_code == 400  # refused where the body is decoded
    assert _complete(api, keys["counted"], model="no-such-model").status_code == 404
    headers = _auth(keys["counted"])
    assert api.post("/v1/chat/completions", {"model": MODEL, "messages": [], "max_tokens": 1},
                    headers=headers).status_code == 400
    assert api.post("/tokenize", {"prompt": "hi", "n": 2}, headers=headers).status_code == 400  # not a generation
    metrics = parse_metrics(HTTP.get(api.url + "/metrics", headers=_auth(API_KEY)).text)
    counted = {status: metrics.get(f'pagoda_tenant_requests_total{{status="{status}",tenant="counted"}}')
               for status in ("200", "400", "404")}
    assert counted == {"200": 1, "400": 2, "404": 1}, counted
    assert metrics['pagoda_tenant_prompt_tokens_total{tenant="counted"}'] == 2  # the refused ones carried no tokens


@pytest.mark.parametrize(("route", "extra", "param"), [
    ("/v1/completions", {"guided_choice": ["a", "b"]}, "guided_choice"),
    ("/v1/completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"structured_outputs": {"choice": ["a"]}}, "structured_outputs"),
])
def test_beam_search_refusals_name_the_field_sent(stack: tuple, route: str, extra: dict, param: str) -> None:
    """README: a field pagoda cannot honour is refused with a 400 whose param names it; docs/decoding.md: beam search
    refuses logprobs and structured outputs. Beam search named structured_outputs for a guided_choice or a
    response_format, and logprobs for prompt_logprobs."""
    api, _ = stack
    body = {"model": MODEL, "max_tokens": 1, "use_beam_search": True, "best_of": 2, "temperature": 0, **extra}
    body |= {"prompt": "hi"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    response = api.post(route, body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_the_default_tool_call_parser_follows_the_models_name() -> None:
    """README (as corrected): without --tool-call-parser the api picks the parser by the model's name (its path or
    served name), not by its config's family, which the api process never reads."""
    assert default_tool_parser(["models/Meta-Llama-3.1-8B-Instruct", "llama"]) == "llama3_json"
    assert default_tool_parser(["/m/Mixtral-8x7B-Instruct", "mixtral"]) == "mistral"
    assert default_tool_parser(["models/acme-chat", "acme-chat"]) == "hermes"  # a Llama 3 named otherwise too
    # a Llama 3.1 fine-tune that writes Hermes' <tool_call> format: "hermes" in the name wins
    assert default_tool_parser(["/m/Hermes-3-Llama-3.1-8B", "Hermes-3-Llama-3.1-8B"]) == "hermes"
    for name in ("Ministral-8B-Instruct-2410", "Devstral-Small-2505", "Magistral-Small-2506"):  # not "mistral"
        assert default_tool_parser([f"/m/{name}", name]) == "mistral", name
