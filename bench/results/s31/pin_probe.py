"""How long pinning host memory takes on the device (session 31: a 16 GiB pinned swap pool added ~49 s to load)."""
import ctypes
import time

import numpy as np
import torch

GIB = 1 << 30


def timed(name, fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    print(f"{name}: {time.perf_counter() - start:.2f} s", flush=True)
    return out


torch.cuda.init()
size = 4 * GIB
a = timed("torch.empty 4 GiB pin_memory=True", lambda: torch.empty(size, dtype=torch.uint8, pin_memory=True))
del a
b = timed("64 x 64 MiB pin_memory=True", lambda: [torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
                                                 for _ in range(64)])
del b
cudart = torch.cuda.cudart()


def register():
    buf = np.empty(size, dtype=np.uint8)
    rc = cudart.cudaHostRegister(buf.ctypes.data, size, 0)
    return buf, rc


c = timed("numpy 4 GiB + cudaHostRegister", register)
print("rc", c[1])
cudart.cudaHostUnregister(c[0].ctypes.data)
del c
d = timed("torch.empty 4 GiB + .pin_memory()", lambda: torch.empty(size, dtype=torch.uint8).pin_memory())
del d
x = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
g = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(20):
    x.copy_(g, non_blocking=True)
torch.cuda.synchronize()
print(f"D2H pinned: {20 * 64 / 1024 / (time.perf_counter() - start):.1f} GiB/s")
start = time.perf_counter()
for _ in range(20):
    g.copy_(x, non_blocking=True)
torch.cuda.synchronize()
print(f"H2D pinned: {20 * 64 / 1024 / (time.perf_counter() - start):.1f} GiB/s")
