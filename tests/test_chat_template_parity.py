"""The prompt a chat request renders to equals what vLLM feeds the model: transformers' apply_chat_template over
vLLM's message normalisation (content as a string or as text parts, whichever the template reads; tool call
arguments as objects; reasoning sent back), for templates in the style of the major families, unit-level (the
served path's messages, LLM.chat's) and through /tokenize of a served random-weight model. A template's own
error is a 400 with its message."""

from __future__ import annotations

import copy
import json
import shutil
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagoda.services.protocol.schemas import ChatBody, MessageBody, chat_messages, chat_request, decode_body
from pagoda.services.tokenizer.conversation import arguments_as_text, content_format
from pagoda.services.tokenizer.prompts import check_prompt, generate_prompt, tokenize_prompt, tokenize_result
from pagoda.services.tokenizer.tokenizer import Tokenizer
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import GenerateRequest, ModelInfo, SamplingParams, TokenizeRequest

SMOLLM2 = Path(__file__).resolve().parent.parent / "models" / "smollm2-135m-instruct"

# ------------------------------------------------------------------------------------------------------------
# templates (written for these tests, in the shape of each family's; their lines are as long as the families')
# ruff: noqa: E501


LLAMA31 = """{{- bos_token }}
{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\nToday Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions.\\n\\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
{%- endif %}
{{- system_message }}{{- "<|eot_id|>" }}
{%- if tools_in_user_message and tools is not none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content'] | trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, respond with a JSON function call.\\n\\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
    {{- first_user_message + "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls | length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' }}{{- tool_call.arguments | tojson }}{{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}{{- message.content | tojson }}
        {%- else %}{{- message.content }}{%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
    {%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

MISTRAL = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.last and system_message is defined %}
            {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

# DeepSeek-V3's shape: system prompts gathered first, `content is none` tells a pure tool-call turn, arguments
# written with `~` (their string form), tool outputs grouped.
DEEPSEEK_V3 = """{%- if not add_generation_prompt is defined %}{%- set add_generation_prompt = false %}{%- endif %}
{%- set ns = namespace(is_tool=false, system_prompt='', is_first_sp=true) %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {%- if ns.is_first_sp %}{%- set ns.system_prompt = ns.system_prompt + message['content'] %}{%- set ns.is_first_sp = false %}
        {%- else %}{%- set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}
    {%- endif %}
{%- endfor %}
{{- bos_token }}{{- ns.system_prompt }}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {%- set ns.is_tool = false %}{{- '<｜User｜>' + message['content'] }}
    {%- elif message['role'] == 'assistant' and message['content'] is none %}
        {%- set ns.is_tool = false %}
        {{- '<｜Assistant｜><｜tool▁calls▁begin｜>' }}
        {%- for tool in message['tool_calls'] %}
            {{- '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n```json\\n' ~ tool['function']['arguments'] ~ '\\n```<｜tool▁call▁end｜>' }}
        {%- endfor %}
        {{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}
    {%- elif message['role'] == 'assistant' %}
        {%- if ns.is_tool %}{{- '<｜tool▁outputs▁end｜>' }}{%- set ns.is_tool = false %}{%- endif %}
        {{- '<｜Assistant｜>' + message['content'] }}
        {%- if message['tool_calls'] %}
            {%- for tool in message['tool_calls'] %}
                {{- '<｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' ~ tool['function']['arguments'] ~ '<｜tool▁call▁end｜>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<｜end▁of▁sentence｜>' }}
    {%- elif message['role'] == 'tool' %}
        {%- if not ns.is_tool %}{{- '<｜tool▁outputs▁begin｜>' }}{%- set ns.is_tool = true %}{%- endif %}
        {{- '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}
    {%- endif %}
{%- endfor %}
{%- if ns.is_tool %}{{- '<｜tool▁outputs▁end｜>' }}{%- endif %}
{%- if add_generation_prompt and not ns.is_tool %}{{- '<｜Assistant｜>' }}{%- endif %}
"""

QWEN3 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}{%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}
                {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
                {{- '<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' }}{{- content }}{{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

# Arguments iterated as a mapping (as Hermes-2-Pro/Mistral-style XML templates do): needs them as an object.
ARGS_ITEMS = """{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}
    {%- for call in message.tool_calls or [] %}
        {{- '<call name="' + call.function.name + '">' }}
        {%- for key, value in call.function.arguments.items() %}{{- '<arg name="' + key + '">' ~ value ~ '</arg>' }}{%- endfor %}
        {{- '</call>' }}
    {%- endfor %}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if tools %}{{- '<|im_start|>tools\\n' }}{%- for tool in tools %}{{- tool.function.name + ';' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Content as a list of typed parts (Llama-4 / Gemma-3 / vision-model style): only iterates them.
CONTENT_PARTS = """{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\\n' }}
    {%- for part in message['content'] %}
        {%- if part['type'] == 'text' %}{{- '[' + part['text'] + ']' }}{%- endif %}
    {%- endfor %}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Content rendered by a macro that loops over its argument (Qwen3.5 style: `for item in content`, where `content`
# is the macro's parameter), text parts written back to back: it needs them as parts, as vLLM detects.
CONTENT_MACRO = """{%- macro render_content(content) %}
    {%- if content is string %}{{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for item in content %}
            {%- if 'text' in item %}{{- item.text }}{%- else %}{{- raise_exception('Unexpected item type in content.') }}{%- endif %}
        {%- endfor %}
    {%- elif content is none %}{{- '' }}
    {%- endif %}
{%- endmacro %}
{%- for message in messages %}
    {%- set content = render_content(message.content)|trim %}
    {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Content read as a string straight from messages[0] (a system prompt taken whole).
FIRST_AS_STRING = """{%- set first = messages[0]['content'] %}
{{- '<|im_start|>system\\n' + first + '<|im_end|>\\n' }}
{%- for message in messages[1:] %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Retrieval documents (Command-R / Granite style) and the template's helpers.
DOCUMENTS = """{{- bos_token }}
{%- if documents %}{{- '<|im_start|>documents\\n' }}
    {%- for doc in documents %}{{- 'Document ' ~ loop.index0 ~ ': ' ~ doc.title ~ '\\n' ~ doc.text ~ '\\n' }}{%- endfor %}
    {{- '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant'] %}{{- raise_exception('Unknown role: ' + message.role) }}{%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
{{- eos_token if false else '' }}
"""

# Needs a variable no request carries: strict about an undefined name.
NEEDS_VARIABLE = """{%- for message in messages %}{{- message.content + persona.upper() }}{%- endfor %}"""

TEMPLATES = {"llama31": LLAMA31, "qwen25": QWEN25, "mistral": MISTRAL, "deepseek_v3": DEEPSEEK_V3, "qwen3": QWEN3,
             "args_items": ARGS_ITEMS, "content_parts": CONTENT_PARTS, "content_macro": CONTENT_MACRO,
             "first_as_string": FIRST_AS_STRING, "documents": DOCUMENTS}
TAKES_TOOLS = ("llama31", "qwen25", "qwen3", "args_items")
FIXED = {"date_string": "01 Jan 2025"}  # Llama's date, so that both sides render the same day

# ------------------------------------------------------------------------------------------------------------
# the oracle: vLLM's normalisation (entrypoints/chat_utils), then transformers


def vllm_conversation(messages: list[dict[str, Any]], fmt: str, text_arguments: bool = False) -> list[dict[str, Any]]:
    """What vLLM hands the template: content "" or [] when null, a string of the parts' texts joined by newlines
    ("string") or [{"type": "text", "text": ...}] ("openai"; a tool result is joined back to a string); tool_calls
    of assistants, arguments parsed from JSON ({} when not JSON); `reasoning` as both names. `text_arguments`:
    pagoda's one departure, for a template that joins the arguments as text (DeepSeek's): they stay JSON text (vLLM
    gives an object, which such a template writes as a Python repr, or fails to join with `+`)."""
    out = []
    for message in messages:
        content = message.get("content")
        texts = [] if content is None else [content] if isinstance(content, str) else [p["text"] for p in content]
        if fmt != "openai":  # vLLM leaves empty text parts out before joining
            joined = "\n".join(t for t in texts if t)
        else:  # parts kept; a tool result's joined back to a string, every part's text
            joined = "\n".join(texts) if message["role"] == "tool" else [{"type": "text", "text": t} for t in texts]
        entry = {"role": message["role"], "content": joined}
        if message["role"] == "assistant" and message.get("tool_calls"):
            entry["tool_calls"] = copy.deepcopy(message["tool_calls"])
            for call in entry["tool_calls"] if not text_arguments else []:
                try:
                    call["function"]["arguments"] = json.loads(call["function"]["arguments"])
                except json.JSONDecodeError:
                    call["function"]["arguments"] = {}
        if message["role"] == "assistant" and message.get("reasoning") is not None:
            entry["reasoning"] = entry["reasoning_content"] = message["reasoning"]
        for key in ("tool_call_id", "name"):
            if key in message:
                entry[key] = message[key]
        out.append(entry)
    return out


@cache
def hf_tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(SMOLLM2)


def oracle_text(template: str, messages: list[dict[str, Any]], fmt: str, tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                **kwargs: Any) -> str:
    text = hf_tokenizer().apply_chat_template(
        vllm_conversation(messages, fmt, arguments_as_text(template)), chat_template=template, tools=tools,
        tokenize=False,
        add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message, **kwargs)
    assert isinstance(text, str)
    return text


def oracle_ids(text: str) -> list[int]:
    return hf_tokenizer().encode(text, add_special_tokens=False)  # the template writes the special tokens


# ------------------------------------------------------------------------------------------------------------
# pagoda's side: a tokenizer folder per template; the served path (request body -> ChatMessage -> prompt) and
# LLM.chat's (Tokenizer.render_chat over the messages as given)


def tokenizer_folder(root: Path, template: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SMOLLM2 / name, root / name)
    (root / "chat_template.jinja").write_text(template)
    return root


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("templates")
    return {name: Tokenizer(tokenizer_folder(root / name, template)) for name, template in TEMPLATES.items()}


def served(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
           add_generation_prompt: bool = True, continue_final_message: bool = False,
           **kwargs: Any) -> tuple[str | None, list[int]]:
    """The prompt of a chat request whose body carries these messages (schemas -> prompts, as the server's)."""
    bodies = [msgspec.convert(m, MessageBody) for m in messages]
    prompt = tokenize_prompt(tokenizer, prompt_text=None, prompt_token_ids=None, messages=chat_messages(bodies),
                             add_generation_prompt=add_generation_prompt,
                             continue_final_message=continue_final_message, chat_template_kwargs=kwargs or None,
                             tools=tools)
    return prompt.text, prompt.token_ids


def offline(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
            add_generation_prompt: bool = True, continue_final_message: bool = False, **kwargs: Any) -> str:
    """LLM.chat's text (it renders the messages as given with render_chat)."""
    return tokenizer.render_chat(copy.deepcopy(messages), add_generation_prompt, tools, continue_final_message,
                                 kwargs or None)


def assert_parity(name: str, tokenizer: Tokenizer, messages: list[dict[str, Any]], **options: Any) -> str:
    template = TEMPLATES[name]
    want = oracle_text(template, messages, content_format(template), **options)
    text, ids = served(tokenizer, messages, **options)
    assert text == want, name
    assert ids == oracle_ids(want), name
    assert offline(tokenizer, messages, **options) == want, name
    return want


# ------------------------------------------------------------------------------------------------------------
# conversations

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string"},
                                                                         "days": {"type": "integer"}}}}}]


def call(arguments: str = '{"city": "Oslo", "days": 2}', call_id: str = "call_1") -> dict[str, Any]:
    """An assistant's tool call as OpenAI clients send it back: arguments as JSON text."""
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def tool_turns(arguments: str = '{"city": "Oslo", "days": 2}', content: str | None = None,
               result: Any = "sunny, 21 C") -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You check the weather."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": content, "tool_calls": [call(arguments)]},
            {"role": "tool", "tool_call_id": "call_1", "content": result}]


PLAIN_CASES = {
    "user": ([{"role": "user", "content": "Hi"}], {}),
    "system_and_turns": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello! "}, {"role": "user", "content": " Bye\n"}], {}),
    "text_parts": ([{"role": "system", "content": [{"type": "text", "text": "Be brief."},
                                                   {"type": "text", "text": "Answer in French."}]},
                    {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}],
                   {}),
    "empty_text_parts": ([{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": ""},
                                                        {"type": "text", "text": "two"}, {"type": "text", "text": ""}]}],
                         {}),
    "no_generation_prompt": ([{"role": "user", "content": "Hi"}], {"add_generation_prompt": False}),
    "continue_final_message": ([{"role": "user", "content": "Tell a story"},
                                {"role": "assistant", "content": "Once upon a"}],
                               {"add_generation_prompt": False, "continue_final_message": True}),
    "kwargs": ([{"role": "user", "content": "Hi"}], {"enable_thinking": False, "tools_in_user_message": False}),
}


