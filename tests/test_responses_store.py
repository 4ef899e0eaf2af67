"""--responses-store: finished Responses kept for previous_response_id and GET / DELETE /v1/responses/{id} and its
input_items, in a folder two api processes share (each against its own fake tokenizer), per tenant, the oldest
dropped past the count; background responses run on, are read and cancelled from either process, and end in the
store at shutdown. Without the flag the routes answer 404, previous_response_id and background are refused
(tests/test_responses.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import HTTP, wait_until

CAPACITY = 4


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, dict[str, str]]]:
    from pagoda.services.api.tenants import add_key
    from tests.test_api import start_stack, stop_stack

    folder = tmp_path_factory.mktemp("responses-store")
    keys_path = folder / "keys.json"
    keys = {name: add_key(keys_path, name, {})[1] for name in ("one", "two")}
    keys["solo"] = add_key(keys_path, "solo", {"max_concurrent": 1})[1]
    flags = ("--responses-store", str(CAPACITY), "--responses-store-dir", str(folder / "kept"),
             "--api-keys-file", str(keys_path), "--shutdown-grace", "0.1")  # the last test stops one
    first = start_stack(*flags)
    second = start_stack(*flags)
    yield first, second, keys
    stop_stack(first)
    stop_stack(second)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _create(stack: Any, key: str, body: dict[str, Any]) -> dict[str, Any]:
    response = stack.post("/v1/responses", {"max_output_tokens": 3, **body}, headers=_auth(key))
    assert response.status_code == 200, response.text
    return response.json()


def _get(stack: Any, key: str, path: str) -> httpx.Response:
    return HTTP.get(stack.url + path, headers=_auth(key), timeout=10)


def _text(item: dict[str, Any]) -> str:
    content = item["content"]
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def test_a_response_is_read_back_from_another_api_process_by_its_tenant_only(stacks: tuple[Any, Any, dict]) -> None:
    first, second, keys = stacks
    made = _create(first, keys["one"], {"input": "hello there"})
    assert made["previous_response_id"] is None
    read = _get(second, keys["one"], f"/v1/responses/{made['id']}")
    assert read.status_code == 200 and read.json() == made
    assert _get(second, keys["two"], f"/v1/responses/{made['id']}").status_code == 404  # another tenant's
    refused = _get(second, keys["one"], f"/v1/responses/{made['id']}?stream=true")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream"
    cancel = second.post(f"/v1/responses/{made['id']}/cancel", {}, headers=_auth(keys["one"]))
    assert cancel.status_code == 400 and "background" in cancel.json()["error"]["message"]
    for path in ("/v1/responses/resp_nope", "/v1/responses/../keys.json", f"/v1/responses/{'0' * 40}/input_items"):
        assert _get(first, keys["one"], path).status_code == 404, path


def test_previous_response_id_continues_the_conversation(stacks: tuple[Any, Any, dict]) -> None:
    """The next turn's prompt is the earlier input, its answer, then the new input (the earlier instructions are
    not carried, as OpenAI's); input_items lists that conversation; input_tokens counts it."""
    first, second, keys = stacks
    one = keys["one"]
    opening = _create(first, one, {"instructions": "Be brief.", "input": "alpha beta"})
    answer = opening["output"][0]["content"][0]["text"]
    follow = _create(second, one, {"input": [{"role": "user", "content": "gamma delta"}],
                                   "previous_response_id": opening["id"]})
    assert follow["previous_response_id"] == opening["id"]
    sent = second.tokenizer.requests[follow["id"]].messages
    assert [(m.role, m.content) for m in sent] == [("user", "alpha beta"), ("assistant", answer),
                                                   ("user", "gamma delta")]
    third = _create(first, one, {"input": "epsilon", "previous_response_id": follow["id"]})
    assert [m.content for m in first.tokenizer.requests[third["id"]].messages] == [
        "alpha beta", answer, "gamma delta", follow["output"][0]["content"][0]["text"], "epsilon"]

    listed = _get(first, one, f"/v1/responses/{follow['id']}/input_items").json()
    assert [(item["role"], _text(item)) for item in listed["data"]] == [
        ("user", "gamma delta"), ("assistant", answer), ("user", "alpha beta")]  # newest first
    assert listed["has_more"] is False and all(item["id"] for item in listed["data"])
    assert (listed["first_id"], listed["last_id"]) == (listed["data"][0]["id"], listed["data"][-1]["id"])
    ascending = _get(first, one, f"/v1/responses/{follow['id']}/input_items?order=asc&limit=2").json()
    assert [_text(item) for item in ascending["data"]] == ["alpha beta", answer] and ascending["has_more"] is True
    after = _get(first, one, f"/v1/responses/{follow['id']}/input_items?order=asc&after={ascending['last_id']}")
    assert [_text(item) for item in after.json()["data"]] == ["gamma delta"]
    bad = _get(first, one, f"/v1/responses/{follow['id']}/input_items?limit=0")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"

    counted = second.post("/v1/responses/input_tokens", {"input": "zeta", "previous_response_id": follow["id"]},
                          headers=_auth(one))
    whole = [{"role": "user", "content": "alpha beta"}, {"role": "assistant", "content": answer},
             {"role": "user", "content": "gamma delta"},
             {"role": "assistant", "content": follow["output"][0]["content"][0]["text"]},
             {"role": "user", "content": "zeta"}]
    explicit = second.post("/v1/responses/input_tokens", {"input": whole}, headers=_auth(one))
    assert counted.status_code == 200 and counted.json() == explicit.json()


