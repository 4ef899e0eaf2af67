"""Tensor parallelism on CPU (gloo): T=2 gives the same greedy tokens as T=1 through the real scheduler and
worker processes, each rank holds and reads only its shard, and a model whose heads don't divide is refused."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from pagoda.shared.config import EngineConfig
from pagoda.shared.errors import ConfigError
from pagoda.shared.messages import SamplingParams
from pagoda.shared.shapes import check_divisible, load_arch
from tests.harness import die_with_parent, free_port, generate_as_tokenizer, server_env

pytestmark = pytest.mark.slow

NUM_PROMPTS, NEW_TOKENS = 8, 16


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama whose 4 heads and 2 KV heads divide by 2, saved as a Hugging Face folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=1)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(2.0)  # larger weights: logits with clear winners, so greedy is a sharp check
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    return folder


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(2, 256, (int(n),), generator=generator).tolist()
            for n in torch.randint(3, 60, (NUM_PROMPTS,), generator=generator)]


def _generate_with_services(model_dir: Path, tp_size: int) -> dict[str, list[int]]:
    """Start the scheduler and tp_size worker ranks as processes; play the tokenizer over ZeroMQ."""
    runtime = tempfile.mkdtemp(prefix="pgtp", dir="/tmp")
    env = {**server_env(), "PAGODA_RUNTIME_DIR": runtime, "PAGODA_MODEL": str(model_dir), "PAGODA_DEVICE": "cpu",
           "PAGODA_TENSOR_PARALLEL_SIZE": str(tp_size), "PAGODA_TP_INIT_ADDRESS": f"tcp://127.0.0.1:{free_port()}",
           "PAGODA_NUM_KV_BLOCKS": "64", "PAGODA_MAX_NUM_BATCHED_TOKENS": "64", "PAGODA_HEARTBEAT_INTERVAL": "0.2"}
    processes = [subprocess.Popen([sys.executable, "-m", "pagoda.services.scheduler"], env=env,
                                  preexec_fn=die_with_parent)]
    processes += [subprocess.Popen([sys.executable, "-m", "pagoda.services.worker", "--worker-rank", str(rank)],
                                   env=env, preexec_fn=die_with_parent) for rank in range(tp_size)]

    def check_alive() -> None:
        assert all(p.poll() is None for p in processes), "a service process died"

    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        return generate_as_tokenizer(f"ipc://{runtime}/scheduler.sock", _prompts(), params, 180, check_alive)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


def _generate_in_process(model_dir: Path) -> dict[str, list[int]]:
    """The same requests through the engine in this process (one rank; the services path with one worker is
    the in-process engine's, as tests/test_server.py checks): the reference without starting two processes."""
    from pagoda import LLM
    from pagoda import SamplingParams as Params

    llm = LLM(str(model_dir), device="cpu", num_kv_blocks=64, max_num_batched_tokens=64)
    outputs = llm.generate(_prompts(), Params(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    return {str(i): list(out.outputs[0].token_ids) for i, out in enumerate(outputs)}


def test_two_ranks_generate_what_one_does(tiny_llama_dir: Path) -> None:
    single = _generate_in_process(tiny_llama_dir)
    double = _generate_with_services(tiny_llama_dir, 2)
    assert len(single) == NUM_PROMPTS and all(len(t) == NEW_TOKENS for t in single.values())
    assert double == single


def _shard_report(rank: int, model_dir: str, address: str, queue: multiprocessing.Queue) -> None:
    from pagoda.services.worker.model_runner import ModelRunner
    from pagoda.services.worker.parallel import init_tensor_parallel

    config = EngineConfig(model=model_dir, device="cpu", tensor_parallel_size=2, tp_init_address=address,
                          num_kv_blocks=16)
    runner = ModelRunner(config, init_tensor_parallel(config, rank))
    shapes = {name: tuple(p.shape) for name, p in runner.model.named_parameters()}
    queue.put((rank, shapes, runner.bytes_read, tuple(runner.kv_cache.shape)))


def test_each_rank_holds_and_reads_only_its_shard(tiny_llama_dir: Path) -> None:
    from pagoda.services.worker.model_runner import ModelRunner

    full = ModelRunner(EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=16))
    full_shapes = {name: tuple(p.shape) for name, p in full.model.named_parameters()}
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    address = f"tcp://127.0.0.1:{free_port()}"
    ranks = [context.Process(target=_shard_report, args=(r, str(tiny_llama_dir), address, queue)) for r in (0, 1)]
    for process in ranks:
        process.start()
    reports = sorted(queue.get(timeout=120) for _ in ranks)
    for process in ranks:
        process.join(30)
    for _, shapes, bytes_read, kv_shape in reports:
        assert shapes["layers.0.qkv_weight"] == (full_shapes["layers.0.qkv_weight"][0] // 2, 64)
        assert shapes["layers.0.o_weight"] == (64, full_shapes["layers.0.o_weight"][1] // 2)
        assert shapes["layers.0.gate_up_weight"] == (full_shapes["layers.0.gate_up_weight"][0] // 2, 64)
        assert shapes["layers.0.down_weight"] == (64, full_shapes["layers.0.down_weight"][1] // 2)
        assert shapes["embed"] == (128, 64) and shapes["lm_head"] == (128, 64)
        assert kv_shape[4] == 1  # one of the two KV heads per rank
        # everything but the norms (a few hundred bytes, kept whole on every rank) is split in two
        assert bytes_read < full.bytes_read * 0.51
    assert sum(r[2] for r in reports) < full.bytes_read * 1.01


def test_heads_that_do_not_divide_are_refused(smollm2_dir: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        check_divisible(load_arch(smollm2_dir), 2)
    assert "num_attention_heads = 9" in caught.value.message and caught.value.param == "tensor_parallel_size"
    result = subprocess.run([sys.executable, "-m", "pagoda.cli", "serve", "--model", str(smollm2_dir),
                             "--tensor-parallel-size", "2"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "does not divide num_attention_heads = 9" in result.stderr
