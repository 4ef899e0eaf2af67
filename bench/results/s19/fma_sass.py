"""SASS of the W8A16 kernel's one-row FMA tiles (committed llama3-8b table) for whatever pagoda is on the path."""
import collections, hashlib, inspect, os, re, sys
sys.path.insert(0, "/work/main/tests")
import torch
import gpu_compile
gpu_compile.driver.set_active(gpu_compile.CompileOnlyDriver())
from pagoda.bench import attention_sass as sass_tools
from pagoda.kernels import fp8_weight_only as w8
print(w8.__file__)
params = set(inspect.signature(w8._w8a16_kernel.fn).parameters)
table = w8.tuned_table("NVIDIA H200")
for (n, k, m), tiles in sorted(table.items()):
    if m != 1 or not isinstance(tiles, w8.GemvTiles):
        continue
    for gated in ((False, True) if n == 4096 and k == 14336 and "GATED" in params else (False,)):
        x = torch.empty(1, (2 if gated else 1) * k, dtype=torch.bfloat16)
        weight = torch.empty(n, k, dtype=torch.float8_e4m3fn); scale = torch.empty(n, 1)
        out = torch.empty(1, n, dtype=torch.bfloat16); part = torch.empty(tiles.split_k, 1, n)
        extra = {key: value for key, value in dict(GATED=gated, ACT_FP8=False, HW_CAST=True).items() if key in params}
        kern = w8._w8a16_kernel.warmup(x, weight, scale, out, part, out, 1, n, k, x.stride(0), weight.stride(0),
            scale.stride(0), out.stride(0), part.stride(0) if tiles.split_k > 1 else 0, GROUP_K=0,
            SPLIT_K=tiles.split_k, HAS_BIAS=False, USE_DOT=tiles.use_dot,
            EVEN_K=k % (tiles.split_k * tiles.block_k) == 0, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
            BLOCK_K=tiles.block_k, FP32_DOT=False, LATE_REDUCE=tiles.late_reduce, HAS_SCALE=True,
            SWAP_AB=tiles.swap_ab, DOT_PRECISION="tf32", USE_PDL=1, num_warps=tiles.num_warps,
            num_stages=tiles.num_stages, grid=(1,), **extra)
        sass, usage = sass_tools.disassemble(kern.asm["cubin"])
        regs = re.search(r"REG:(\d+)", usage).group(1)
        loops = [b for b in sass_tools.loop_bodies(sass) if len(b) > 20]
        body = max(loops, key=len) if loops else []
        top = collections.Counter(body).most_common(6)
        print(f"N={n} K={k} gated={gated} {tiles}: regs {regs}, loop {len(body)} instrs, total {len(sass)}, "
              f"ptx sha {hashlib.sha1(kern.asm['ptx'].encode()).hexdigest()[:10]}; {top}")