def test_a_refused_item_of_a_continuation_is_named_by_its_place_in_the_clients_input(
        stacks: tuple[Any, Any, dict]) -> None:
    """The conversation puts the previous response's items before the client's input: a 400 about the client's
    input[0] named input[2] (the earlier turn's input and output counted), for a response and its count alike."""
    first, _, keys = stacks
    opening = _create(first, keys["one"], {"input": "hello"})
    orphan = {"input": [{"type": "message", "role": "user", "content": "result:"},
                        {"type": "function_call_output", "call_id": "call_nope", "output": "42"}],
              "previous_response_id": opening["id"]}
    for path in ("/v1/responses", "/v1/responses/input_tokens"):
        refused = first.post(path, orphan, headers=_auth(keys["one"]))
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "input[1].call_id", refused.text


def test_an_item_of_the_previous_response_sent_again_is_a_duplicate(stacks: tuple[Any, Any, dict]) -> None:
    """previous_response_id with the previous output sent again in input (OpenAI's 400 "Duplicate item found"): the
    conversation held that item twice, in the prompt and in input_items, whose `after` then paged back to the id's
    first place (the openai SDK's auto-pagination looped forever)."""
    first, _, keys = stacks
    opening = _create(first, keys["one"], {"input": "hello"})
    again = {"input": [{"role": "user", "content": "more"}, *opening["output"]],
             "previous_response_id": opening["id"]}
    for path in ("/v1/responses", "/v1/responses/input_tokens"):
        refused = first.post(path, again, headers=_auth(keys["one"]))
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "input[1].id" and "Duplicate item" in error["message"], error


def test_unstored_deleted_and_unknown_responses_cannot_be_continued(stacks: tuple[Any, Any, dict]) -> None:
    first, second, keys = stacks
    one, two = keys["one"], keys["two"]
    unstored = _create(first, one, {"input": "hello", "store": False})
    assert _get(second, one, f"/v1/responses/{unstored['id']}").status_code == 404
    kept = _create(first, one, {"input": "hello"})
    for key, previous in ((one, unstored["id"]), (two, kept["id"]), (one, "resp_x")):
        refused = second.post("/v1/responses", {"input": "more", "previous_response_id": previous},
                              headers=_auth(key))
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["param"] == "previous_response_id"
        # OpenAI's code, which clients match to send the whole conversation instead (it was null)
        assert error["code"] == "previous_response_not_found", error
    assert HTTP.delete(second.url + f"/v1/responses/{kept['id']}", headers=_auth(two), timeout=10).status_code == 404
    deleted = HTTP.delete(second.url + f"/v1/responses/{kept['id']}", headers=_auth(one), timeout=10)
    assert deleted.status_code == 200 and deleted.json() == {"id": kept["id"], "object": "response", "deleted": True}
    assert _get(first, one, f"/v1/responses/{kept['id']}").status_code == 404
    assert HTTP.delete(second.url + f"/v1/responses/{kept['id']}", headers=_auth(one), timeout=10).status_code == 404