@pytest.mark.parametrize("case", PLAIN_CASES)
@pytest.mark.parametrize("name", TEMPLATES)
def test_plain_turns_render_as_transformers(tokenizers: dict[str, Tokenizer], name: str, case: str) -> None:
    """Plain turns, system prompts, text parts (joined, or kept as parts for a template that loops over them),
    continue_final_message and chat_template_kwargs: the same text and ids on the served path and LLM.chat's."""
    messages, options = PLAIN_CASES[case]
    assert_parity(name, tokenizers[name], messages, **FIXED, **options)


TOOL_CASES = {
    "definitions": ([{"role": "user", "content": "Weather in Oslo?"}], True),
    "call_without_content": (tool_turns(), True),
    "call_with_content": (tool_turns(content="Let me check."), True),
    "empty_arguments": (tool_turns(arguments=""), True),
    "arguments_not_json": (tool_turns(arguments="{city: Oslo"), True),
    "result_as_parts": (tool_turns(result=[{"type": "text", "text": "sunny"}, {"type": "text", "text": "21 C"}]),
                        True),
    "result_with_empty_parts": (tool_turns(result=[{"type": "text", "text": "sunny"}, {"type": "text", "text": ""},
                                                   {"type": "text", "text": "21 C"}]), True),
    "history_without_definitions": (tool_turns(), False),
}


