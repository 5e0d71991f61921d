"""torchao's `linear_nf4` (torchtune's QLoRA linears) on a GPU: the allocated peak of its forward and of its backward
over what was live before, for Llama-2-7B's three weight shapes, beside memcalc's figure for the dequantization
(memcalc/cost/activations.py `dequant_scratch`: 8 n + 3 c n + c n / 64 bytes for n weights of c bytes, output
included). The record is docs/data/torchao-nf4-probe.json (tests/test_cuda_record.py).

    pip install --no-deps torchao==0.1       # pure Python; its NF4 code is the same up to torchao 0.18
    python scripts/torchao_probe.py          # on a machine with a GPU; writes $OUT or ./torchao_probe.json
"""
from __future__ import annotations

import json
import os

# Llama-2-7B's weight shapes (out, in): gate / up, q / k / v / o, down
SHAPES = ((11008, 4096), (4096, 4096), (4096, 11008))


def main() -> None:
    import torch
    import torchao
    from torchao.dtypes.nf4tensor import linear_nf4, to_nf4

    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "torchao": getattr(torchao, "__version__", "?"), "rows": []}
    for o, i in SHAPES:
        nf = to_nf4(torch.randn(o, i, dtype=torch.bfloat16, device="cuda"))
        x = torch.randn(2, 512, i, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        for _ in range(2):  # warm-up: the cuBLAS workspaces
            y = linear_nf4(x, nf)
            y.backward(torch.ones_like(y))
            x.grad = None
        del y
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y = linear_nf4(x, nf)
        torch.cuda.synchronize()
        fwd = torch.cuda.max_memory_allocated() - base
        g = torch.ones_like(y)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y.backward(g)
        torch.cuda.synchronize()
        bwd = torch.cuda.max_memory_allocated() - base
        n, c = o * i, 2
        row = dict(shape=[o, i], n=n, forward_peak_over_live=fwd, backward_peak_over_live=bwd,
                   output_bytes=y.nbytes, input_grad_bytes=x.grad.nbytes,
                   memcalc_dequant_peak=8 * n + 3 * c * n + c * (n // 64))
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
        del y, g, x, nf
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "torchao_probe.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