def test_a_streamed_response_is_kept_before_its_last_event_and_the_oldest_go_past_the_count(
        stacks: tuple[Any, Any, dict]) -> None:
    first, second, keys = stacks
    one = keys["one"]
    with HTTP.stream("POST", first.url + "/v1/responses", headers=_auth(one), timeout=10,
                     json={"input": "streamed words", "max_output_tokens": 3, "stream": True}) as streamed:
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: ")]
        completed = events[-1]["response"]
        # read as soon as the last event arrived: it was kept before that event went out
        assert _get(second, one, f"/v1/responses/{completed['id']}").json() == completed
    made = [_create(first if i % 2 else second, one, {"input": f"turn {i}"})["id"] for i in range(CAPACITY)]
    assert _get(first, one, f"/v1/responses/{completed['id']}").status_code == 404  # the oldest, dropped
    assert all(_get(second, one, f"/v1/responses/{response_id}").status_code == 200 for response_id in made)
    # --responses-store-dir: the stacks' own runtime folders hold none
    assert not any((Path(stack.tmp) / "responses").exists() for stack in (first, second))


def test_the_openai_sdk_continues_reads_lists_and_deletes(stacks: tuple[Any, Any, dict]) -> None:
    """The openai SDK's own calls, its types parsing the answers (the operator's key)."""
    first, second, _ = stacks
    client, other = first.openai(), second.openai()
    opening = client.responses.create(model="smollm2-135m-instruct", input="kappa lambda", max_output_tokens=2)
    follow = other.responses.create(model="smollm2-135m-instruct", input="mu", max_output_tokens=2,
                                    previous_response_id=opening.id)
    assert follow.previous_response_id == opening.id
    assert client.responses.retrieve(follow.id).output_text == follow.output_text
    items = list(other.responses.input_items.list(follow.id, order="asc"))
    assert [item.type for item in items] == ["message", "message", "message"]
    assert [item.content[0].text for item in items] == ["kappa lambda", opening.output_text, "mu"]  # type: ignore
    assert client.responses.delete(follow.id) is None  # the SDK returns nothing for a delete
    assert _get(second, "test-key", f"/v1/responses/{follow.id}").status_code == 404


def _ended(stack: Any, key: str, response_id: str) -> dict[str, Any]:
    """The background response once it has ended (a client polls GET so: there is nothing to wait on)."""
    read: dict[str, Any] = {}

    def ended() -> bool:
        read.update(_get(stack, key, f"/v1/responses/{response_id}").json())
        return read["status"] not in ("queued", "in_progress")
    wait_until(ended, 5.0, f"background response {response_id} to end")
    return read


def _cancel(stack: Any, key: str, response_id: str) -> httpx.Response:
    return stack.post(f"/v1/responses/{response_id}/cancel", {}, headers=_auth(key))


def test_a_background_response_runs_on_and_is_read_from_the_other_api_process(stacks: tuple[Any, Any, dict]) -> None:
    """queued at once; in_progress from either process while the (held) generation runs; then the final object,
    which a cancel answers unchanged; another tenant's id is a 404, and a running one cannot be continued."""
    from tests.test_api import fake_text

    first, second, keys = stacks
    one = keys["one"]
    made = _create(first, one, {"input": "held words", "background": True})
    assert (made["status"], made["background"], made["output"]) == ("queued", True, [])
    running = _get(second, one, f"/v1/responses/{made['id']}")
    assert running.status_code == 200 and running.json()["status"] == "in_progress"  # its prompt was admitted
    assert _get(second, keys["two"], f"/v1/responses/{made['id']}").status_code == 404
    assert _cancel(second, keys["two"], made["id"]).status_code == 404
    early = second.post("/v1/responses", {"input": "more", "previous_response_id": made["id"]}, headers=_auth(one))
    assert early.status_code == 400 and "not finished" in early.json()["error"]["message"]
    first.tokenizer.release(made["id"])
    done = _ended(second, one, made["id"])
    assert (done["status"], done["background"]) == ("incomplete", True)  # max_output_tokens 3
    assert done["output"][0]["content"][0]["text"] == fake_text("held", 0, 3) and done["usage"]["output_tokens"] == 3
    again = _cancel(second, one, made["id"])  # OpenAI's: cancelling one that ended answers its final object
    assert again.status_code == 200 and again.json() == done
    assert made["id"] not in first.tokenizer.aborted