@pytest.mark.parametrize("case", TOOL_CASES)
@pytest.mark.parametrize("name", TAKES_TOOLS)
def test_tool_conversations_render_as_transformers(tokenizers: dict[str, Tokenizer], name: str, case: str) -> None:
    """Tool definitions, assistant tool calls (arguments sent as JSON text, as OpenAI clients send them back;
    empty or not JSON: {} as vLLM's), tool results (text parts joined), for templates that take tools: `tojson` of
    the arguments (Llama, Qwen) and a loop over their items."""
    messages, with_tools = TOOL_CASES[case]
    if name == "llama31":  # its tools go in the first user turn: no system turn before it for the tool list
        messages = [m for m in messages if m["role"] != "system"]
    assert_parity(name, tokenizers[name], messages, tools=TOOLS if with_tools else None, **FIXED)


def test_a_template_that_loops_over_content_parts_gets_parts(tokenizers: dict[str, Tokenizer]) -> None:
    """vLLM's "openai" content format: a template that reads `for part in message['content']` gets text parts
    (a string's characters before: every turn rendered empty); one reading content as a string gets it joined."""
    assert content_format(CONTENT_PARTS) == "openai"
    assert {content_format(TEMPLATES[n]) for n in TEMPLATES if n not in ("content_parts", "content_macro")} == {"string"}
    aliased = "{% set turns = messages | list %}{% for m in turns %}{% for p in m.content %}{% endfor %}{% endfor %}"
    assert content_format(aliased) == "openai"
    messages = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
                {"role": "assistant", "content": "three"}]
    text = assert_parity("content_parts", tokenizers["content_parts"], messages)
    assert "[one][two]" in text and "[three]" in text


