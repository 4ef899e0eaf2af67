"""The Triton GEMV for 16-bit weights at few rows (kernels/gemv.py): against torch's linear, its checks, and how the
model reaches it (PAGODA_DENSE_GEMV=1: quantized_linear's dispatch and PDL for single-token steps)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagoda.kernels import gemv
from pagoda.kernels.fp8_weight_only import GemvTiles
from pagoda.services.worker.models.base import quantized_linear, reference_ops, triton_ops


def _case(rows: int, dtype: torch.dtype, n: int = 48, k: int = 96,
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype)  # [M, K]
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)  # [N, K]
    bias = torch.randn(n, generator=gen).to(dtype)  # [N]
    return x, weight, bias


def _expected(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ weight.float().t()
    return out if bias is None else out + bias.float()


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dense_gemv_matches_linear(rows: int, dtype: torch.dtype) -> None:
    """FMA rows (1, 3) and tensor-core tiles (8), with and without bias, default tiles."""
    x, weight, bias = _case(rows, dtype)
    for b in (None, bias):
        got = gemv.dense_gemv(x, weight, b)
        assert got.shape == (rows, 48) and got.dtype == dtype
        torch.testing.assert_close(got.float(), _expected(x, weight, b), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tiles", [None,  # default_tiles: 32-row tensor-core tiles, two M tiles
                                   GemvTiles(block_m=16, block_n=32, block_k=32, split_k=2, use_dot=True),
                                   GemvTiles(block_m=64, block_n=64, block_k=32, split_k=3, use_dot=True,
                                             swap_ab=True)])
def test_dense_gemv_at_decode_batches(tiles: GemvTiles | None) -> None:
    """Rows past MAX_ROWS (a tuned entry's decode batches): tensor-core tiles over several M tiles, split-K with an
    uneven last split, the weight on the dot's M side (swap_ab), with bias."""
    x, weight, bias = _case(40, torch.bfloat16, n=80, k=96, seed=2)
    got = gemv.dense_gemv(x, weight, bias, tiles=tiles)
    assert got.shape == (40, 80) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), _expected(x, weight, bias), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("tiles", [GemvTiles(block_n=16, block_k=32, split_k=3),
                                   GemvTiles(block_n=32, block_k=64, split_k=2, late_reduce=True)])
def test_dense_gemv_split_k_sums_with_bias(tiles: GemvTiles) -> None:
    """K over several programs (an uneven last split, and a split past K's end): the partials and the bias summed."""
    x, weight, bias = _case(1, torch.float16, n=40, k=96, seed=1)
    got = gemv.dense_gemv(x[0], weight, bias, tiles=tiles)  # a 1-D x keeps its shape
    assert got.shape == (40,)
    torch.testing.assert_close(got.float(), _expected(x, weight, bias)[0], atol=2e-2, rtol=2e-2)


def test_dense_gemv_checks_its_arguments() -> None:
    x, weight, _ = _case(2, torch.float16)
    with pytest.raises(ValueError, match="bf16/fp16"):
        gemv.dense_gemv(x.float(), weight.float())
    with pytest.raises(ValueError, match="dtype"):
        gemv.dense_gemv(x.bfloat16(), weight)
    with pytest.raises(ValueError, match="at most"):
        gemv.dense_gemv(torch.zeros(gemv.MAX_TUNED_ROWS + 1, 96, dtype=torch.float16), weight)
    with pytest.raises(ValueError, match="contiguous"):
        gemv.dense_gemv(x, weight.t().contiguous().t())
    assert gemv.dense_gemv(x[:0], weight).shape == (0, 48)


def test_the_model_takes_it_only_when_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    """quantized_linear routes 16-bit weights at few rows to ops.dense_gemv under PAGODA_DENSE_GEMV=1, and a dense
    model's single-token steps launch with PDL then."""
    from pagoda.kernels import pdl
    from pagoda.services.worker.models import CausalLM
    from pagoda.shared.shapes import SHAPES

    calls: list[tuple[int, ...]] = []

    def recording(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return torch.nn.functional.linear(x, weight, bias)

    ops = dataclasses.replace(reference_ops(), dense_gemv=recording)
    x, weight, bias = _case(4, torch.bfloat16)
    monkeypatch.delenv("PAGODA_DENSE_GEMV", raising=False)
    quantized_linear(x, weight, None, None, bias, ops)
    assert calls == [] and not gemv.applies(x, weight)
    monkeypatch.setenv("PAGODA_DENSE_GEMV", "1")
    out = quantized_linear(x, weight, None, None, bias, ops)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias))
    quantized_linear(torch.zeros(gemv.MAX_ROWS + 1, 96, dtype=torch.bfloat16), weight, None, None, None, ops)
    quantized_linear(x.float(), weight.float(), None, None, None, ops)  # fp32 weights: torch's linear
    assert calls == [(4, 96)]
    model = CausalLM(SHAPES["tiny"], torch.float32, torch.device("cpu"), ops=triton_ops())
    assert model.pdl_mode(1) == pdl.FIRST and model.pdl_mode(2) == 0
    monkeypatch.setenv("PAGODA_DENSE_GEMV", "0")
    assert model.pdl_mode(1) == 0