def test_cancel_aborts_a_running_background_response_from_either_api_process(stacks: tuple[Any, Any, dict]) -> None:
    first, second, keys = stacks
    one = keys["one"]
    for owner, canceller in ((first, second), (second, second)):
        made = _create(owner, one, {"input": "held story", "background": True})
        running = HTTP.delete(canceller.url + f"/v1/responses/{made['id']}", headers=_auth(one), timeout=10)
        assert running.status_code == 400 and "cancel it first" in running.json()["error"]["message"]
        cancelled = _cancel(canceller, one, made["id"])
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        # the owner aborts its generation as for a client that left (another process's cancel: its next look)
        aborted, response_id = owner.tokenizer.aborted, made["id"]
        wait_until(lambda: response_id in aborted, 5.0, "the abort of a cancelled response")  # noqa: B023
        for stack in (first, second):
            assert _get(stack, one, f"/v1/responses/{made['id']}").json() == cancelled.json()
        assert _cancel(first, one, made["id"]).json() == cancelled.json()  # idempotent


def test_a_response_cancelled_and_deleted_from_the_other_process_stays_deleted(stacks: tuple[Any, Any, dict]) -> None:
    """A delete right after another process's cancel removed the end the owner looks for: its run went on to the
    end of its tokens and then wrote the response back. The owner takes the deleted record for a cancel."""
    first, second, keys = stacks
    one = keys["one"]
    made = _create(first, one, {"input": "held then deleted", "background": True})
    assert _cancel(second, one, made["id"]).json()["status"] == "cancelled"
    deleted = HTTP.delete(second.url + f"/v1/responses/{made['id']}", headers=_auth(one), timeout=10)
    assert deleted.status_code == 200, deleted.text
    aborted, response_id = first.tokenizer.aborted, made["id"]
    wait_until(lambda: response_id in aborted, 5.0, "the abort of a cancelled, deleted response")
    for stack in (first, second):
        assert _get(stack, one, f"/v1/responses/{made['id']}").status_code == 404


def test_a_background_response_counts_against_its_tenants_concurrency(stacks: tuple[Any, Any, dict]) -> None:
    first, _, keys = stacks
    solo = keys["solo"]  # max_concurrent 1
    made = _create(first, solo, {"input": "held alone", "background": True})
    for background in (True, False):
        refused = first.post("/v1/responses", {"input": "another", "background": background}, headers=_auth(solo))
        assert refused.status_code == 429, refused.text
    assert _cancel(first, solo, made["id"]).json()["status"] == "cancelled"


def test_background_is_refused_unstored_and_so_is_a_stream_of_one_not_streamed(stacks: tuple[Any, Any, dict]) -> None:
    first, _, keys = stacks
    refused = first.post("/v1/responses", {"input": "x", "background": True, "store": False},
                         headers=_auth(keys["one"]))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "background", refused.text
    assert "`store` is true" in refused.json()["error"]["message"]
    plain = _create(first, keys["one"], {"input": "quiet", "background": True})
    for query, param in (("stream=true", "stream"), ("starting_after=1", "starting_after"),
                         ("stream=true&starting_after=x", "starting_after")):
        refused = _get(first, keys["one"], f"/v1/responses/{plain['id']}?{query}")
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, query
    rejected = first.post("/v1/responses", {"input": "reject this", "background": True}, headers=_auth(keys["one"]))
    assert rejected.status_code == 400  # the tokenizer's refusal is the POST's answer: nothing runs, nothing kept
    [response_id] = [rid for rid, g in first.tokenizer.requests.items() if g.messages[-1].content == "reject this"]
    assert _get(first, keys["one"], f"/v1/responses/{response_id}").status_code == 404