def test_a_template_that_loops_over_content_in_a_macro_gets_parts(tokenizers: dict[str, Tokenizer]) -> None:
    """Qwen3.5's templates render content with a macro that loops `for item in content` (its parameter): vLLM's
    detection reads that loop too, so such a template gets text parts and writes them back to back, as
    transformers does with the parts sent (joined by newlines first, they were rendered "one\\ntwo")."""
    assert content_format(CONTENT_MACRO) == "openai"
    messages = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    text = assert_parity("content_macro", tokenizers["content_macro"], messages)
    assert "<|im_start|>user\nonetwo<|im_end|>" in text
    raw = hf_tokenizer().apply_chat_template(messages, chat_template=CONTENT_MACRO, tokenize=False,
                                             add_generation_prompt=True)
    assert text == raw


def test_empty_text_parts_are_left_out_of_the_tool_turns_pagoda_writes(tokenizers: dict[str, Tokenizer]) -> None:
    """A template that takes no tools gets the tool turns as text (tools.hermes_messages): a result sent as parts
    with empty ones reads as the parts joined without them, as a text template reads any turn's parts (vLLM's)."""
    parts = [{"type": "text", "text": "sunny"}, {"type": "text", "text": ""}, {"type": "text", "text": "21 C"}]
    plain = tokenizers["mistral"]  # no tools argument: the turns become Hermes text
    assert served(plain, tool_turns(result=parts), tools=TOOLS) == served(plain, tool_turns(result="sunny\n21 C"),
                                                                         tools=TOOLS)


# A template that knows the developer role (as gpt-oss's and OpenAI-era templates do): it writes the turn itself.
KNOWS_DEVELOPER = """{%- for message in messages %}
    {%- if message.role == 'developer' %}{{- '<|im_start|>developer\\n# Instructions\\n' + message.content + '<|im_end|>\\n' }}
    {%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def vllm_developer(messages: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """vLLM's developer turns, for a template whose text never names the role: each becomes a system turn, and
    then the system turns are merged into one, first, their texts joined by a blank line (where one stood after
    another turn, or there were several)."""
    if "'developer'" in template or '"developer"' in template or all(m["role"] != "developer" for m in messages):
        return messages
    turns = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    systems = [i for i, m in enumerate(turns) if m["role"] == "system"]
    if systems == [0]:
        return turns
    merged = {"role": "system", "content": "\n\n".join(turns[i]["content"] for i in systems if turns[i]["content"])}
    return [merged, *(m for m in turns if m["role"] != "system")]


DEVELOPER_CASES = {
    "first": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "after_system": [{"role": "system", "content": "You are Ada."}, {"role": "developer", "content": "Be brief."},
                     {"role": "user", "content": "Hi"}],
    "mid_conversation": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                         {"role": "developer", "content": "Now in French."}, {"role": "user", "content": "Bye"}],
}


@pytest.mark.parametrize("case", DEVELOPER_CASES)
@pytest.mark.parametrize("name", ["qwen3", "mistral", "knows_developer"])
def test_developer_turns_reach_the_template_as_vllm_gives_them(tmp_path: Path, name: str, case: str) -> None:
    """vLLM's: a template that names the developer role gets the turn as it is; any other gets it as a system turn,
    the system turns merged into one at the start (a system turn after the first, which Qwen3.5's and Mistral's
    templates refuse, was a 400; a developer turn after a system prompt was a second system turn). The served path
    and LLM.chat's render the same."""
    template = KNOWS_DEVELOPER if name == "knows_developer" else TEMPLATES[name]
    tokenizer = Tokenizer(tokenizer_folder(tmp_path / name, template))
    messages = DEVELOPER_CASES[case]
    want = hf_tokenizer().apply_chat_template(vllm_developer(messages, template), chat_template=template,
                                              tokenize=False, add_generation_prompt=True)
    text, ids = served(tokenizer, messages)
    assert text == want
    assert ids == oracle_ids(want)
    assert offline(tokenizer, messages) == want
    assert ("<|im_start|>developer" in want) is (name == "knows_developer")


