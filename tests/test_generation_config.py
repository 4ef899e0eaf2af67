"""The server's and the offline engine's sampling defaults: the model's generation_config.json, vLLM's fallback to
config.json without one, and vLLM's --override-generation-config over either."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pagoda.services.tokenizer.generation_config import sampling_defaults
from pagoda.shared.config import EngineConfig, add_engine_args, engine_config_from_args
from pagoda.shared.errors import ConfigError


def _folder(path: Path, **files: dict) -> str:
    path.mkdir()
    for name, content in files.items():
        (path / f"{name}.json").write_text(json.dumps(content))
    return str(path)


def test_without_a_generation_config_json_the_sampling_keys_of_config_json_are_taken(tmp_path: Path) -> None:
    """vLLM's fallback (GenerationConfig.from_model_config): config.json's sampling keys, but not the values
    transformers 4 wrote into every config it saved (temperature 1, top_p 1, top_k 50, repetition_penalty 1)."""
    old = _folder(tmp_path / "old", config={"model_type": "llama", "temperature": 1.0, "top_k": 50, "top_p": 1.0,
                                            "repetition_penalty": 1.0, "max_length": 20})
    assert sampling_defaults(old, "auto") == {}
    tuned = _folder(tmp_path / "tuned", config={"model_type": "llama", "temperature": 0.6, "top_k": 20, "top_p": 1.0,
                                                "min_p": 0.05, "max_new_tokens": 300, "do_sample": True})
    assert sampling_defaults(tuned, "auto") == {"temperature": 0.6, "top_k": 20, "min_p": 0.05, "max_tokens": 300}
    assert sampling_defaults("tiny", "auto", {}) == {}  # a dummy shape has no folder
    assert sampling_defaults(str(tmp_path), tuned) == sampling_defaults(tuned, "auto")  # a folder of config.json
    both = _folder(tmp_path / "both", config={"temperature": 0.6}, generation_config={"top_p": 0.9})
    assert sampling_defaults(both, "auto") == {"top_p": 0.9}  # generation_config.json wins whole, as vLLM's
    with pytest.raises(ConfigError) as caught:
        sampling_defaults(both, str(tmp_path / "empty"))
    assert caught.value.param == "generation_config"


def test_overrides_are_set_over_the_generation_config(tmp_path: Path) -> None:
    """vLLM's --override-generation-config: merged over the file (null unsets a key), alone with 'vllm'; a key that
    is no sampling default, or a value SamplingParams refuses, stops the start naming the flag."""
    model = _folder(tmp_path / "model", generation_config={"temperature": 0.6, "top_k": 20, "max_new_tokens": 512})
    assert sampling_defaults(model, "auto", {"temperature": 0.2, "top_k": None, "repetition_penalty": 1.1}) == {
        "temperature": 0.2, "repetition_penalty": 1.1, "max_tokens": 512}
    assert sampling_defaults(model, "vllm", {"max_new_tokens": 64}) == {"max_tokens": 64}
    for overrides, message in (({"max_tokens": 5}, "max_tokens"), ({"temperature": -1}, "temperature")):
        with pytest.raises(ConfigError) as caught:
            sampling_defaults(model, "auto", overrides)
        assert caught.value.param == "override_generation_config" and message in caught.value.message
    bad_file = _folder(tmp_path / "bad", generation_config={"top_p": 3})
    with pytest.raises(ConfigError) as caught:
        sampling_defaults(bad_file, "auto", {"temperature": 0.5})
    assert caught.value.param == "generation_config"  # the file's value, not the flag's


def test_a_boolean_where_a_number_belongs_stops_the_start(tmp_path: Path) -> None:
    """JSON true / false are Python ints: as a default they passed SamplingParams' checks (top_k True, max_tokens
    True), then every tokenizer's announcement of its defaults was dropped as a malformed frame (the wire's values
    are numbers) and the server started with no live tokenizer. Refused as any bad value is, naming the source."""
    model = _folder(tmp_path / "model", generation_config={"temperature": 0.6})
    for key in ("top_k", "max_new_tokens", "temperature"):
        for value in (True, False):
            with pytest.raises(ConfigError) as caught:
                sampling_defaults(model, "auto", {key: value})
            assert caught.value.param == "override_generation_config" and key in caught.value.message
    in_file = _folder(tmp_path / "in_file", generation_config={"top_k": True})
    with pytest.raises(ConfigError) as caught:
        sampling_defaults(in_file, "auto")
    assert caught.value.param == "generation_config"


def test_the_flag_and_the_keyword_reach_the_engine_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--override-generation-config", '{"temperature": 0.5, "top_k": null}'])
    config = engine_config_from_args(args)
    assert config.generation_overrides() == {"temperature": 0.5, "top_k": None}
    assert EngineConfig.from_kwargs(override_generation_config={"top_p": 0.9}).generation_overrides() == {"top_p": 0.9}
    assert EngineConfig().generation_overrides() == {}
    for text in ("{temperature: 1}", "[1]"):
        with pytest.raises(ConfigError) as caught:
            EngineConfig(override_generation_config=text)
        assert caught.value.param == "override_generation_config"


@pytest.mark.slow
def test_the_offline_engine_takes_the_overrides() -> None:
    from pagoda import LLM, SamplingParams

    llm = LLM("tiny", generation_config="vllm", override_generation_config={"temperature": 0.3, "max_new_tokens": 2})
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.3, max_tokens=2)
    [output] = llm.generate([[5, 6, 7]])
    assert len(output.outputs[0].token_ids) <= 2


def test_pagoda_serve_with_bad_override_json_says_so_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    from pagoda.cli import main

    assert main(["serve", "--override-generation-config", '{"temperature": ']) == 2
    error = capsys.readouterr().err
    assert error.startswith("pagoda: error: override_generation_config is not valid JSON") and "Traceback" not in error


def test_pagoda_serve_with_a_bad_environment_value_says_so_without_a_traceback(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A PAGODA_* value of the wrong type fails while the flags' defaults are read, before any flag is parsed."""
    from pagoda.cli import main

    monkeypatch.setenv("PAGODA_MAX_NUM_SEQS", "abc")
    assert main(["serve"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("pagoda: error: PAGODA_MAX_NUM_SEQS='abc' is not a valid int") and "Traceback" not in error


@pytest.mark.parametrize("value", ["enabled", "2", "tru"])
def test_a_boolean_environment_value_that_is_no_boolean_is_refused(
        value: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """PAGODA_RESTART_ON_FAILURE=enabled used to read as off (any word but 1/true/yes/on did), silently; an int or
    float setting of the wrong type was refused. Booleans now take 1/true/yes/on or 0/false/no/off, else exit 2."""
    from pagoda.cli import main

    monkeypatch.setenv("PAGODA_RESTART_ON_FAILURE", value)
    # --port 0 would be refused too (after the environment): a server is never started, whatever the outcome
    assert main(["serve", "--port", "0"]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"pagoda: error: PAGODA_RESTART_ON_FAILURE={value!r} is not a valid bool"), error


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("On", True), ("yes", True), ("0", False),
                                                 ("false", False), ("OFF", False), ("", False)])
def test_boolean_environment_values(value: str, expected: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagoda.cli import build_parser
    from pagoda.shared.config import server_config_from_args

    monkeypatch.setenv("PAGODA_RESTART_ON_FAILURE", value)
    assert server_config_from_args(build_parser().parse_args(["serve"])).restart_on_failure is expected
