"""Drive a running pagoda with the client libraries people point at OpenAI-compatible servers, end to end.

Not a test (CI installs none of these libraries; tests/test_client_libraries.py holds the bodies they send): a QA
pass that prints one line per check, OK or FAIL, and exits 1 if any failed. A library that is not installed is
skipped. The resolver may hold one library back for another's pins, so give each its own venv:

    for spec in "oa:openai anthropic openai-agents" "lc:langchain-openai" "ll:litellm" "in:instructor" \\
                "pa:pydantic-ai-slim[openai]" "li:llama-index-llms-openai-like"; do
        python3 -m venv /tmp/v_${spec%%:*} && /tmp/v_${spec%%:*}/bin/pip install -q ${spec#*:}
    done
    make run ARGS="--port 8311" &
    for v in /tmp/v_*; do $v/bin/python -P bench/client_libraries.py --base-url http://127.0.0.1:8311/v1; done

Offline, set LITELLM_LOCAL_MODEL_COST_MAP=True: litellm otherwise retries fetching its price list for seconds.

Serve SmolLM2-135M (`make run`): answers are judged for protocol (a call where one is forced, JSON where a schema
is, the library parsing what comes back), not for quality. Tested last with openai 3.63, anthropic 2.17,
openai-agents 0.24, langchain-openai 1.8.1 (langchain-core 1.8.3), litellm 1.110.2, instructor 1.17,
pydantic-ai-slim 2.78, llama-index-llms-openai-like 0.8.1.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import traceback
from collections.abc import Callable
from typing import Any, Literal

MODEL = "smollm2-135m-instruct"
QUESTION = "What is the capital of France?"
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["city"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                         "parameters": PARAMS}}
failures: list[str] = []


def check(name: str, fn: Callable[[], Any], verbose: bool) -> None:
    try:
        out = fn()
        if asyncio.iscoroutine(out):
            out = asyncio.run(out)
        print(f"OK   {name}: {str(out)[:160]}", flush=True)
    except Exception as exc:  # a QA driver reports every failure and goes on
        failures.append(name)
        print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:600]}", flush=True)
        if verbose:
            traceback.print_exc()


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def city_model() -> Any:
    import pydantic

    class City(pydantic.BaseModel):  # no docstring: as a tool's description it set SmolLM2 writing more keys
        city: Literal["Paris", "Rome", "Oslo"]

    return City


def openai_checks(base: str) -> list[tuple[str, Callable[[], Any]]]:
    import openai

    c = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=120)
    City, q = city_model(), [{"role": "user", "content": QUESTION}]

    def stream() -> Any:
        chunks = list(c.chat.completions.create(model=MODEL, messages=q, max_tokens=8, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        assert chunks[-1].usage is not None and chunks[-1].choices == []
        return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)

    def tool_loop() -> Any:
        answer = c.chat.completions.create(model=MODEL, messages=q, tools=[TOOL], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=30, temperature=0)
        message = answer.choices[0].message
        assert message.tool_calls, message
        back = [*q, message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}]
        return c.chat.completions.create(model=MODEL, messages=back, tools=[TOOL], max_tokens=8).choices[0].message

    def cut_short() -> Any:  # a forced call out of tokens is still a call
        choice = c.chat.completions.create(model=MODEL, messages=q, tools=[TOOL], tool_choice="required",
                                           max_tokens=10, temperature=0).choices[0]
        assert choice.message.tool_calls and choice.message.content is None, choice
        return choice.finish_reason

    def embeddings() -> Any:
        try:
            c.embeddings.create(model=MODEL, input="hi")
        except openai.NotFoundError as exc:
            return exc.status_code
        raise AssertionError("embeddings answered")

    def transcription() -> Any:
        try:
            c.audio.transcriptions.create(model=MODEL, file=("a.wav", b"RIFF0000"))
        except openai.NotFoundError as exc:
            return exc.status_code
        raise AssertionError("transcriptions answered")

    def responses_tools() -> Any:
        tool = {"type": "function", "name": "get_weather", "parameters": PARAMS, "strict": True}
        r = c.responses.create(model=MODEL, input=QUESTION, tools=[tool], tool_choice="required",
                               parallel_tool_calls=False, max_output_tokens=30)
        calls = [o for o in r.output if o.type == "function_call"]
        back = [{"role": "user", "content": QUESTION}, *[o.model_dump(exclude_none=True) for o in r.output],
                {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}]
        return c.responses.create(model=MODEL, input=back, tools=[tool], max_output_tokens=8).status

    async def concurrent() -> Any:
        ac = openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0)
        answers = await asyncio.gather(*[ac.chat.completions.create(model=MODEL, messages=q, max_tokens=4)
                                         for _ in range(4)])
        return [a.choices[0].finish_reason for a in answers]

    return [
        ("openai chat", lambda: c.chat.completions.create(model=MODEL, messages=q, max_completion_tokens=8, n=2,
                                                          logprobs=True, top_logprobs=2, stop=["\n"], seed=1,
                                                          user="u", metadata={"k": "v"}, store=False,
                                                          service_tier="auto").choices[1].message.content),
        ("openai chat stream include_usage", stream),
        ("openai tools required, result sent back", tool_loop),
        ("openai required call cut short", cut_short),
        ("openai parse json_schema", lambda: c.chat.completions.parse(
            model=MODEL, messages=q, response_format=City, max_tokens=30, temperature=0).choices[0].message.parsed),
        ("openai parse strict tool", lambda: c.chat.completions.parse(
            model=MODEL, messages=q, tools=[openai.pydantic_function_tool(City)], tool_choice="required",
            parallel_tool_calls=False, max_tokens=30,
            temperature=0).choices[0].message.tool_calls[0].function.parsed_arguments),
        ("openai completions echo logprobs", lambda: c.completions.create(
            model=MODEL, prompt="Hello, my name is", max_tokens=4, echo=True, logprobs=2).choices[0].text),
        ("openai embeddings 404", embeddings),
        ("openai audio transcription 404", transcription),
        ("openai responses parse", lambda: c.responses.parse(
            model=MODEL, input=QUESTION, text_format=City, max_output_tokens=30, temperature=0).output_parsed),
        ("openai responses tools round trip", responses_tools),
        ("openai async concurrent", concurrent),
    ]


def anthropic_checks(base: str) -> list[tuple[str, Callable[[], Any]]]:
    import anthropic

    c = anthropic.Anthropic(base_url=base.removesuffix("/v1"), api_key="x", max_retries=0)
    q, City = [{"role": "user", "content": QUESTION}], city_model()
    tool = {"name": "get_weather", "input_schema": PARAMS}

    def stream() -> Any:
        with c.messages.stream(model=MODEL, max_tokens=8, messages=q) as s:
            return "".join(s.text_stream), s.get_final_message().usage.output_tokens

    def tool_loop() -> Any:
        r = c.messages.create(model=MODEL, max_tokens=30, messages=q, tools=[tool], tool_choice={"type": "any"})
        use = next(b for b in r.content if b.type == "tool_use")
        back = [*q, {"role": "assistant", "content": r.content},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
        return c.messages.create(model=MODEL, max_tokens=8, messages=back, tools=[tool]).stop_reason

    return [("anthropic stream", stream), ("anthropic tool loop", tool_loop),
            ("anthropic parse output_format", lambda: c.messages.parse(
                model=MODEL, max_tokens=30, messages=q, output_format=City).parsed_output),
            ("anthropic count_tokens", lambda: c.messages.count_tokens(model=MODEL, messages=q).input_tokens)]


def agents_checks(base: str) -> list[tuple[str, Callable[[], Any]]]:
    import openai
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    City = city_model()

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    def model(api: str) -> Any:  # a client per check: each runs in its own event loop
        client = openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0)
        return OpenAIChatCompletionsModel(MODEL, client) if api == "chat" else OpenAIResponsesModel(MODEL, client)

    settings = ModelSettings(temperature=0, max_tokens=40)

    async def structured(api: str) -> Any:
        return (await Runner.run(Agent("a", model=model(api), model_settings=settings, output_type=City),
                                 QUESTION)).final_output

    async def streamed(api: str) -> Any:
        run = Runner.run_streamed(Agent("a", model=model(api), model_settings=settings), QUESTION)
        async for _ in run.stream_events():
            pass
        return run.final_output

    async def tool_loop(api: str) -> Any:
        agent = Agent("a", model=model(api), tools=[get_weather], reset_tool_choice=True,
                      model_settings=ModelSettings(temperature=0, max_tokens=40, tool_choice="required"))
        run = await Runner.run(agent, "Weather in Paris?", max_turns=3)
        assert any(item.type == "tool_call_output_item" for item in run.new_items), run.new_items
        return run.final_output

    return [(f"agents {api} {what.__name__}", lambda api=api, what=what: what(api))
            for api in ("chat", "responses") for what in (structured, streamed, tool_loop)]


def langchain_checks(base: str) -> list[tuple[str, Callable[[], Any]]]:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    def llm(**kw: Any) -> Any:
        return ChatOpenAI(model=MODEL, base_url=base, api_key="x", temperature=0, max_tokens=30, max_retries=0,
                          **kw)

    City = city_model()

    def stream_usage() -> Any:
        chunks = list(llm(stream_usage=True).stream(QUESTION))
        return sum(chunks[1:], chunks[0]).usage_metadata

    def tool_loop(responses: bool) -> Any:
        messages: list[Any] = [HumanMessage("What's the weather in Paris?")]
        ai = llm(use_responses_api=responses).bind_tools([get_weather], tool_choice="any").invoke(messages)
        assert ai.tool_calls, ai
        messages += [ai, *[ToolMessage("sunny", tool_call_id=call["id"]) for call in ai.tool_calls]]
        return llm(use_responses_api=responses).bind_tools([get_weather]).invoke(messages).content

    out = [("langchain stream_usage", stream_usage), ("langchain tool loop", lambda: tool_loop(False)),
           ("langchain responses tool loop", lambda: tool_loop(True))]
    for method in ("json_schema", "function_calling", "json_mode"):
        out.append((f"langchain with_structured_output {method}",
                    lambda m=method: llm().with_structured_output(City, method=m, strict=None if m == "json_mode"
                                                                  else True).invoke(QUESTION + " Answer in JSON.")))
    return out


def litellm_checks(base: str) -> list[tuple[str, Callable[[], Any]]]:
    import litellm

    kw = {"api_base": base, "api_key": "x", "num_retries": 0, "temperature": 0, "max_tokens": 30}
    q, City = [{"role": "user", "content": QUESTION}], city_model()

    def stream_tools() -> Any:
        chunks = list(litellm.completion(model="openai/" + MODEL, messages=q, tools=[TOOL], tool_choice="required",
                                         stream=True, **kw))
        return litellm.stream_chunk_builder(chunks).choices[0].message.tool_calls

    def anthropic_bridge() -> Any:  # /v1/messages of an openai/ model becomes a Responses request
        return litellm.anthropic.messages.create(model="openai/" + MODEL, messages=q, max_tokens=16,
                                                 api_base=base, api_key="x")

    return [("litellm response_format pydantic", lambda: litellm.completion(
                model="openai/" + MODEL, messages=q, response_format=City, **kw).choices[0].message.content),
            ("litellm hosted_vllm tools stream", stream_tools),
            ("litellm responses", lambda: litellm.responses(model="openai/" + MODEL, input=QUESTION,
                                                            max_output_tokens=16, api_base=base, api_key="x").status),
            ("litellm anthropic bridge", anthropic_bridge)]


def instructor_checks(base: str) -> list[tuple[str, Callable[[], Any]]]:
    import instructor
    import openai

    raw, City = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=120), city_model()
    q = [{"role": "user", "content": QUESTION + " Answer in JSON."}]
    out = []
    for mode in ("TOOLS", "TOOLS_STRICT", "JSON_SCHEMA"):
        client = instructor.from_openai(raw, mode=getattr(instructor.Mode, mode))
        out.append((f"instructor {mode}", lambda c=client: c.chat.completions.create(
            model=MODEL, messages=q, response_model=City, max_tokens=40, temperature=0, max_retries=0)))
    responses = instructor.from_openai(raw, mode=instructor.Mode.RESPONSES_TOOLS)
    out.append(("instructor RESPONSES_TOOLS", lambda: responses.responses.create(
        model=MODEL, input=QUESTION, response_model=City, max_output_tokens=30, temperature=0, max_retries=0)))
    return out


def pydantic_ai_checks(base: str) -> list[tuple[str, Callable[[], Any]]]:
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.direct import model_request_sync
    from pydantic_ai.messages import ModelRequest
    from pydantic_ai.models import ModelRequestParameters
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings
    from pydantic_ai.tools import ToolDefinition
    from pydantic_ai.usage import UsageLimits

    provider, City = OpenAIProvider(base_url=base, api_key="x"), city_model()
    settings = ModelSettings(temperature=0, max_tokens=30)
    tools = [ToolDefinition(name=n, parameters_json_schema=PARAMS) for n in ("get_weather", "get_time", "other")]
    out = []
    for api, model in (("chat", OpenAIChatModel(MODEL, provider=provider)),
                       ("responses", OpenAIResponsesModel(MODEL, provider=provider))):
        out += [(f"pydantic-ai {api} ToolOutput", lambda m=model: Agent(
                    m, output_type=City, model_settings=settings).run_sync(QUESTION).output),
                (f"pydantic-ai {api} NativeOutput", lambda m=model: Agent(
                    m, output_type=NativeOutput(City), model_settings=settings).run_sync(QUESTION).output),
                (f"pydantic-ai {api} tool_choice of two (allowed_tools)", lambda m=model: model_request_sync(
                    m, [ModelRequest.user_text_prompt("Weather in Paris?")],
                    model_settings=ModelSettings(temperature=0, max_tokens=30, tool_choice=["get_weather", "get_time"]),
                    model_request_parameters=ModelRequestParameters(function_tools=tools)).parts)]
    out.append(("pydantic-ai responses count_tokens_before_request (/v1/responses/input_tokens)", lambda: Agent(
        OpenAIResponsesModel(MODEL, provider=provider), model_settings=settings).run_sync(
            QUESTION, usage_limits=UsageLimits(count_tokens_before_request=True, input_tokens_limit=1000)).usage))
    return out


def llama_index_checks(base: str) -> list[tuple[str, Callable[[], Any]]]:
    from llama_index.core.llms import ChatMessage
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.openai_like import OpenAILike

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    llm = OpenAILike(model=MODEL, api_base=base, api_key="x", is_chat_model=True, is_function_calling_model=True,
                     temperature=0, max_tokens=30, context_window=8192, max_retries=0)
    return [("llama-index stream_chat", lambda: "".join(
                r.delta or "" for r in llm.stream_chat([ChatMessage(role="user", content=QUESTION)]))),
            ("llama-index tool required", lambda: llm.get_tool_calls_from_response(llm.chat_with_tools(
                [FunctionTool.from_defaults(fn=get_weather)], user_msg="Weather in Paris?", tool_required=True))),
            ("llama-index structured", lambda: llm.as_structured_llm(city_model()).chat(
                [ChatMessage(role="user", content=QUESTION)]).raw)]


SUITES = {"openai": openai_checks, "anthropic": anthropic_checks, "agents": agents_checks,
          "langchain_openai": langchain_checks, "litellm": litellm_checks, "instructor": instructor_checks,
          "pydantic_ai": pydantic_ai_checks, "llama_index.llms.openai_like": llama_index_checks}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--only", nargs="*", default=None, help="suites to run (module names above)")
    parser.add_argument("--verbose", action="store_true", help="tracebacks of failures")
    args = parser.parse_args()
    for module, suite in SUITES.items():
        if (args.only and module not in args.only) or not has(module.split(".")[0]) or not has(module):
            continue
        for name, fn in suite(args.base_url):
            check(name, fn, args.verbose)
    print(f"{len(failures)} failed" + (f": {', '.join(failures)}" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