@pytest.mark.parametrize("case", ["after_system", "mid_conversation"])
def test_merged_system_turn_reaches_a_parts_template_as_parts(tmp_path: Path, case: str) -> None:
    """A template that loops over a turn's content parts got the merged system turn as one string in LLM.chat,
    whose messages are turned into parts before the developer turns are merged: the loop read the string's
    characters and wrote an empty system block, the instructions gone (vLLM's own bug, its PR 56391). The merged
    turn is one text part there; the served path and LLM.chat render alike."""
    tokenizer = Tokenizer(tokenizer_folder(tmp_path / "parts", CONTENT_PARTS))
    messages = DEVELOPER_CASES[case]
    text, _ = served(tokenizer, messages)
    assert offline(tokenizer, messages) == text
    instructions = "\n\n".join(m["content"] for m in messages if m["role"] in ("system", "developer"))
    assert text.startswith(f"<|im_start|>system\n[{instructions}]<|im_end|>\n")


def test_llm_chat_parses_tool_call_arguments(tokenizers: dict[str, Tokenizer]) -> None:
    """LLM.chat's messages as OpenAI clients write them (arguments as JSON text, null content beside tool calls)
    render as vLLM's LLM.chat renders them: arguments as objects, content "" (they were given to the template
    as sent: a loop over `arguments.items()` failed, `tojson` quoted the text, `content is none` held)."""
    messages = tool_turns()
    for name in ("args_items", "llama31", "deepseek_v3"):
        template = TEMPLATES[name]
        want = oracle_text(template, messages, "string", tools=TOOLS, **FIXED)
        assert offline(tokenizers[name], messages, tools=TOOLS, **FIXED) == want, name
    assert '<arg name="city">Oslo</arg>' in offline(tokenizers["args_items"], messages)


@pytest.mark.parametrize("arguments", ['{"n": ' + "9" * 5000 + "}", "[" * 5000 + "]" * 5000])
def test_tool_call_arguments_python_cannot_read_are_an_empty_object(tokenizers: dict[str, Tokenizer],
                                                                     arguments: str) -> None:
    """Arguments that are JSON Python's reader refuses, an integer past its 4300 digits (a forced call's unbounded
    integer, which the model writes until max_tokens) or arrays nested past the recursion limit: {} as for text
    that is no JSON. They were a 400 naming messages ("cannot tokenize the messages: Exceeds the limit (4300
    digits) ... use sys.set_int_max_str_digits()"): a tool loop could not go on past the server's own answer."""
    want = oracle_text(TEMPLATES["args_items"], tool_turns("{}"), "string", tools=TOOLS)
    assert served(tokenizers["args_items"], tool_turns(arguments), tools=TOOLS)[0] == want
    assert offline(tokenizers["args_items"], tool_turns(arguments), tools=TOOLS) == want


def test_reasoning_sent_back_reaches_the_template(tokenizers: dict[str, Tokenizer]) -> None:
    """An earlier answer's reasoning (vLLM's `reasoning`, or `reasoning_content`) is the template's to render:
    Qwen3's keeps it for the turns of a tool loop after the last user question."""
    for key in ("reasoning", "reasoning_content"):
        messages = tool_turns()
        messages[2] = {**messages[2], key: "I should look it up."}
        oracle_messages = [{("reasoning" if k == key else k): v for k, v in m.items()} for m in messages]
        want = oracle_text(QWEN3, oracle_messages, "string", tools=TOOLS)
        assert "<think>\nI should look it up.\n</think>" in want
        assert served(tokenizers["qwen3"], messages, tools=TOOLS)[0] == want, key
        assert offline(tokenizers["qwen3"], messages, tools=TOOLS) == want, key
        if key == "reasoning_content":  # beside a null `reasoning` (what an SDK's dump of the message carries)
            messages[2] = {**messages[2], "reasoning": None}
            assert served(tokenizers["qwen3"], messages, tools=TOOLS)[0] == want
            assert offline(tokenizers["qwen3"], messages, tools=TOOLS) == want


def test_a_template_that_writes_tool_calls_keeps_its_own_turns(tokenizers: dict[str, Tokenizer]) -> None:
    """A template that renders assistant tool calls and tool results but takes no tool list (DeepSeek-V3's) gets
    the tool turns as they are (they were rewritten as Hermes text); only a tool list goes into the system prompt, as
    DeepSeek's "## Tools" block asking for the call form the template writes (tools.deepseek_tools_prompt)."""
    tokenizer = tokenizers["deepseek_v3"]
    messages = tool_turns()
    want = oracle_text(DEEPSEEK_V3, messages, "string")
    assert served(tokenizer, messages)[0] == want
    assert 'get_weather<｜tool▁sep｜>{"city": "Oslo", "days": 2}' in want  # JSON text, as the model wrote it
    with_tools = served(tokenizer, messages, tools=TOOLS)[0]
    assert with_tools is not None and "## Tools" in with_tools and "<｜tool▁outputs▁begin｜>" in with_tools
    assert with_tools.endswith(want.split("You check the weather.", 1)[1])


@pytest.mark.parametrize(("parser", "listing"), [("", "## Tools"), ("deepseek_v3", "## Tools"),
                                                 ("deepseek_v31", "## Tools"), ("hermes", "<tools>"),
                                                 ("qwen3_coder", "<tools>")])