def test_gpu_linears_take_tuned_tiles_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU a linear takes the GEMV where its tuned entry holds tiles unless PAGODA_DENSE_GEMV=0; "cublas" or
    no entry keeps torch's linear; off a GPU only PAGODA_DENSE_GEMV=1 sends it there."""
    tiles = GemvTiles(block_m=1, block_n=8, block_k=1024, num_warps=8, num_stages=3)
    monkeypatch.delenv("PAGODA_DENSE_GEMV", raising=False)
    assert gemv.linear_takes_gemv(True, tiles)
    assert not gemv.linear_takes_gemv(True, gemv.CUBLAS) and not gemv.linear_takes_gemv(True, None)
    assert not gemv.linear_takes_gemv(False, None)
    monkeypatch.setenv("PAGODA_DENSE_GEMV", "0")
    assert not gemv.linear_takes_gemv(True, tiles)
    monkeypatch.setenv("PAGODA_DENSE_GEMV", "1")
    assert gemv.linear_takes_gemv(True, tiles) and gemv.linear_takes_gemv(False, None)
    assert not gemv.linear_takes_gemv(True, gemv.CUBLAS)
    # decode batches past MAX_ROWS: tuned tiles only, on and off a GPU, whatever the switch says
    for switch in ("", "1"):
        monkeypatch.setenv("PAGODA_DENSE_GEMV", switch)
        assert gemv.linear_takes_gemv(True, tiles, gemv.MAX_TUNED_ROWS)
        assert gemv.linear_takes_gemv(True, tiles, gemv.MAX_ROWS) == gemv.linear_takes_gemv(True, tiles)
        assert not gemv.linear_takes_gemv(True, None, gemv.MAX_ROWS + 1)
        assert not gemv.linear_takes_gemv(True, gemv.CUBLAS, 64)
        assert not gemv.linear_takes_gemv(False, None, gemv.MAX_ROWS + 1)
    monkeypatch.setenv("PAGODA_DENSE_GEMV", "0")
    assert not gemv.linear_takes_gemv(True, tiles, 64)