def test_a_query_number_is_an_ascii_integer_and_a_parameter_comes_once(stacks: tuple[Any, Any, dict]) -> None:
    """"²" passes str.isdigit and 5,000 digits pass it too, but int() refuses both (each was a 500); a parameter
    given twice would have its second value ignored."""
    from tests.harness import named_events

    first, _, keys = stacks
    streamed = first.post("/v1/responses", {"input": "numbers", "max_output_tokens": 3, "stream": True,
                                            "background": True}, headers=_auth(keys["one"]))
    made = named_events(streamed.content)[-1]["response"]
    many = "9" * 5000
    for path, param in (("?stream=true&starting_after=%C2%B2", "starting_after"),
                        (f"?stream=true&starting_after={many}", "starting_after"),
                        ("?stream=true&starting_after=%D9%A1", "starting_after"),  # an Arabic-Indic 1
                        ("?stream=false&stream=true", "stream"), ("?stream=true&starting_after=1&starting_after=2",
                                                                 "starting_after"),
                        ("/input_items?limit=%C2%B2", "limit"), (f"/input_items?limit={many}", "limit"),
                        ("/input_items?limit=1&limit=2", "limit"), ("/input_items?order=asc&order=desc", "order")):
        refused = _get(first, keys["one"], f"/v1/responses/{made['id']}{path}")
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (path[:60], refused.text)
    assert _get(first, keys["one"], f"/v1/responses/{made['id']}/input_items?limit=1").json()["data"][0]["id"]
    resumed = named_events(_get(first, keys["one"], f"/v1/responses/{made['id']}?stream=true&starting_after="
                                f"{many[:18]}").content)
    assert resumed == []  # past the last event: nothing more


def test_a_streamed_background_response_runs_on_without_its_client_and_resumes_from_the_other_process(
        stacks: tuple[Any, Any, dict]) -> None:
    from tests.harness import named_events
    from tests.test_api import fake_text

    first, second, keys = stacks
    one = keys["one"]
    body = {"input": "streamed words", "max_output_tokens": 3, "stream": True, "background": True}
    with HTTP.stream("POST", first.url + "/v1/responses", headers=_auth(one), json=body, timeout=10) as streamed:
        events = named_events(streamed.read())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [events[0]["type"], events[1]["type"], events[-1]["type"]] == [
        "response.created", "response.in_progress", "response.incomplete"]
    final = events[-1]["response"]
    assert final["background"] is True and final["output"][0]["content"][0]["text"] == fake_text("streamed", 0, 3)
    resumed = _get(second, one, f"/v1/responses/{final['id']}?stream=true&starting_after=2")
    assert named_events(resumed.content) == events[3:]
    assert _get(second, one, f"/v1/responses/{final['id']}").json() == final

    # a client that leaves after the first events: its response runs on, and the other process streams the rest
    with HTTP.stream("POST", first.url + "/v1/responses", headers=_auth(one), json={**body, "input": "held stream"},
                     timeout=10) as streamed:
        lines = streamed.iter_lines()
        opening = next(json.loads(line[6:]) for line in lines if line.startswith("data: ") and "in_progress" in line)
    response_id = opening["response"]["id"]
    first.tokenizer.release(response_id)
    rest = named_events(_get(second, one, f"/v1/responses/{response_id}?stream=true&starting_after=1").content)
    assert rest[0]["sequence_number"] == 2 and rest[-1]["type"] == "response.incomplete"
    assert rest[-1]["response"]["output"][0]["content"][0]["text"] == fake_text("held", 0, 3)
    assert response_id not in first.tokenizer.aborted


