"""Programmatic dependent launch (kernels/pdl.py): where it is on, and that a chain of PDL kernels (a decode
layer's norm -> W8A16 GEMV -> SiLU -> GEMV -> residual norm, and attention) computes exactly what the same chain
launched without it computes, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import pdl
from pagoda.kernels import reference as ref
from pagoda.kernels.activation import silu_and_mul
from pagoda.kernels.fp8_weight_only import GemvTiles, fp8_weight_only_linear
from pagoda.kernels.norm import add_rms_norm, rms_norm

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_pdl_is_off_on_cpu_and_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not pdl.enabled(torch.device("cpu"))
    monkeypatch.setenv("PAGODA_PDL", "0")
    assert not pdl.enabled(torch.device("cuda", 0))  # decided before any CUDA call
    assert pdl.launch_kwargs(False) == {}
    assert pdl.launch_kwargs(True) == {"launch_pdl": True}


def _layer_chain(x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, w_up: tuple[torch.Tensor, ...],
                 w_down: tuple[torch.Tensor, ...], split: GemvTiles) -> tuple[torch.Tensor, torch.Tensor]:
    h = rms_norm(x, norm_w, 1e-6)  # [M, H]
    gate_up = fp8_weight_only_linear(h, *w_up, None)  # [M, 2I]
    down = fp8_weight_only_linear(silu_and_mul(gate_up), *w_down, None, tiles=split)  # [M, H], split-K partials
    return add_rms_norm(down, residual, norm_w, 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm90+ GPU (programmatic dependent launch)")
@pytest.mark.parametrize("num_rows", [1, 4])
def test_pdl_chain_matches_serial_launches(monkeypatch: pytest.MonkeyPatch, num_rows: int) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden, inter = 1024, 2048
    x = torch.randn(num_rows, hidden, generator=gen).to("cuda", torch.bfloat16)
    residual = torch.randn(num_rows, hidden, generator=gen).to("cuda", torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to("cuda", torch.bfloat16)
    w_up = tuple(t.cuda() for t in ref.quantize_fp8_rows(torch.randn(2 * inter, hidden, generator=gen) * 0.05, None))
    w_down = tuple(t.cuda() for t in ref.quantize_fp8_rows(torch.randn(hidden, inter, generator=gen) * 0.05, None))
    split = GemvTiles(block_m=1, block_n=16, block_k=256, split_k=4)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        return _layer_chain(x, residual, norm_w, w_up, w_down, split)

    results = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("PAGODA_PDL", mode)
        eager = [t.clone() for t in run()]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run()
        graph.replay()
        torch.cuda.synchronize()
        results[mode] = (eager, [t.clone() for t in captured])
    for off, on in zip(results["0"], results["1"], strict=True):
        for a, b in zip(off, on, strict=True):
            assert torch.equal(a, b)
    assert torch.equal(results["1"][0][0], results["1"][1][0])  # eager and graph agree too