def test_a_deepseek_template_lists_tools_for_the_requests_parser(tokenizers: dict[str, Tokenizer], parser: str,
                                                               listing: str) -> None:
    """A DeepSeek template takes no tool list, so the tokenizer writes one: DeepSeek's, asking for the calls its
    parsers read, unless the request's parser is another (`--tool-call-parser hermes` on a DeepSeek model, which
    read nothing of the DeepSeek calls it asked for): then the Hermes list that parser reads. The same on /tokenize
    (TokenizeRequest) and in generation (GenerateRequest), which carry the api's parser."""
    messages = chat_messages([msgspec.convert(m, MessageBody) for m in tool_turns()])
    generate = GenerateRequest("r", SamplingParams(), messages=messages, tools=TOOLS, tool_parser=parser)
    count = TokenizeRequest("t", messages=messages, tools=TOOLS, tool_parser=parser)
    info = ModelInfo(max_model_len=4096, vocab_size=49152, max_num_tokens=4096, eos_token_ids=[2])
    text = generate_prompt(tokenizers["deepseek_v3"], generate, info).text
    assert text is not None and listing in text and ("## Tools" in text) != ("<tools>" in text)
    assert tokenize_result(tokenizers["deepseek_v3"], count, 4096).token_ids == oracle_ids(text)


# DeepSeek-V3.1's shape: the arguments joined with `+` (an object there cannot be joined to a string)
DEEPSEEK_V31_CALLS = """{%- for message in messages %}
    {%- if message['role'] == 'user' %}{{- '<｜User｜>' + message['content'] + '<｜Assistant｜>' }}
    {%- elif message['role'] == 'assistant' and message['tool_calls'] is defined %}
        {%- for tool in message['tool_calls'] %}
            {%- if message['content'] is none %}{{- '<｜tool▁call▁begin｜>' + tool['function']['name'] }}
            {%- else %}{{- message['content'] + '<｜tool▁call▁begin｜>' + tool['function']['name'] }}{%- endif %}
            {{- '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>' }}
        {%- endfor %}{{- '<｜end▁of▁sentence｜>' }}
    {%- elif message['role'] == 'tool' %}{{- '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}
    {%- endif %}
{%- endfor %}"""


def test_a_template_that_joins_arguments_as_text_gets_json_text(tmp_path: Path) -> None:
    """DeepSeek's templates join `tool['function']['arguments']` to strings: given an object (vLLM's normalisation)
    the second turn of every tool loop failed ("can only concatenate str (not "dict") to str"). They get the JSON
    text; templates that `tojson` the arguments or loop over their items still get an object."""
    assert arguments_as_text(DEEPSEEK_V31_CALLS) and arguments_as_text(DEEPSEEK_V3)
    assert not any(arguments_as_text(TEMPLATES[name]) for name in ("llama31", "qwen25", "qwen3", "args_items"))
    tokenizer = Tokenizer(tokenizer_folder(tmp_path / "v31", DEEPSEEK_V31_CALLS))
    for arguments in ('{"city": "Oslo", "days": 2}', "{city: Oslo"):  # not JSON: as sent, the model's own text
        text, _ = served(tokenizer, tool_turns(arguments=arguments)[1:])
        assert text == (f"<｜User｜>Weather in Oslo?<｜Assistant｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                        f"{arguments}<｜tool▁call▁end｜><｜end▁of▁sentence｜><｜tool▁output▁begin｜>sunny, 21 C"
                        "<｜tool▁output▁end｜>")
        assert offline(tokenizer, tool_turns(arguments=arguments)[1:]) == text


