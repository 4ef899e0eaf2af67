"""Per-token cost of incremental detokenization: the Python IncrementalDetokenizer, StreamDetokenizer (what
TextStream uses with a Rust tokenizer) and the bare DecodeStream it wraps.

    python -m pagoda.bench.detokenize [--model models/smollm2-135m-instruct] [--repeats 5]

Decodes a mixed text (ASCII, accents, CJK, emoji) one token at a time, as a completion arrives; prints the
best-of-repeats microseconds per token of each, and checks both give the whole decode's text.
"""

from __future__ import annotations

import argparse
import time

from tokenizers.decoders import DecodeStream

from pagoda.services.tokenizer.detokenizer import IncrementalDetokenizer, StreamDetokenizer
from pagoda.services.tokenizer.tokenizer import Tokenizer

TEXT = ("The quick brown fox jumps over the lazy dog. Ça coûte 12,50 € — naïve café. 東京は日本の首都です。"
        " Emoji: 🦊🐶🎉. def f(x):\n    return x ** 2  # squared\n") * 8


def time_incremental(tokenizer: Tokenizer, prompt: list[int], ids: list[int]) -> tuple[float, str]:
    start = time.perf_counter()
    detok = IncrementalDetokenizer(tokenizer, prompt)
    text = "".join(detok.push((t,)) for t in ids) + detok.flush()
    return time.perf_counter() - start, text


def time_stream_detokenizer(tokenizer: Tokenizer, prompt: list[int], ids: list[int]) -> tuple[float, str]:
    assert tokenizer.backend is not None
    start = time.perf_counter()
    detok = StreamDetokenizer(tokenizer.backend, prompt)
    text = "".join(detok.push((t,)) for t in ids) + detok.flush()
    return time.perf_counter() - start, text


def time_decode_stream(tokenizer: Tokenizer, prompt: list[int], ids: list[int]) -> tuple[float, str]:
    backend = tokenizer.hf.backend_tokenizer
    start = time.perf_counter()
    stream = DecodeStream(prompt[-5:], skip_special_tokens=True)
    parts = [stream.step(backend, t) for t in ids]
    return time.perf_counter() - start, "".join(p for p in parts if p is not None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    tokenizer = Tokenizer(args.model)
    prompt = tokenizer.encode("Write something:", add_special_tokens=False)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    whole = tokenizer.decode(ids)
    for name, run in (("IncrementalDetokenizer", time_incremental), ("StreamDetokenizer", time_stream_detokenizer),
                      ("DecodeStream (bare)", time_decode_stream)):
        best, text = min(run(tokenizer, prompt, ids) for _ in range(args.repeats))
        print(f"{name:24s} {best / len(ids) * 1e6:7.2f} us/token over {len(ids)} tokens; "
              f"equals the whole decode: {text == whole}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
