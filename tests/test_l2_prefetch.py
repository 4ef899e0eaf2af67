"""L2 prefetch on a side stream (kernels/l2_prefetch.py): the lines a launch covers (recorded by the kernel itself
in the interpreter, against the byte ranges of the tensors), where it is on, and on an sm90 GPU that a decode step
computes exactly the same logits with it, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import l2_prefetch

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.parametrize(("nbytes", "num_programs"), [(1, 1), (127, 3), (128, 2), (5000, 3), (70_000, 7),
                                                      (140_000, 16)])
def test_recorded_lines_cover_every_byte_once(nbytes: int, num_programs: int) -> None:
    weight = torch.randn(-(-nbytes // 2) + 40).to(torch.float16)  # more bytes than asked for: a prefix is read
    lines = -(-nbytes // l2_prefetch.LINE_BYTES)
    marks = torch.zeros(lines + 8, dtype=torch.uint8)  # slack past the end must stay unmarked
    l2_prefetch.prefetch_bytes(weight, nbytes, l2_prefetch.MODE_RECORD, num_programs, marks)
    assert torch.equal(marks[:lines], l2_prefetch.reference_lines(nbytes))
    assert not marks[lines:].any()


def test_whole_tensor_by_default_and_clear_errors() -> None:
    weight = torch.zeros(3, 1000, dtype=torch.uint8)  # 3000 bytes: 24 lines
    marks = torch.zeros(32, dtype=torch.uint8)
    l2_prefetch.prefetch_bytes(weight, None, l2_prefetch.MODE_RECORD, 4, marks)
    assert marks.sum().item() == 24 and marks[:24].all()
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch.prefetch_bytes(weight.t(), None, l2_prefetch.MODE_RECORD, 4, marks)
    with pytest.raises(ValueError, match="marks"):
        l2_prefetch.prefetch_bytes(weight, None, l2_prefetch.MODE_RECORD, 4, torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="mode"):
        l2_prefetch.prefetch_bytes(weight, None, 7)
    with pytest.raises(ValueError, match="num_programs"):
        l2_prefetch.prefetch_bytes(weight, None, l2_prefetch.MODE_RECORD, 0, marks)


def test_bulk_mode_leaves_a_tail_shorter_than_a_chunk() -> None:
    assert l2_prefetch._units(3 * l2_prefetch.BULK_BYTES + 100, l2_prefetch.MODE_BULK) == (l2_prefetch.BULK_BYTES, 3)
    assert l2_prefetch._units(100, l2_prefetch.MODE_LINES) == (l2_prefetch.LINE_BYTES, 1)


def test_prefetch_only_inside_an_enabled_scope(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_L2_PREFETCH", "lines")
    assert not l2_prefetch.active()
    with l2_prefetch.scope(True, 4.0):
        assert l2_prefetch.active()
        with l2_prefetch.scope(False):
            assert not l2_prefetch.active()
        assert l2_prefetch.active()
        l2_prefetch.prefetch((torch.zeros(4),))  # CPU tensors: nothing launched, nothing raised
    assert not l2_prefetch.active()
    monkeypatch.setenv("PAGODA_L2_PREFETCH", "0")
    with l2_prefetch.scope(True):
        assert not l2_prefetch.active()
    monkeypatch.setenv("PAGODA_L2_PREFETCH", "bulk")
    monkeypatch.setenv("PAGODA_L2_PREFETCH_MB", "1.5")
    assert l2_prefetch.setting() == l2_prefetch.MODE_BULK
    assert l2_prefetch.extra_bytes_setting(16.0) == 3 << 19
    assert not l2_prefetch.supported(torch.device("cpu"))


def test_the_layers_name_what_they_read_next() -> None:
    """A DeepSeek layer's fixed MLP weights: the fused shared experts (the last experts), or the dense MLP."""
    from pagoda.services.worker.models import CausalLM
    from pagoda.shared.shapes import SHAPES

    arch = SHAPES["tiny-deepseek-v3"]
    model = CausalLM(arch, torch.float32, torch.device("cpu"), max_positions=64)
    sparse = arch.moe.sparse_layers
    for index, layer in enumerate(model.layers):
        gate_up, down = layer._fixed_weights()
        if index in sparse:
            experts = layer.mlp.moe.num_experts
            assert gate_up.data_ptr() == layer.mlp.w_gate_up[experts].data_ptr() and gate_up.is_contiguous()
            assert down.shape[0] == layer.mlp.num_shared == gate_up.shape[0] and down.is_contiguous()
        else:
            assert gate_up is layer.dense_mlp.gate_up and down is layer.dense_mlp.down


def _decode_step(model, batch: int, context: int):  # noqa: ANN001, ANN202
    from pagoda.bench.decode_profile import make_batch
    from pagoda.bench.step_ab import _caches

    meta, positions, num_blocks = make_batch([1] * batch, [context + 1] * batch, torch.device("cuda"))
    caches = _caches(model.arch, num_blocks, torch.device("cuda"), model.dtype)
    ids = torch.randint(0, model.arch.vocab_size, (batch,), device="cuda")
    return lambda: model.compute_logits(model(ids, positions, caches, meta))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm90+ GPU (bulk prefetch; the L2 sizes were measured on one)")
@pytest.mark.parametrize(("shape", "quantization"), [("tiny", "fp8"), ("tiny-deepseek-v3", None),
                                                     ("tiny-qwen3", None)])
def test_a_step_computes_the_same_logits_with_prefetch(shape: str, quantization: str | None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from pagoda.services.worker.models import CausalLM, Fp8Weights
    from pagoda.services.worker.weights import load_model
    from pagoda.shared.shapes import SHAPES

    torch.manual_seed(0)
    model = CausalLM(SHAPES[shape], torch.bfloat16, torch.device("cuda"), max_positions=256,
                     fp8=Fp8Weights(None) if quantization else None)
    load_model(model, None, "dummy", seed=0)
    with torch.inference_mode():
        step = _decode_step(model, 1, 100)
        results = {}
        for mode in ("0", "lines", "bulk"):
            monkeypatch.setenv("PAGODA_L2_PREFETCH", mode)
            eager = step().clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = step()
            graph.replay()
            torch.cuda.synchronize()
            results[mode] = (eager, captured.clone())
    for eager, replayed in results.values():
        assert torch.equal(eager, results["0"][0]) and torch.equal(replayed, results["0"][0])