TEMPLATE_ERRORS = [
    ("mistral", [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Hi"}], {},
     "conversation roles must alternate"),
    ("llama31", [{"role": "user", "content": "Hi"},
                 {"role": "assistant", "content": None, "tool_calls": [call(), call(call_id="call_2")]}],
     {"tools": TOOLS}, "only supports single tool-calls"),
]


@pytest.mark.parametrize("case", range(len(TEMPLATE_ERRORS)))
def test_a_template_error_is_the_requests_with_its_message(tokenizers: dict[str, Tokenizer], case: int) -> None:
    """raise_exception (and a variable the template needs and no request passes) is an InvalidRequestError (a
    400 naming messages) carrying the template's own words, on both paths."""
    name, messages, options, words = TEMPLATE_ERRORS[case]
    for render in (served, offline):
        with pytest.raises(InvalidRequestError) as caught:
            render(tokenizers[name], messages, **options)
        assert words in str(caught.value) and caught.value.param == "messages", render


def test_a_template_that_renders_nothing_is_a_400_that_says_so(tmp_path: Path) -> None:
    """A template that writes nothing for these messages leaves no prompt: the 400 names messages and says the
    template made an empty prompt of them (it said "the messages is empty" of a request whose messages were not)."""
    tokenizer = Tokenizer(tokenizer_folder(tmp_path / "silent", "{%- if false %}x{%- endif %}"))
    text, ids = served(tokenizer, [{"role": "user", "content": "Hi"}])
    assert (text, ids) == ("", [])
    with pytest.raises(InvalidRequestError) as caught:
        check_prompt(ids, SamplingParams(), INFO, "messages")
    assert caught.value.param == "messages"
    assert "the chat template rendered the messages as an empty prompt" in caught.value.message


def test_a_variable_the_template_needs_comes_from_chat_template_kwargs(tmp_path: Path) -> None:
    tokenizer = Tokenizer(tokenizer_folder(tmp_path / "needs", NEEDS_VARIABLE))
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(InvalidRequestError, match="'persona' is undefined"):
        served(tokenizer, messages)
    want = oracle_text(NEEDS_VARIABLE, messages, "string", add_generation_prompt=True, persona="pirate")
    assert served(tokenizer, messages, persona="pirate")[0] == want == "HiPIRATE"


# A reasoning model's switches (gpt-oss / DeepSeek-V4 style `reasoning_effort`, Qwen3 / Gemma style
# `enable_thinking`), each read only where defined, and Command-R / Granite style retrieval documents.
EFFORT = """{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
    {%- if reasoning_effort is defined %}{{- '<effort>' + reasoning_effort + '</effort>' }}{%- endif %}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""
EFFORT_AND_DOCUMENTS = DOCUMENTS.replace("{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
                                         EFFORT.split("{%- endfor %}\n", 1)[1])
DOCS = [{"title": "Oslo", "text": "Rain, 9 C."}, {"title": "Paris", "text": "Sun, 21 C.", "url": "https://x"}]
INFO = ModelInfo(max_model_len=4096, vocab_size=49152, max_num_tokens=4096, eos_token_ids=[2])


def served_body(tokenizer: Tokenizer, body: dict[str, Any]) -> str | None:
    """The prompt text of a chat completions body, through the api's checks (schemas) and the tokenizer's render."""
    request = chat_request(decode_body(json.dumps(body).encode(), ChatBody), "r", 0.0)
    return generate_prompt(tokenizer, request, INFO).text


# reasoning_effort, chat_template_kwargs -> the variables vLLM's build_chat_params gives the template
EFFORT_CASES = [
    ("low", None, {"reasoning_effort": "low", "enable_thinking": True}),
    ("none", None, {"reasoning_effort": "none", "enable_thinking": False}),
    ("max", None, {"reasoning_effort": "max", "enable_thinking": True}),
    ("high", {"enable_thinking": False}, {"reasoning_effort": "high", "enable_thinking": False}),  # the client's
    ("none", {"enable_thinking": True}, {"reasoning_effort": "none", "enable_thinking": True}),
    ("low", {"reasoning_effort": "high"}, {"reasoning_effort": "low", "enable_thinking": True}),  # the field's
    (None, {"reasoning_effort": "high"}, {"reasoning_effort": "high"}),
    (None, None, {}),
]


@pytest.mark.parametrize("effort, kwargs, variables", EFFORT_CASES)
def test_reasoning_effort_reaches_the_template_as_vllm_gives_it(tmp_path: Path, effort: str | None,
                                                                kwargs: dict[str, Any] | None,
                                                                variables: dict[str, Any]) -> None:
    """vLLM's reasoning_effort: the template's `reasoning_effort`, and `enable_thinking` = (effort != "none") unless
    chat_template_kwargs sets it (the client's then wins); the field wins over a `reasoning_effort` key there (vLLM's
    merge). A template reads whichever it declares: the same request renders on one that declares neither."""
    tokenizer = Tokenizer(tokenizer_folder(tmp_path / "effort", EFFORT))
    messages = [{"role": "user", "content": "Hi"}]
    body = {"messages": messages, "reasoning_effort": effort, "chat_template_kwargs": kwargs}
    want = oracle_text(EFFORT, messages, "string", **variables)
    assert served_body(tokenizer, body) == want
    if effort is not None:
        assert f"<effort>{variables['reasoning_effort']}</effort>" in want
    assert ("<think>\n\n</think>" in want) == (variables.get("enable_thinking") is False)
    plain = Tokenizer(tokenizer_folder(tmp_path / "plain", FIRST_AS_STRING))
    assert served_body(plain, body) == oracle_text(FIRST_AS_STRING, messages, "string")


def test_documents_reach_a_documents_template(tmp_path: Path) -> None:
    """vLLM's documents: transformers' `documents` argument, which a RAG template renders (with reasoning_effort
    beside them); a template without them renders as without. chat_template_kwargs still may not set them."""
    tokenizer = Tokenizer(tokenizer_folder(tmp_path / "rag", EFFORT_AND_DOCUMENTS))
    messages = [{"role": "user", "content": "Weather?"}]
    body = {"messages": messages, "documents": DOCS, "reasoning_effort": "none"}
    want = oracle_text(EFFORT_AND_DOCUMENTS, messages, "string", documents=DOCS, reasoning_effort="none",
                       enable_thinking=False)
    assert "Document 1: Paris\nSun, 21 C." in want and "<effort>none</effort><think>" in want
    assert served_body(tokenizer, body) == want
    request = chat_request(decode_body(json.dumps(body).encode(), ChatBody), "r", 0.0)
    count = TokenizeRequest("t", messages=request.messages, chat_template_kwargs=request.chat_template_kwargs,
                            documents=request.documents)  # the count routes' request renders them too
    assert tokenize_result(tokenizer, count, 4096).token_ids == oracle_ids(want)
    assert served_body(tokenizer, {"messages": messages, "documents": []}) == oracle_text(
        EFFORT_AND_DOCUMENTS, messages, "string")
    plain = Tokenizer(tokenizer_folder(tmp_path / "plain", FIRST_AS_STRING))
    assert served_body(plain, body) == oracle_text(FIRST_AS_STRING, messages, "string")
    with pytest.raises(InvalidRequestError) as caught:
        tokenizer.render_chat(messages, chat_template_kwargs={"documents": DOCS})
    assert caught.value.param == "chat_template_kwargs"


# ------------------------------------------------------------------------------------------------------------
# through the server: /tokenize of a random-weight model carrying a template


def random_llama(folder: Path, template: str) -> Path:
    """A 1-layer random Llama over SmolLM2's vocabulary carrying `template`, in `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer_folder(folder, template)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201  (an Iterator[tests.harness.Server])
    """`pagoda serve` of a 1-layer random Llama over SmolLM2's vocabulary with the Llama-3.1-style template."""
    from tests.harness import running_server

    with running_server(random_llama(tmp_path_factory.mktemp("served") / "tiny-llama31", LLAMA31)) as server:
        yield server


@pytest.fixture(scope="module")
def rag_server(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201  (an Iterator[tests.harness.Server])
    """The same random Llama with a template that renders retrieval documents and the reasoning switches."""
    from tests.harness import running_server

    folder = random_llama(tmp_path_factory.mktemp("served") / "tiny-rag", EFFORT_AND_DOCUMENTS)
    with running_server(folder) as server:
        yield server


def test_tokenize_serves_the_template_prompt(llama_server: Any) -> None:
    """/tokenize with messages answers the ids of transformers' rendering; a template error is a 400 carrying
    its message, not a 500."""
    url = llama_server.url.removesuffix("/v1") + "/tokenize"
    cases = [
        ({"messages": [{"role": "system", "content": [{"type": "text", "text": "Be brief."},
                                                      {"type": "text", "text": "Be kind."}]},
                       {"role": "user", "content": "Hi"}]}, {}),
        ({"messages": [m for m in tool_turns(content="Checking.") if m["role"] != "system"], "tools": TOOLS}, {}),
        ({"messages": [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "Once upon"}],
          "add_generation_prompt": False, "continue_final_message": True}, {}),
        ({"messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS,
          "chat_template_kwargs": {"tools_in_user_message": False}}, {"tools_in_user_message": False}),
    ]
    for body, kwargs in cases:
        response = httpx.post(url, json={**body, "chat_template_kwargs": {**FIXED, **kwargs}}, timeout=30)
        assert response.status_code == 200, response.text
        want = oracle_text(LLAMA31, body["messages"], "string", tools=body.get("tools"),
                           add_generation_prompt=body.get("add_generation_prompt", True),
                           continue_final_message=body.get("continue_final_message", False), **FIXED, **kwargs)
        assert response.json()["tokens"] == oracle_ids(want), body
    two_calls = {"messages": [{"role": "user", "content": "Hi"},
                              {"role": "assistant", "content": None, "tool_calls": [call(), call(call_id="call_2")]}],
                 "tools": TOOLS}
    response = httpx.post(url, json=two_calls, timeout=30)
    assert response.status_code == 400, response.text
    assert "only supports single tool-calls" in response.json()["error"]["message"]


def test_chat_completions_render_documents_and_reasoning_effort(rag_server: Any) -> None:
    """Over HTTP: the prompt a chat completion runs (its prompt_token_ids) is transformers' rendering with the
    documents and vLLM's reasoning variables; a bad effort or bad documents are a 400 naming the field."""
    url = rag_server.url + "/v1/chat/completions"
    messages = [{"role": "user", "content": "Weather?"}]
    cases = [({"documents": DOCS, "reasoning_effort": "none"},
              {"documents": DOCS, "reasoning_effort": "none", "enable_thinking": False}),
             ({"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}},
              {"reasoning_effort": "low", "enable_thinking": False}),
             ({}, {})]
    for fields, variables in cases:
        body = {"messages": messages, "max_tokens": 1, "return_token_ids": True, **fields}
        response = httpx.post(url, json=body, timeout=30)
        assert response.status_code == 200, response.text
        want = oracle_text(EFFORT_AND_DOCUMENTS, messages, "string", **variables)
        assert response.json()["prompt_token_ids"] == oracle_ids(want), fields
    refused = [({"reasoning_effort": "extreme"}, "reasoning_effort", "none, minimal, low, medium, high, xhigh, max"),
               ({"reasoning_effort": 1}, "reasoning_effort", "str"),
               ({"documents": "Oslo: rain"}, "documents", "array"),
               ({"documents": [{"title": "Oslo", "rank": 1}]}, "documents[0]", "str"),
               ({"documents": [["Oslo"]]}, "documents[0]", "object"),
               ({"include_reasoning": "no"}, "include_reasoning", "bool")]
    for fields, param, needle in refused:
        response = httpx.post(url, json={"messages": messages, "max_tokens": 1, **fields}, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and needle in error["message"], error
