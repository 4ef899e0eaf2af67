"""Pinning 16 GiB on the device, each way in a fresh process (argv[1]: alloc | register)."""
import sys
import time

import numpy as np
import torch

size = 16 << 30
torch.cuda.init()
torch.cuda.synchronize()
start = time.perf_counter()
if sys.argv[1] == "alloc":
    buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
else:
    arr = np.empty(size, dtype=np.uint8)
    rc = torch.cuda.cudart().cudaHostRegister(arr.ctypes.data, size, 0)
    buf = torch.from_numpy(arr)
    assert buf.is_pinned(), rc
print(f"{sys.argv[1]} 16 GiB: {time.perf_counter() - start:.2f} s", flush=True)
