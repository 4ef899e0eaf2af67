"""Text <-> token ids and chat templates, over a Hugging Face tokenizer loaded from a local folder."""

from __future__ import annotations

import functools
import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import _compile_jinja_template

from pagoda.services.tokenizer.conversation import arguments_as_text, content_format, template_conversation
from pagoda.shared.config import EngineConfig
from pagoda.shared.errors import ConfigError, InvalidRequestError, ModelNotFoundError
from pagoda.shared.hf_tokenizer import has_tokenizer, load_hf_tokenizer, tokenizer_folder

# The names chat_template_kwargs may not set: transformers' own arguments (they would change how it renders or
# tokenizes, not what the template sees) and `messages`, which transformers gives the template itself (a second
# value was a TypeError, blamed on the messages)
_RESERVED_TEMPLATE_KWARGS = frozenset(
    inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"kwargs"} | {"messages"}


# The Rust decode holds the GIL throughout; decode_batch lets go of it. A long list (/detokenize's, decoded on the
# offloader's thread) goes through decode_batch, so that the loop keeps its heartbeats meanwhile (15M ids: 5 s).
# Shorter ones, the detokenizer's two a token, keep decode: decode_batch's thread pool costs more than they do.
RELEASE_GIL_MIN_IDS = 4096


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE (GPT-2 and its descendants) spells each byte as one printable character: printable
    Latin-1 bytes as themselves, the other 68 bytes as chr(256 + n) in byte order. Character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    alphabet = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in alphabet.values()]
    alphabet.update({chr(256 + n): b for n, b in enumerate(others)})
    return alphabet


_BYTE_LEVEL_ALPHABET = _byte_level_alphabet()
_SENTENCEPIECE_SPACE = "\u2581"  # "▁", how SentencePiece vocabularies write a leading space
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_FRAME_PROBE = "a b"  # a text that encodes to tokens of its own in any vocabulary (special_frame compares around it)


@dataclass(frozen=True, slots=True)
class SpecialFrame:
    """How many special tokens encode(text, add_special_tokens=True) puts before and after the text's own tokens
    (Llama's, Mistral's, DeepSeek's BOS: one before). Prompt truncation keeps them, as transformers' does."""

    num_before: int = 0
    num_after: int = 0


NO_FRAME = SpecialFrame()


def special_frame(hf: PreTrainedTokenizerBase) -> SpecialFrame:
    """The SpecialFrame of a tokenizer, found by encoding a probe text with and without its special tokens."""
    own = hf.encode(_FRAME_PROBE, add_special_tokens=False)
    framed = hf.encode(_FRAME_PROBE, add_special_tokens=True)
    if not own:
        return NO_FRAME
    for start in range(len(framed) - len(own) + 1):
        if framed[start:start + len(own)] == own:
            return SpecialFrame(start, len(framed) - start - len(own))
    return NO_FRAME  # encode changes the text's own tokens too: nothing to keep apart


def _uses_byte_level(backend: tokenizers.Tokenizer | None) -> bool:
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    return "ByteLevel" in json.dumps(decoder)


# A template's own faults, as opposed to a template rejecting the messages it is given (raise_exception)
_TEMPLATE_FAULTS = (jinja2.TemplateSyntaxError, jinja2.TemplateAssertionError, jinja2.sandbox.SecurityError)