def test_the_openai_sdk_creates_retrieves_and_cancels_in_the_background(stacks: tuple[Any, Any, dict]) -> None:
    first, second, _ = stacks
    client, other = first.openai(), second.openai()
    made = client.responses.create(model="smollm2-135m-instruct", input="held sdk", background=True,
                                   max_output_tokens=2)
    assert made.status == "queued" and made.background is True
    assert other.responses.retrieve(made.id).status == "in_progress"
    cancelled = other.responses.cancel(made.id)
    assert cancelled.status == "cancelled" and cancelled.id == made.id
    assert client.responses.retrieve(made.id).status == "cancelled"
    finished = client.responses.create(model="smollm2-135m-instruct", input="quick", background=True,
                                       max_output_tokens=2)
    wait_until(lambda: other.responses.retrieve(finished.id).status == "incomplete", 5.0, "the response to end")
    streamed = list(client.responses.create(model="smollm2-135m-instruct", input="flowing", background=True,
                                            max_output_tokens=2, stream=True))
    assert streamed[-1].type == "response.incomplete" and streamed[-1].response.background is True
    again = list(other.responses.retrieve(streamed[0].response.id, stream=True, starting_after=0))
    assert [event.sequence_number for event in again] == [event.sequence_number for event in streamed[1:]]


def test_a_running_response_whose_api_process_was_killed_reads_failed(stacks: tuple[Any, Any, dict]) -> None:
    """A process killed without its shutdown cannot end its runs: a reader on its host finds the owner gone."""
    import subprocess

    from pagoda.services.api.background import GONE, process_name
    from pagoda.services.api.response_store import ResponseStore, StoredResponse

    first, second, keys = stacks
    args = list(first.proc.args)  # type: ignore[arg-type]
    store = ResponseStore(Path(args[args.index("--responses-store-dir") + 1]), CAPACITY)
    gone = subprocess.Popen(["true"])
    gone.wait()
    response_id = f"resp_{gone.pid:032x}"
    running = {"id": response_id, "object": "response", "status": "in_progress", "background": True, "output": []}
    host = process_name().split(" ")[0]  # this host's (the api's too)
    store.put_running(response_id, StoredResponse("one", running, [], f"{host} {gone.pid} 1"))
    read = _get(second, keys["one"], f"/v1/responses/{response_id}").json()
    assert (read["status"], read["error"]["message"]) == ("failed", GONE)
    assert _cancel(first, keys["one"], response_id).json() == read


def test_a_resumed_stream_whose_api_process_was_killed_ends_with_an_error_event(stacks: tuple[Any, Any, dict]) -> None:
    """A streamed background response whose process was killed mid-run: a reader resuming it from another process
    gets the events logged, then an `error` event saying why it ended (as a run that fails in its own process
    logs), not a stream that stops after a delta with no last event."""
    import subprocess

    from pagoda.services.api.background import GONE, process_name
    from pagoda.services.api.response_store import ResponseStore, StoredResponse

    first, second, keys = stacks
    args = list(first.proc.args)  # type: ignore[arg-type]
    store = ResponseStore(Path(args[args.index("--responses-store-dir") + 1]), CAPACITY)
    gone = subprocess.Popen(["true"])
    gone.wait()
    response_id = f"resp_{gone.pid + 1:032x}"
    running = {"id": response_id, "object": "response", "status": "in_progress", "background": True, "output": []}
    store.put_running(response_id, StoredResponse("one", running, [], f"{process_name().split(' ')[0]} {gone.pid} 1"))
    logged = [{"type": "response.created", "sequence_number": 0, "response": running},
              {"type": "response.output_text.delta", "sequence_number": 1, "delta": "half"}]
    store.append_events(response_id, b"".join(json.dumps(event).encode() + b"\n" for event in logged))
    with HTTP.stream("GET", second.url + f"/v1/responses/{response_id}?stream=true", headers=_auth(keys["one"]),
                     timeout=10) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert [event["sequence_number"] for event in events] == [0, 1, 2]
    assert {k: events[-1][k] for k in ("type", "code", "message")} == {"type": "error", "code": "server_error",
                                                                       "message": GONE}