def test_tuned_table_picks_tiles_or_keeps_cublas(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A table as bench/gemv_tune writes it: tiles per (N, K, M bucket), "cublas" where torch's linear won (the
    layer then stays there); other shapes, buckets and CPU tensors get the default tiles."""
    import json

    from pagoda.kernels import fp8_weight_only as w8

    tiles = GemvTiles(block_m=1, block_n=32, block_k=1024, split_k=2, num_warps=8, num_stages=3)
    wide = GemvTiles(block_m=64, block_n=128, block_k=128, split_k=4, use_dot=True, num_warps=8, num_stages=3,
                     swap_ab=True)
    (tmp_path / gemv.config_name("Test_GPU")).write_text(json.dumps(
        {"4096,4096,1": dataclasses.asdict(tiles), "4096,4096,2": {"cublas": True},
         "4096,4096,64": dataclasses.asdict(wide)}))
    monkeypatch.setattr(gemv, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(gemv, "_device_name", lambda index: "Test GPU")
    gemv.tuned_table.cache_clear()
    try:
        cuda = torch.device("cuda", 0)
        assert gemv.tuned_table("Test GPU") == {(4096, 4096, 1): tiles, (4096, 4096, 2): gemv.CUBLAS,
                                                (4096, 4096, 64): wide}
        assert gemv.pick_tiles(1, 4096, 4096, cuda) == tiles
        assert gemv.pick_tiles(40, 4096, 4096, cuda) == wide  # 33-64 rows: the 64-row bucket
        assert gemv._tuned_entry(2, 4096, 4096, cuda) == gemv.CUBLAS
        assert gemv.pick_tiles(2, 4096, 4096, cuda) == w8.default_tiles(2, 4096, 4096), "cublas: no tiles of its own"
        assert gemv.pick_tiles(1, 2048, 4096, cuda) == w8.default_tiles(1, 2048, 4096)
        assert gemv.pick_tiles(1, 4096, 4096, torch.device("cpu")) == w8.default_tiles(1, 4096, 4096)
        assert gemv.tuned_table("Other GPU") == {}
    finally:
        gemv.tuned_table.cache_clear()


def test_tuner_candidates_take_16_bit_weights_at_every_bucket() -> None:
    """bench/gemv_tune tries tiles at every bucket the dispatch can look up (1 .. MAX_TUNED_ROWS rows), none of them
    act_fp8 (W8A8 tiles need e4m3 weights and their scales); from 16 rows the tensor-core ones, swap_ab among them."""
    from pagoda.bench.gemv_tune import BUCKETS, dense_candidates

    assert BUCKETS[0] == 1 and BUCKETS[-1] == gemv.MAX_TUNED_ROWS
    for bucket in BUCKETS:
        tiles = dense_candidates(bucket)
        assert tiles and not any(t.act_fp8 for t in tiles), bucket
        if bucket >= 16:
            assert all(t.use_dot for t in tiles) and any(t.swap_ab for t in tiles), bucket


def test_tuner_precompiles_16_bit_candidates_in_parts() -> None:
    """bench/gemv_tune compiles a layer's candidates through fp8_tune.precompile with its own compile function (16-bit
    weights, no scales: another specialisation of the kernel than the FP8 tuner's), split into `jobs` parts; a
    tile set the kernel refuses is skipped, not fatal. Inline here (the interpreter), spawned processes on the GPU."""
    from concurrent.futures import Executor, Future

    from pagoda.bench import fp8_tune
    from pagoda.bench.gemv_tune import compile_dense_tiles
    from pagoda.kernels.fp8_weight_only import tiles_to_json

    class Inline(Executor):
        def submit(self, fn, /, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN204
            future: Future = Future()
            future.set_result(fn(*args, **kwargs))
            return future

    fits = GemvTiles(block_m=1, block_n=16, block_k=64)
    refused = GemvTiles(block_m=1, block_n=16, block_k=64, use_dot=True)  # tensor cores need 16 rows
    assert compile_dense_tiles(32, 128, 1, [tiles_to_json(t) for t in (fits, refused)]) == 1
    jobs: list[tuple[int, int]] = []

    def counting(n: int, k: int, bucket: int, tiles: list[dict]) -> int:
        jobs.append((bucket, len(tiles)))
        return compile_dense_tiles(n, k, bucket, tiles)

    launched = fp8_tune.precompile(32, 128, (1, 2), "all", 2, Inline(), compile_fn=counting,
                                   candidates_of=lambda bucket: [fits, refused, fits][:bucket + 1])
    assert launched == 1 + 2  # bucket 1: [fits, refused]; bucket 2: [fits, refused, fits]
    assert sorted(jobs) == [(1, 1), (1, 1), (2, 1), (2, 2)]


@pytest.mark.parametrize("shape", ["tiny", "tiny-qwen3", "tiny-moe", "tiny-deepseek-v3"])
def test_tuner_shapes_are_the_models_linear_weights(shape: str) -> None:
    """bench/gemv_tune tunes (N, K) pairs the model really multiplies by: each is one of its 2-D weights."""
    import itertools

    from pagoda.bench.gemv_tune import linear_shapes
    from pagoda.services.worker.models import CausalLM
    from pagoda.shared.shapes import SHAPES

    arch = SHAPES[shape]
    model = CausalLM(arch, torch.float32, torch.device("cpu"), max_positions=64)
    stored = {tuple(t.shape) for t in itertools.chain(model.parameters(), model.buffers()) if t.dim() == 2}
    names = [name for name, _, _ in linear_shapes(arch)]
    assert "o" in names and ("gate_up" in names) == (arch.moe is None or len(arch.moe.sparse_layers) < arch.num_layers)
    for name, n, k in linear_shapes(arch):
        assert (n, k) in stored, f"{shape} {name}: no [{n}, {k}] weight among {sorted(stored)}"


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_head_gemv_matches_bmm_for_both_absorbed_layouts(rows: int, dtype: torch.dtype) -> None:
    """MLA's two absorbed projections as head_gemv computes them against torch.bmm in fp32: the query through W_UK
    (a [heads, Dn, R] view contiguous along N) and the latent output through W_UV^T (contiguous along K), the rows a
    strided view and the output written through a transposed view."""
    gen = torch.Generator().manual_seed(rows)
    heads, dn, r, dv = 4, 32, 80, 48  # R not a power of two: masked N and K tails
    kv_b = (torch.randn(heads, dn + dv, r, generator=gen) / r ** 0.5).to(dtype)  # [heads, Dn + Dv, R]
    w_uk, w_uv = kv_b[:, :dn], kv_b[:, dn:]  # [heads, Dn, R], [heads, Dv, R]
    q = torch.randn(rows, heads, dn + 16, generator=gen).to(dtype)  # [T, heads, Dn + P]
    q_nope = q[..., :dn].transpose(0, 1)  # [heads, T, Dn]
    q_lat = gemv.head_gemv(q_nope, w_uk)  # [heads, T, R]
    torch.testing.assert_close(q_lat.float(), torch.bmm(q_nope.float(), w_uk.float()), rtol=2e-2, atol=2e-2)
    out_lat = torch.randn(rows, heads, r, generator=gen).to(dtype)  # [T, heads, R]
    attn = torch.full((rows, heads, dv), float("nan"), dtype=dtype)  # [T, heads, Dv]
    got = gemv.head_gemv(out_lat.transpose(0, 1), w_uv.transpose(1, 2), out=attn.transpose(0, 1))
    assert got.data_ptr() == attn.data_ptr()
    expected = torch.bmm(out_lat.transpose(0, 1).float(), w_uv.transpose(1, 2).float()).transpose(0, 1)
    torch.testing.assert_close(attn.float(), expected, rtol=2e-2, atol=2e-2)


def test_head_gemv_checks_its_arguments() -> None:
    x, w = torch.zeros(2, 3, 8, dtype=torch.bfloat16), torch.zeros(2, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="heads"):
        gemv.head_gemv(x, w[:, :4])
    with pytest.raises(ValueError, match="dtype"):
        gemv.head_gemv(x.half(), w)
    with pytest.raises(ValueError, match="at most"):
        gemv.head_gemv(torch.zeros(2, gemv.MAX_ROWS + 1, 8, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="out must be"):
        gemv.head_gemv(x, w, out=torch.zeros(2, 3, 8, dtype=torch.bfloat16))
    assert gemv.head_gemv(x[:, :0], w).shape == (2, 0, 16)


def test_mla_model_with_the_triton_gemvs_matches_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny DeepSeek-V3 through the Triton ops, decode steps of 1-3 tokens: with PAGODA_DENSE_GEMV=1 its 16-bit
    projections and absorbed per-head projections run on the Triton GEMVs and the hidden states stay within fp32
    rounding of the default (cuBLAS / torch.bmm) path."""
    from pagoda.bench.decode_profile import make_batch
    from pagoda.services.worker.models import CausalLM
    from pagoda.services.worker.weights import load_model
    from pagoda.shared.shapes import SHAPES

    arch, dev = SHAPES["tiny-deepseek-v3"], torch.device("cpu")
    head_calls: list[tuple[int, ...]] = []
    ops = triton_ops()
    ops = dataclasses.replace(ops, head_gemv=lambda x, w, out=None: head_calls.append(tuple(x.shape))
                              or gemv.head_gemv(x, w, out))
    model = CausalLM(arch, torch.float32, dev, max_positions=64, ops=ops)
    load_model(model, None, "dummy", seed=3)
    prefill_meta, prefill_pos, num_blocks = make_batch([3, 2, 4], [3, 2, 4], dev)
    decode_meta, decode_pos, _ = make_batch([1, 1, 1], [4, 3, 5], dev)
    ids = torch.tensor([5, 9, 11, 7, 8, 3, 4, 6, 2], device=dev)
    results = []
    for switch in ("0", "1"):
        monkeypatch.setenv("PAGODA_DENSE_GEMV", switch)
        head_calls.clear()
        caches = [(torch.zeros(num_blocks, 16, 1, arch.mla.entry_dim),) for _ in range(arch.num_layers)]
        with torch.inference_mode():
            model(ids, prefill_pos, caches, prefill_meta)  # 9 rows: never the per-head GEMV
            results.append(model(ids[[2, 4, 8]], decode_pos, caches, decode_meta))  # [3, H]
        assert head_calls == ([] if switch == "0" else [(arch.num_heads, 3, arch.mla.qk_nope_head_dim),
                                                         (arch.num_heads, 3, arch.mla.kv_lora_rank)] * arch.num_layers)
    torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-4)