class Tokenizer:
    """One model's tokenizer: encode, decode, and render chats with the model's own template."""

    def __init__(self, path: str | Path, chat_template: str | None = None) -> None:
        """`chat_template`: a Jinja template that renders chats instead of the folder's own (--chat-template)."""
        folder = Path(path)
        # Checked before transformers sees the name: a missing folder would otherwise be taken as a hub id.
        if not has_tokenizer(folder):
            raise ModelNotFoundError(f"no tokenizer found in folder {str(folder)!r}")
        try:
            self._hf: PreTrainedTokenizerBase = load_hf_tokenizer(folder)
        except (OSError, ValueError, ImportError) as exc:
            raise ModelNotFoundError(f"cannot load the tokenizer in {str(folder)!r}: {exc}") from exc
        self.path = folder
        if chat_template is not None:  # every reader of the template (render_chat, prompts, /tokenizer_info) sees it
            try:
                _compile_jinja_template(chat_template)
            except jinja2.TemplateError as exc:
                raise ConfigError(f"--chat-template is not a valid Jinja template: {exc}",
                                  param="chat_template") from None
            self._hf.chat_template = chat_template
        self._all_special_ids = sorted(set(self._hf.all_special_ids))
        self._vocab_size = len(self._hf)
        # The Rust tokenizer decodes about 4x faster than transformers' wrapper around it, and the
        # detokenizer decodes twice per token of every sequence.
        backend = getattr(self._hf, "backend_tokenizer", None)
        self._backend = backend if isinstance(backend, tokenizers.Tokenizer) else None
        self._byte_level = _uses_byte_level(self._backend)

    @property
    def hf(self) -> PreTrainedTokenizerBase:
        return self._hf

    @property
    def backend(self) -> tokenizers.Tokenizer | None:
        """The Rust tokenizer, when there is one (the stream detokenizer steps it)."""
        return self._backend

    @property
    def eos_token_id(self) -> int | None:
        return self._hf.eos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's embedding may be padded past it)."""
        return self._vocab_size

    @property
    def all_special_ids(self) -> list[int]:
        return self._all_special_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._hf.encode(text, add_special_tokens=add_special_tokens)

    @functools.cached_property
    def special_frame(self) -> SpecialFrame:
        """The special tokens encode(text) adds around a text's own (special_frame)."""
        return special_frame(self._hf)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        # No clean-up of spaces: it rewrites text already streamed (" ." -> "."), so streaming and
        # whole decodes would disagree.
        if self._backend is not None:
            if len(token_ids) >= RELEASE_GIL_MIN_IDS:  # one text, as decode makes it
                return self._backend.decode_batch([token_ids], skip_special_tokens=skip_special_tokens)[0]
            return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self._hf.decode(token_ids, skip_special_tokens=skip_special_tokens,
                               clean_up_tokenization_spaces=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for, also when it is part of a multi-byte character (logprobs'
        `bytes`: the concatenation over a completion's tokens is its UTF-8 text)."""
        piece = self._hf.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id in self._all_special_ids:
            return piece.encode("utf-8")
        if self._byte_level:
            # The ByteLevel decoder spells a piece of its alphabet as bytes, any other (an added token) as it is.
            if all(ch in _BYTE_LEVEL_ALPHABET for ch in piece):
                return bytes(_BYTE_LEVEL_ALPHABET[ch] for ch in piece)
            return piece.encode("utf-8")
        byte_fallback = _BYTE_FALLBACK.fullmatch(piece)  # SentencePiece's "<0xE2>" for a byte it has no piece for
        if byte_fallback:
            return bytes([int(byte_fallback.group(1), 16)])
        return piece.replace(_SENTENCEPIECE_SPACE, " ").encode("utf-8")

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None,
                    documents: list[dict[str, str]] | None = None, chat_template: str | None = None) -> str:
        """The prompt text the model's chat template makes of `messages`. `documents`: retrieval documents, given to
        the template as transformers' `documents` argument (vLLM's chat field; a template without them ignores
        them); chat_template_kwargs may not set them, nor any other of transformers' own arguments.
        `chat_template`: a template to use instead of the model's, or the name of one of the model's (None: its
        default)."""
        if self._hf.chat_template is None and chat_template is None:
            raise InvalidRequestError(f"the model's tokenizer in {str(self.path)!r} has no chat template; "
                                      "use the completions endpoint", param="messages",
                                      code="no_chat_template")
        # vLLM's message normalisation, with the content format of the template that renders them
        template = self._hf.get_chat_template(chat_template, tools)
        conversation = template_conversation(messages, content_format(template), arguments_as_text(template),
                                             template)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise InvalidRequestError("tools must be a list of objects", param="tools")
        kwargs = chat_template_kwargs or {}
        reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)  # template variables only
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {reserved}",
                                      param="chat_template_kwargs")
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError("add_generation_prompt and continue_final_message exclude each other",
                                      param="messages")
        try:
            text = self._hf.apply_chat_template(
                conversation, tools=tools, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False, documents=documents,
                chat_template=template, **kwargs)
        except jinja2.TemplateError as exc:
            if chat_template is not None and isinstance(exc, _TEMPLATE_FAULTS):
                # the request's own template (--trust-request-chat-template) does not compile or breaks the sandbox
                raise InvalidRequestError(f"the chat_template cannot render: {type(exc).__name__}: {exc}",
                                          param="chat_template") from exc
            # Templates reject conversations themselves (raise_exception: roles must alternate, ...).
            raise InvalidRequestError(f"the chat template rejected the messages: {exc}",
                                      param="messages") from exc
        assert isinstance(text, str)
        return text

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                            chat_template_kwargs: dict[str, Any] | None = None, *,
                            tokenize: bool = True) -> list[int] | str:
        """Prompt token ids for a chat (the template writes the special tokens, so encode adds none), or with
        tokenize=False its text, as a Hugging Face tokenizer's apply_chat_template gives (what scripts written for
        vLLM's LLM.get_tokenizer() call)."""
        text = self.render_chat(messages, add_generation_prompt, tools, continue_final_message,
                                chat_template_kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __len__(self) -> int:
        """Token ids, added tokens included (len() of a Hugging Face tokenizer)."""
        return self._vocab_size

    def __getattr__(self, name: str) -> Any:
        """What this class does not define, from the Hugging Face tokenizer it wraps (convert_ids_to_tokens,
        batch_decode, pad_token_id, ...): LLM.get_tokenizer() stands where vLLM's returns that tokenizer."""
        if name.startswith("_"):  # private names (and those looked up before __init__ set _hf) are not delegated
            raise AttributeError(name)
        return getattr(self._hf, name)


def load_tokenizer(config: EngineConfig) -> Tokenizer | None:
    """--tokenizer if given, else the model folder's own; None when there is none (prompts are then ids)."""
    folder = tokenizer_folder(config.model, config.load_format, config.tokenizer)
    return Tokenizer(folder, config.chat_template_text()) if folder is not None else None
