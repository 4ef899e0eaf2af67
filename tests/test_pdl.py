"""Programmatic dependent launch (kernels/pdl.py): where it is on, and that a chain of PDL kernels (a decode
layer's norm -> W8A16 GEMV -> SiLU -> GEMV -> residual norm, and attention) computes exactly what the same chain
launched without it computes, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import pdl
from pagoda.kernels import reference as ref
from pagoda.kernels.activation import silu_and_mul
from pagoda.kernels.fp8_weight_only import DeferredSum, GemvTiles, fp8_weight_only_deferred, fp8_weight_only_linear
from pagoda.kernels.norm import add_rms_norm, add_rms_norm_parts, rms_norm

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_pdl_only_inside_a_scope_on_a_supporting_device(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    with pdl.scope(pdl.FIRST):
        assert not pdl.active(cpu)
        monkeypatch.setenv("PAGODA_PDL", "0")
        assert not pdl.active(torch.device("cuda", 0))  # decided before any CUDA call
    monkeypatch.delenv("PAGODA_PDL")
    if HOPPER:
        cuda = torch.device("cuda")
        assert not pdl.active(cuda)
        with pdl.scope(pdl.FIRST):
            assert pdl.active(cuda) == pdl.FIRST
            with pdl.scope(0):
                assert not pdl.active(cuda)
            with pdl.scope(pdl.AT_EXIT):
                assert pdl.active(cuda) == pdl.AT_EXIT
            assert pdl.active(cuda) == pdl.FIRST
        assert not pdl.active(cuda)
    assert pdl.launch_options(cpu) == {"USE_PDL": 0}
    if HOPPER:
        with pdl.scope(pdl.AT_EXIT):
            assert pdl.launch_options(torch.device("cuda")) == {"USE_PDL": pdl.AT_EXIT, "launch_pdl": True}


def test_the_model_picks_pdl_by_step_size_and_kernel_mix() -> None:
    from pagoda.services.worker.models import CausalLM, Fp8Weights
    from pagoda.shared.shapes import SHAPES

    cpu = torch.device("cpu")
    dense = CausalLM(SHAPES["tiny"], torch.float32, cpu, max_positions=64)
    fp8 = CausalLM(SHAPES["tiny"], torch.float32, cpu, max_positions=64, fp8=Fp8Weights(None))
    moe = CausalLM(SHAPES["tiny-deepseek-v3"], torch.float32, cpu, max_positions=64)
    assert dense.pdl_mode(1) == dense.pdl_mode(4) == 0
    assert fp8.pdl_mode(1) == moe.pdl_mode(1) == pdl.FIRST
    assert fp8.pdl_mode(2) == fp8.pdl_mode(8) == pdl.AT_EXIT
    assert fp8.pdl_mode(64) == moe.pdl_mode(8) == 0


def _layer_chain(x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, w_up: tuple[torch.Tensor, ...],
                 w_down: tuple[torch.Tensor, ...], split: GemvTiles,
                 fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fused: the down GEMV's split-K sum inside the residual norm (the model's path)."""
    h = rms_norm(x, norm_w, 1e-6)  # [M, H]
    gate_up = fp8_weight_only_linear(h, *w_up, None)  # [M, 2I]
    if fused:
        parts = fp8_weight_only_deferred(silu_and_mul(gate_up), *w_down, None, tiles=split)
        assert isinstance(parts, DeferredSum)
        return add_rms_norm_parts(parts.parts, parts.dtype, residual, norm_w, 1e-6)
    down = fp8_weight_only_linear(silu_and_mul(gate_up), *w_down, None, tiles=split)  # [M, H], split-K partials
    return add_rms_norm(down, residual, norm_w, 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm90+ GPU (programmatic dependent launch)")
@pytest.mark.parametrize("num_rows", [1, 4])
def test_pdl_chain_matches_serial_launches(num_rows: int) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden, inter = 1024, 2048
    x = torch.randn(num_rows, hidden, generator=gen).to("cuda", torch.bfloat16)
    residual = torch.randn(num_rows, hidden, generator=gen).to("cuda", torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to("cuda", torch.bfloat16)
    w_up = tuple(t.cuda() for t in ref.quantize_fp8_rows(torch.randn(2 * inter, hidden, generator=gen) * 0.05, None))
    w_down = tuple(t.cuda() for t in ref.quantize_fp8_rows(torch.randn(hidden, inter, generator=gen) * 0.05, None))
    split = GemvTiles(block_m=1, block_n=16, block_k=256, split_k=4)

    results = {}
    for mode in (0, pdl.FIRST, pdl.AT_EXIT):
        for fused in (False, True):
            with pdl.scope(mode):
                eager = [t.clone() for t in _layer_chain(x, residual, norm_w, w_up, w_down, split, fused)]
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    captured = _layer_chain(x, residual, norm_w, w_up, w_down, split, fused)
            graph.replay()
            torch.cuda.synchronize()
            results[mode, fused] = (eager, [t.clone() for t in captured])
    for key, (eager, replayed) in results.items():
        if key != (0, False):
            for off, on in zip(results[0, False], (eager, replayed), strict=True):
                for a, b in zip(off, on, strict=True):
                    assert torch.equal(a, b), key
        assert torch.equal(eager[0], replayed[0])  # eager and graph agree too