def test_the_store_reads_only_its_own_ids_keeps_tenants_apart_and_holds_its_count(tmp_path: Path) -> None:
    import asyncio

    from pagoda.services.api.response_store import ResponseStore, StoredResponse

    store = ResponseStore(tmp_path / "kept", capacity=2)
    ids = [f"resp_{i:032x}" for i in range(3)]
    for i, response_id in enumerate(ids):
        store.put_now(response_id, StoredResponse("one", {"id": response_id, "output": [{"n": i}]}, [{"id": "m"}]))
    (tmp_path / "secret.json").write_text('{"tenant": "one", "response": {}, "input_items": []}')

    async def read(response_id: str, tenant: str = "one") -> StoredResponse | None:
        return await store.get(response_id, tenant)

    assert asyncio.run(read(ids[0])) is None  # the oldest, dropped past 2
    kept = asyncio.run(read(ids[2]))
    assert kept is not None and kept.conversation() == [{"id": "m"}, {"n": 2}]
    assert asyncio.run(read(ids[2], "two")) is None
    for hostile in ("../secret", "resp_../../secret", ids[2] + "/..", ids[2].upper()):
        assert asyncio.run(read(hostile)) is None, hostile
    assert not asyncio.run(store.delete(ids[2], "two")) and asyncio.run(store.delete(ids[2], "one"))
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == [f"{ids[1]}.json"]


def test_a_running_background_response_is_not_dropped_past_the_count(tmp_path: Path) -> None:
    """The oldest finished responses go past the count, but not one still running: it read "not found" (no cancel
    could reach it) while its run went on, and its end wrote it back. Nor does a running one count: the store keeps
    the last N finished responses (with N runs going, every response made meanwhile was dropped at once, its
    previous_response_id not found)."""
    import asyncio

    from pagoda.services.api.response_store import ResponseStore, StoredResponse

    store = ResponseStore(tmp_path / "kept", capacity=2)
    running, *done = [f"resp_{i:032x}" for i in range(4)]
    store.put_running(running, StoredResponse("one", {"id": running, "status": "in_progress"}, [], "host 1 1"))
    for response_id in done:
        store.put_now(response_id, StoredResponse("one", {"id": response_id, "status": "completed"}, []))
    kept = asyncio.run(store.get(running, "one"))
    assert kept is not None and kept.response["status"] == "in_progress"
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == sorted(
        f"{rid}.json" for rid in (running, *done[-2:]))
    assert store.end_now(running, StoredResponse("one", {"id": running, "status": "completed"}, [])) is None
    store.put_now(done[0], StoredResponse("one", {"id": done[0], "status": "completed"}, []))
    assert sorted(p.name for p in (tmp_path / "kept").iterdir() if p.suffix == ".json") == sorted(
        f"{rid}.json" for rid in (running, done[0]))  # ended, it is the newest but one


def test_a_running_record_of_the_layout_with_its_owner_last_is_not_dropped(tmp_path: Path) -> None:
    """Records written before the owner came first (a store folder kept across an upgrade) are still told running."""
    from pagoda.services.api.response_store import ResponseStore, StoredResponse

    store = ResponseStore(tmp_path / "kept", capacity=1)
    running = f"resp_{7:032x}"
    (tmp_path / "kept" / f"{running}.json").write_text(json.dumps(
        {"tenant": "one", "response": {"id": running, "status": "in_progress"}, "input_items": [], "owner": "h 1 1"}))
    done = [f"resp_{i:032x}" for i in range(2)]
    for response_id in done:
        store.put_now(response_id, StoredResponse("one", {"id": response_id, "status": "completed"}, []))
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == sorted(f"{rid}.json" for rid in (running, done[1]))


