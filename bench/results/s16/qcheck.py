import torch
from pagoda.kernels import fp8, reference as ref
g = torch.Generator(device="cuda").manual_seed(0)
for shape, gs in (((300, 4096), None), ((64, 14336), None), ((37, 7168), 128)):
    x = (torch.randn(*shape, device="cuda", generator=g) * 3).bfloat16()
    q, s = fp8.quantize_fp8_rows(x, gs)
    qr, sr = ref.quantize_fp8_rows(x.cpu(), gs)
    print(shape, gs, "scales equal to the CPU reference:", torch.equal(s.cpu(), sr),
          "codes equal:", torch.equal(q.cpu().view(torch.uint8), qr.view(torch.uint8)))
