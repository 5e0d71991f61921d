"""Quantized frozen base linears for QLoRA runs (`--base-dtype nf4`), stored and executed as memcalc models them
(memcalc/cost/states.py `frozen_bytes`, memcalc/cost/activations.py `dequant_bytes`):

- storage: 4-bit NF4 codes packed two per byte, one absmax per block of 64 weights: fp32, or with double
  quantization an 8-bit code per block plus one fp32 scale per 256 blocks (Dettmers et al. 2023, sec. 2-3);
- forward and backward: the weight is dequantized to the compute dtype into one new tensor just before its
  matmul and freed after it (bitsandbytes `MatMul4Bit`; torchao `linear_nf4`);
- what autograd keeps: bitsandbytes keeps the input when it needs a gradient (`ctx.tensors = (A, B)`), torchao
  none (`--quant-backend`). bitsandbytes stores it as a `ctx` attribute, not with `save_for_backward`, so backward
  does not free it: it lives until the graph is dropped (memcalc/cost/activations.py `graph_held_layer_bytes`),
  and so it does here. Inside a checkpointed block (full or op-level) it is saved through `save_for_backward`
  instead, which the checkpoint drops: that is reentrant checkpointing's outcome (its forward runs under no_grad,
  so MatMul4Bit keeps nothing), the form transformers and PEFT use with bitsandbytes.

bitsandbytes dequantizes in one fused CUDA kernel that allocates nothing but its output (its double-quant path
allocates an fp32 absmax of n/64 elements first, which is not modelled). Here that runs with the tracker paused,
writing into the one tracked output, on a GPU in pieces of `PIECE` weights, so that the GPU sees no more scratch
than the kernel would (about 6 MiB). torchao's `NF4Tensor.get_original_weight` (torchtune's QLoRA; the same ops
from torchao 0.1 to 0.18) is eager PyTorch, and its temporaries are real: it runs here op for op, tracked
(`_torchao_dequantize`). The codes round to the NF4 levels of the QLoRA paper's appendix; the values matter only
so that training runs sensibly.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

BLOCK = 64  # weights per absmax
BLOCK2 = 256  # absmax blocks per second-level fp32 scale (double quantization)
PIECE = 1 << 18  # weights dequantized per untracked piece (a multiple of 2 x BLOCK): 1 MiB of fp32 scratch

# the 16 NF4 levels (QLoRA appendix E), normalized to [-1, 1]
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)


def piece_size(t: torch.Tensor, budget: int, whole: int) -> int:
    """How much of an untracked computation to do at once: `budget` elements on a GPU, whose allocator would
    count the scratch; the `whole` elsewhere (only the tracked tensors are measured there)."""
    return budget if t.is_cuda else whole


class QuantLinear(nn.Module):
    """A frozen linear stored in NF4 (no bias: the harness's models have none where they quantize)."""

    def __init__(self, base: nn.Linear, compute_dtype: torch.dtype, double_quant: bool, backend: str) -> None:
        super().__init__()
        if base.bias is not None:
            raise ValueError("QuantLinear quantizes bias-free linears only")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.compute_dtype, self.backend, self.double_quant = compute_dtype, backend, double_quant
        self.untracked: Callable[[], Any] = contextlib.nullcontext  # the harness sets its tracker's pause
        self.checkpointed = False  # inside a checkpointed block (see the module's docstring)
        w = base.weight.detach().float().reshape(-1)
        n = w.numel()
        pad = -n % BLOCK
        blocks = F.pad(w, (0, pad)).view(-1, BLOCK)
        absmax = blocks.abs().amax(dim=1).clamp_min(1e-12)
        levels = torch.tensor(NF4_LEVELS, device=w.device)
        codes = ((blocks / absmax[:, None]).unsqueeze(-1) - levels).abs().argmin(dim=-1).to(torch.uint8).view(-1)
        codes = codes[: n + n % 2]  # an odd count pads one code (the blocks were padded to 64)
        packed = (codes[0::2] << 4) | codes[1::2]
        self.packed = nn.Parameter(packed.contiguous(), requires_grad=False)  # ceil(n / 2) bytes
        if double_quant:
            nb = absmax.numel()
            groups = F.pad(absmax, (0, -nb % BLOCK2)).view(-1, BLOCK2)
            scale2 = groups.amax(dim=1).clamp_min(1e-12)  # fp32, one per 256 blocks
            code8 = (groups / scale2[:, None] * 255).round().to(torch.uint8).view(-1)[:nb].clone()  # own storage
            self.absmax_code = nn.Parameter(code8.contiguous(), requires_grad=False)  # 1 byte per block
            self.absmax_scale = nn.Parameter(scale2.contiguous(), requires_grad=False)
        else:
            self.absmax = nn.Parameter(absmax.contiguous(), requires_grad=False)  # fp32 per block
        self.n = n

    def _absmax(self) -> torch.Tensor:
        if not self.double_quant:
            return self.absmax
        nb = self.absmax_code.numel()
        scale = self.absmax_scale.repeat_interleave(BLOCK2)[:nb]
        return self.absmax_code.float() / 255 * scale

    def dequantize(self) -> torch.Tensor:
        """The weight in the compute dtype: one new (out, in) tensor, everything else untracked. A weight quantized
        from fp16 (`bnb-fp16`: bitsandbytes <= 0.42's `Params4bit.cuda` takes `.half()`, as does Lightning's
        `_Linear4bit.quantize`) dequantizes to fp16, and the caller's `.to(A.dtype)` makes the compute-dtype copy
        beside it."""
        if self.backend == "bnb-fp16" and self.compute_dtype != torch.float16:
            return self._dequantize(torch.float16).to(self.compute_dtype)
        return self._dequantize(self.compute_dtype)

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.backend == "torchao" and self.n % BLOCK == 0:
            return self._torchao_dequantize(dtype)
        out = torch.empty(self.out_features, self.in_features, dtype=dtype, device=self.packed.device)
        flat = out.view(-1)
        with self.untracked():
            levels = torch.tensor(NF4_LEVELS, device=self.packed.device)
            absmax = self._absmax()
            piece = piece_size(out, PIECE, self.n + self.n % 2)
            for lo in range(0, self.n, piece):  # PIECE is even and a multiple of BLOCK: pieces align
                hi = min(lo + piece, self.n)
                packed = self.packed[lo // 2: (hi + 1) // 2]
                codes = torch.stack((packed >> 4, packed & 15), dim=1).view(-1)[: hi - lo].long()
                scale = absmax[lo // BLOCK: -(-hi // BLOCK)].repeat_interleave(BLOCK)[: hi - lo]
                flat[lo:hi].copy_(levels[codes] * scale)
        return out

    def _torchao_dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """torchao's `NF4Tensor.get_original_weight` op for op (tracked): each half of the packed bytes widened to
        int64, looked up in the level table (in the weight's dtype), scaled by the per-block scalers repeated over
        the half-block, and the halves interleaved by `stack`; its locals live until it returns, so at the stack
        8 n + 3 c n + c n / 64 bytes are live for n weights of c bytes (memcalc/cost/activations.py
        `dequant_scratch`, which counts the part beyond the output)."""
        dev = self.packed.device
        first = (self.packed >> 4).to(torch.long)
        second = (self.packed & 0b1111).to(torch.long)
        levels = torch.tensor(NF4_LEVELS, device=dev, dtype=dtype)
        dq_first = levels[first]
        dq_second = levels[second]
        # the double-quantized scalers, one per block in the weight's dtype (`dequantize_scalers`)
        scalers = torch.empty(self.n // BLOCK, dtype=dtype, device=dev)
        with self.untracked():
            scalers.copy_(self._absmax())
        repeated = scalers.unsqueeze(-1).expand(scalers.size(0), BLOCK // 2)
        scaled_first = (dq_first * repeated.flatten()).unsqueeze(-1).transpose(0, 1)
        scaled_second = (dq_second * repeated.flatten()).unsqueeze(-1).transpose(0, 1)
        out = torch.stack([scaled_first, scaled_second], dim=-1).reshape(self.out_features, self.in_features)
        del first, second, dq_first, dq_second, scalers, repeated, scaled_first, scaled_second
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _QuantMatmul.apply(x, self)


class _QuantMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, q: QuantLinear) -> torch.Tensor:  # type: ignore[override]
        w = q.dequantize()
        out = F.linear(x, w)
        del w
        ctx.q = q
        if q.backend.startswith("bnb") and ctx.needs_input_grad[0]:
            # MatMul4Bit keeps A although B is frozen, on ctx: alive until the graph is dropped
            if q.checkpointed:
                ctx.save_for_backward(x)
            else:
                ctx.tensors = (x,)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        if not ctx.needs_input_grad[0]:
            return None, None
        # bitsandbytes reads A back (`A, B = ctx.tensors`) and holds it through this backward. Checkpointed, as
        # under reentrant checkpointing (the transformers/PEFT default that memcalc assumes,
        # `graph_held_layer_bytes`): the layer is re-run before any of its backward and A is alive here. The
        # non-reentrant checkpoint used by the harness re-runs the layer at the first unpack and hands the
        # re-made tensor over, so unpacking x now and keeping it until the return gives the same moments.
        held = ctx.saved_tensors if ctx.q.checkpointed else getattr(ctx, "tensors", ())
        w = ctx.q.dequantize()
        out = grad.matmul(w.to(grad.dtype))
        del w, held
        return out, None


def quantize_base(model: nn.Module, compute_dtype: torch.dtype, double_quant: bool, backend: str,
                  head: bool) -> list[QuantLinear]:
    """Replace every frozen linear of the blocks (and the LM head's with `head`) by a QuantLinear;
    adapters (trainable) stay as they are. Returns the new modules."""
    from memcalc.validate.model import Checkpointed  # full and op-level (its subclass) recompute

    made: list[QuantLinear] = []
    roots: list[nn.Module] = list(model.layers.values()) + ([model.head] if head else [])
    for root in roots:
        checkpointed = isinstance(root, Checkpointed)
        for parent in list(root.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and not child.weight.requires_grad:
                    q = QuantLinear(child, compute_dtype, double_quant, backend)
                    q.checkpointed = checkpointed
                    setattr(parent, name, q)
                    made.append(q)
    return made