def test_a_deleted_background_response_is_not_written_back(tmp_path: Path) -> None:
    """Cancelled by one process and deleted: the owner's run, which had not seen the cancel, takes the delete for
    one, and its late events and end write nothing back."""
    import asyncio

    from pagoda.services.api.response_store import ResponseStore, StoredResponse

    store = ResponseStore(tmp_path / "kept", capacity=4)
    response_id = f"resp_{9:032x}"
    store.put_running(response_id, StoredResponse("one", {"id": response_id, "status": "in_progress"}, [], "h 1 1"))
    store.append_events(response_id, b'{"type":"response.created","sequence_number":0}\n')
    assert not store.ended(response_id)
    assert store.end_now(response_id, StoredResponse("one", {"id": response_id, "status": "cancelled"}, [])) is None
    assert asyncio.run(store.delete(response_id, "one"))
    assert store.ended(response_id)  # what the owner's watch asks: its run is cancelled
    store.append_events(response_id, b'{"type":"response.completed","sequence_number":1}\n')
    store.end_now(response_id, StoredResponse("one", {"id": response_id, "status": "completed"}, []))
    assert asyncio.run(store.get(response_id, "one")) is None
    assert list((tmp_path / "kept").iterdir()) == []


def test_a_streamed_runs_writes_go_in_order_off_the_event_loop(tmp_path: Path) -> None:
    """A streamed background run's log lines and its end are written on a worker thread, never the event loop's, in
    the order made, the end after the last event (the renderer publishes it first); its readers here see each event
    once it is in the log, and the last once the end is published."""
    import asyncio
    import threading

    from pagoda.services.api.background import BackgroundRuns, Run
    from pagoda.services.api.response_store import ResponseStore, StoredResponse

    store = ResponseStore(tmp_path / "kept", capacity=4)
    response_id = f"resp_{7:032x}"
    writes: list[tuple[str, bytes]] = []
    append_events, end_now = store.append_events, store.end_now

    def appending(rid: str, lines: bytes) -> None:
        writes.append((threading.current_thread().name, lines))
        append_events(rid, lines)

    def ending(rid: str, record: StoredResponse) -> StoredResponse | None:
        writes.append((threading.current_thread().name, b"end"))
        return end_now(rid, record)

    store.append_events, store.end_now = appending, ending  # type: ignore[method-assign]
    types = ["response.created", "response.in_progress", "response.output_text.delta", "response.completed"]
    events = [{"type": kind, "sequence_number": i} for i, kind in enumerate(types)]

    async def main() -> list[bytes]:
        runs = BackgroundRuns(store)
        run = Run(response_id, "one", None, [])  # type: ignore[arg-type]  # the renderer is not used here
        store.put_running(response_id, run.record({"id": response_id, "status": "in_progress"}))
        seen: list[bytes] = []

        async def generate() -> None:
            runs._log(run, events[:2])
            await asyncio.sleep(0)
            runs._log(run, events[2:3])
            runs._publish(run, {"id": response_id, "status": "completed"})  # as closing() does: the end first
            runs._log(run, events[3:])

        async def read() -> None:
            async for data in runs.events(StoredResponse("one", {"id": response_id}, []), -1, run):
                if b"response.completed" in data:
                    found = await store.get(response_id, "one")
                    assert found is not None and found.response["status"] == "completed"
                seen.append(data)

        run.task = asyncio.create_task(runs._run(run, generate))
        await asyncio.gather(run.task, read())
        return seen

    seen = asyncio.run(main())
    assert writes and all(thread != threading.main_thread().name for thread, _ in writes), writes
    assert writes[-1][1] == b"end" and [line for _, lines in writes[:-1] for line in lines.splitlines()] == [
        json.dumps(event, separators=(",", ":")).encode() for event in events]
    assert store.read_events(response_id, 0) == b"".join(lines for _, lines in writes[:-1])
    assert [data.split(b"\n", 1)[0] for data in seen] == [f"event: {kind}".encode() for kind in types]


def test_at_shutdown_a_running_background_response_ends_failed(stacks: tuple[Any, Any, dict]) -> None:
    """Last here: it stops the first api process (its drain's grace, 0.1 s, then every request still running fails)."""
    from tests.test_api import stop_stack

    first, second, keys = stacks
    made = _create(first, keys["one"], {"input": "held forever", "background": True})
    stop_stack(first)
    ended = _get(second, keys["one"], f"/v1/responses/{made['id']}").json()
    assert ended["status"] == "failed" and "shutting down" in ended["error"]["message"], ended
