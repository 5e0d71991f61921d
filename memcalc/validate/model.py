"""A small decoder-only transformer built from a `ModelSpec`: the layer the `torch` profile describes.

Op by op (what autograd saves is what the activation model must count; see docs/validation.md):
- embedding `tok` (V x h), optional learned positions `pos` (max_positions x h), added;
- per block: `norm1` (RMSNorm with the fused kernel's saved tensors / nn.LayerNorm) -> q, k, v (separate
  nn.Linear, GQA-sized k/v; with `qk_norm` q and k each through a norm over every head, Qwen3's order) -> rotary on q, k (rotate-half form, cos/sin computed once per forward in the
  activation dtype) -> attention core (SDPA with is_causal and enable_gqa for `flash`; matmul + additive causal bias + softmax + matmul for `eager`, k/v
  repeated for GQA) -> o -> residual add -> `norm2` -> MLP (SwiGLU: down(silu(gate(x)) * up(x)); GELU:
  proj(gelu_tanh(fc(x))); MoE models: `MoE`, HF's MixtralSparseMoeBlock with balanced routing, the first
  `first_dense_layers` keeping the dense MLP) -> residual add; MLA models: `LatentAttention` (HF
  DeepseekV3Attention) in place of q/k/v/o; a parallel block (`ModelSpec.block`) returns mlp(n2) + attn(n1) + x
  with n2 = norm2(x), or n1 itself when the norm is shared (GPT-NeoX / lit-gpt order);
  with `post_norms` (Gemma 2/3) the attention's and the MLP's outputs each pass a norm before their residual add;
  with `attn_softcap` (Gemma 2) the eager scores pass tanh(x / 50) * 50 before the mask;
  dropout (when > 0, CUDA's native_dropout with its bool mask on every device) after o, after the MLP and on the
  attention probabilities;
- final norm, LM head (tied: shares `tok.weight`), logits in the compute dtype (with `final_logit_softcap`, Gemma
  2's tanh(x / 30) * 30); the loss upcasts them to fp32 (`loss_fn`).
q/k/v and gate/up are separate matrices so that DTensor's ColwiseParallel shards each along its output features;
the attention reshapes use -1 for the head count so that the same code runs on a TP shard.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from memcalc.cost.activations import SOFTMAX_PERSISTENT_MAX
from memcalc.specs import ModelSpec, lora_projections
from memcalc.validate.quant import piece_size


class _FusedRMSNorm(torch.autograd.Function):
    """y = x * rstd * w with rstd = rsqrt(mean(x^2) + eps) in fp32, saving only (x, rstd): what the CUDA kernel
    behind nn.RMSNorm (`aten._fused_rms_norm`, torch >= 2.8) and Apex / Transformer Engine fused norms keep for
    backward. On CPU torch runs the composite pow/mean/rsqrt/mul path instead, which also saves x * rstd.
    Like the fused kernels, forward allocates only y and rstd and backward only the input's and the weight's
    gradients: the fp32 intermediates (x.float(), x * rstd, the upcast output gradient) live in registers there,
    so here they are computed with the tracker paused (`untracked`, set by the harness) and copied into the tracked
    outputs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, eps: float, untracked: Any) -> torch.Tensor:
        with untracked():
            xf = x.float()
            r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            yv = (xf * r).to(x.dtype) * w
        rstd, y = torch.empty_like(r), torch.empty_like(yv)
        rstd.copy_(r)
        y.copy_(yv)
        ctx.save_for_backward(x, rstd, w)
        ctx.untracked = untracked
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> Any:
        x, rstd, w = ctx.saved_tensors
        with ctx.untracked():
            xhat = x.float() * rstd
            gwv = (gy.float() * xhat).sum(dim=tuple(range(gy.dim() - 1))).to(w.dtype)
            g = gy.float() * w.float()
            gxv = (rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(x.dtype)
        # outputs shaped (and, under TP, placed: a sequence-sharded weight gradient is a partial sum) as computed
        gx, gw = torch.empty_like(gxv), torch.empty_like(gwv)
        gx.copy_(gxv)
        gw.copy_(gwv)
        return gx, gw, None, None


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm with the saved tensors and the allocations of its fused CUDA kernel on every device (see
    `_FusedRMSNorm`); the cost model counts the input and the fp32 rstd (memcalc/cost/activations.py
    `_fp32_norm_stats`). An input whose dtype is not the weight's (a linear's bf16 output under AMP, fp32 weight)
    is refused by the fused kernel (aten/src/ATen/native/layer_norm.cpp: "Mismatch dtype between input and
    weight") and runs torch's composite on every device, autocast or not (AutocastCUDA does not cast rms_norm:
    read on an H100 with torch 2.11, scripts/gpu_validation.py's probe): an fp32 copy of the input, rstd and the
    normalized fp32 tensor are saved, and the output is cast back to the input's dtype
    (`activations._output_norm_saved`)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.untracked: Any = contextlib.nullcontext  # the harness sets its tracker's pause

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and x.dtype != self.weight.dtype:
            with warnings.catch_warnings():  # torch says why it takes the composite, once per process
                warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
                return super().forward(x)  # the same aten ops on every device
        if x.is_cuda:
            return super().forward(x)  # the real kernel: its allocations are what max_memory_allocated sees
        return _FusedRMSNorm.apply(x, self.weight, self.eps, self.untracked)


class EagerRMSNorm(nn.Module):
    """RMSNorm computed in fp32 from `x.float()` and cast back before the weight multiply (HF LlamaRMSNorm,
    torchtune RMSNorm; lit-gpt multiplies in fp32): autograd keeps the fp32 copy, rstd and, when the weight
    trains, the normalized tensor. The cost model's `--norm-impl fp32` (activations.py `_norm_saved`)."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def _norm(m: ModelSpec, impl: str = "fused") -> nn.Module:
    if m.norm == "rmsnorm":
        return EagerRMSNorm(m.hidden) if impl == "fp32" else RMSNorm(m.hidden, eps=1e-6)
    return nn.LayerNorm(m.hidden, eps=1e-5)


def cuda_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Dropout as CUDA runs F.dropout (aten native_dropout: a bool mask saved), on every device; on CPU F.dropout
    would save a mask in the input's dtype instead."""
    if not p or not training:
        return x
    return torch.native_dropout(x, p, True)[0]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_cos_sin(seq: int, dim: int, device: Any, dtype: torch.dtype, base: float = 10000.0, start: int = 0):
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    t = torch.arange(start, start + seq, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class _UlyssesExchange(torch.autograd.Function):
    """DeepSpeed-Ulysses' all-to-all (Jacobs et al. 2023 sec. 3; the op sequence of DeepSpeed's
    `deepspeed/sequence/layer.py` `single_all_to_all`, batch-first layout): to heads, (b, s/cp, H, d) ->
    (b, s, H/cp, d); to sequence, the inverse. The input is laid out per destination rank (a permuted contiguous
    copy), exchanged into a new buffer, and the result permuted into a contiguous tensor; the send and receive
    buffers are freed when it returns. Nothing is saved: backward exchanges the gradient the other way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return _ulysses_exchange(x, group, to_heads)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return _ulysses_exchange(g.contiguous(), ctx.group, not ctx.to_heads), None, None


def _ulysses_exchange(x: torch.Tensor, group: Any, to_heads: bool) -> torch.Tensor:
    import torch.distributed as dist

    n = dist.get_world_size(group)
    b, s, heads, d = x.shape
    if to_heads:  # scatter the heads, gather the sequence
        send = x.reshape(b, s, n, heads // n, d).permute(2, 0, 1, 3, 4).contiguous()
        recv = torch.empty_like(send)  # (source rank = sequence chunk, b, s/cp, H/cp, d)
        dist.all_to_all_single(recv, send, group=group)
        return recv.permute(1, 0, 2, 3, 4).contiguous().reshape(b, n * s, heads // n, d)
    send = x.reshape(b, n, s // n, heads, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)  # (source rank = head group, b, s/cp, H/cp, d)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).contiguous().reshape(b, s // n, n * heads, d)


class _CudaSoftmax(torch.autograd.Function):
    """Softmax over the last dimension, saving its output, whose backward allocates what CUDA's does: for rows
    longer than SOFTMAX_PERSISTENT_MAX (1024, memcalc/cost/activations.py) `_softmax_backward_data` allocates one
    more output-sized buffer beside the gradient (measured on an H100); the CPU kernel does not, so here the buffer
    is allocated beside it. On CUDA the harness runs torch's own softmax."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = torch.softmax(x, dim=-1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        scratch = torch.empty_like(y) if y.shape[-1] > SOFTMAX_PERSISTENT_MAX else None
        gi = torch._softmax_backward_data(g, y, -1, y.dtype)
        del scratch
        return gi


def softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1) if x.is_cuda else _CudaSoftmax.apply(x)


def _sdpa_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float) -> torch.Tensor:
    """Causal SDPA with enable_gqa as CUDA runs it for fp32 inputs: no fused kernel takes them (memcalc/cost/
    activations.py `eager_core`), so torch runs `_scaled_dot_product_attention_math`. The same ops in its order
    (scaled Q, the float causal mask, K and V repeated to every head, K^T scaled, scores + mask, softmax, dropout
    as CUDA's native_dropout, the value matmul), so that a CPU run allocates and saves what the GPU does; the CPU's
    own SDPA would take its flash kernel, which accepts fp32 GQA."""
    s, rep = q.shape[-2], q.shape[1] // k.shape[1]
    sf = math.sqrt(1.0 / math.sqrt(q.shape[-1]))
    qs = q * sf
    ones = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    mask = torch.where(ones, torch.tensor(0.0, device=q.device), torch.tensor(float("-inf"), device=q.device))
    del ones
    kr = k.repeat_interleave(rep, dim=1)  # held to the end, as the C++ function's local key_acc is
    vr = v.repeat_interleave(rep, dim=1)
    attn = torch.matmul(qs, kr.transpose(-2, -1) * sf)
    attn = attn + mask  # out of place under a dispatch mode (the harness's tracker), as the C++ code does then
    attn = softmax(attn)
    if p:
        attn = cuda_dropout(attn, p)
    return torch.matmul(attn, vr)


class Attention(nn.Module):
    def __init__(self, m: ModelSpec, kernel: str, dropout: float, selective: bool, qkv_impl: str = "separate",
                 gqa_impl: str = "native", norm_impl: str = "fused"):
        super().__init__()
        h, a, g, d = m.hidden, m.heads, m.kv_heads, m.head_dim
        self.d, self.rep, self.groups = d, a // g, g
        self.rotary = m.positions == "rotary"
        self.kernel, self.dropout, self.selective = kernel, dropout, selective
        self.fused = qkv_impl == "fused"
        self.expand = gqa_impl == "expand" and self.rep > 1
        if self.fused:
            # lit-gpt CausalSelfAttention: one matrix, output laid out per KV group as (q_per_kv queries, k, v)
            self.qkv = nn.Linear(h, (a + 2 * g) * d, bias=m.qkv_bias)
        else:
            self.q = nn.Linear(h, a * d, bias=m.qkv_bias)
            self.k = nn.Linear(h, g * d, bias=m.qkv_bias)
            self.v = nn.Linear(h, g * d, bias=m.qkv_bias)
        self.o = nn.Linear(a * d, h, bias=m.linear_bias)
        # Qwen3 / Gemma 3 (modeling_qwen3.py Qwen3Attention): q_norm and k_norm over each head before rotary; the
        # fused form casts a bf16 input to fp32 under autocast, as CUDA's autocast does for rms_norm
        per_head = m.model_copy(update={"hidden": d})
        self.q_norm = _norm(per_head, norm_impl) if m.qk_norm else None
        self.k_norm = _norm(per_head, norm_impl) if m.qk_norm else None
        self.cp_group: Any = None  # all-to-all context parallelism (Ulysses) over this group when set
        self.softcap = 50.0 if m.attn_softcap else 0.0  # Gemma 2's attn_logit_softcapping (its config's), eager only

    def _fused_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as views of the fused output (lit-gpt); under GQA k and v are expanded to every query head and
        the reshape copies them, as lit-gpt does for SDPA in training."""
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, self.groups, self.rep + 2, self.d).permute(0, 2, 3, 1, 4)
        q, k, v = qkv.split((self.rep, 1, 1), dim=2)
        if self.rep > 1:
            k = k.expand(b, self.groups, self.rep, s, self.d)
            v = v.expand(b, self.groups, self.rep, s, self.d)
        return tuple(t.reshape(b, -1, s, self.d) for t in (q, k, v))  # type: ignore[return-value]

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        if self.kernel == "flash":
            gqa = k.shape[1] != q.shape[1]  # fused QKV / --gqa-impl expand have expanded K/V already
            # the dtype the kernel runs in: autocast casts fp32 inputs (the fp32 output of a q/k norm under AMP)
            dev = q.device.type
            kernel_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else q.dtype
            if gqa and kernel_dtype == torch.float32 and not q.is_cuda:
                return _sdpa_math(q, k, v, p)
            if not q.is_cuda:
                # CUDA's flash and memory-efficient kernels drop out inside the kernel and save only its RNG state
                # (philox seed and offset); CPU's flash kernel takes no dropout, so SDPA would fall back to the math
                # path and save s x s probabilities and a mask per layer. The harness measures memory: on the CPU it
                # runs the kernel without dropout, which allocates and saves what the GPU's does.
                p = 0.0
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=gqa)
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(self.rep, dim=1)
            v = v.repeat_interleave(self.rep, dim=1)
        s = q.shape[-2]
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d)
        if self.softcap:
            # Gemma 2's eager_attention_forward: each step replaces `scores`, freeing its input
            scores = scores / self.softcap
            scores = torch.tanh(scores)
            scores = scores * self.softcap
        # an additive causal bias (HF's eager path; Megatron's fused kernel masks in place): the add saves nothing,
        # where masked_fill would save a mask per layer
        scores = scores + torch.full((s, s), float("-inf"), dtype=scores.dtype, device=q.device).triu(1)
        probs = softmax(scores.float()).to(q.dtype)
        if p:
            probs = cuda_dropout(probs, p)
        return torch.matmul(probs, v)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        if self.fused:
            q, k, v = self._fused_qkv(x)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
        else:
            # (HF Qwen3's order: q and its norm, k and its norm, v)
            q = self.q(x).view(b, s, -1, self.d)
            q = (q if self.q_norm is None else self.q_norm(q)).transpose(1, 2)
            k = self.k(x).view(b, s, -1, self.d)
            k = (k if self.k_norm is None else self.k_norm(k)).transpose(1, 2)
            v = self.v(x).view(b, s, -1, self.d).transpose(1, 2)
        if self.rotary:
            assert rope is not None
            cos, sin = rope
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        if self.fused:
            # lit-gpt's torch.cat after rotary leaves q and k head-major (contiguous), as is V's expanded copy
            q, k = q.contiguous(), k.contiguous()
        elif self.expand:
            # torchtune MultiHeadAttention: every K/V head copied to its query heads (flatten of the expanded view
            # copies), so SDPA saves the all-head copies
            shape = (b, k.shape[1], self.rep, s, self.d)  # local K/V heads under TP
            k = k.unsqueeze(2).expand(shape).flatten(1, 2)
            v = v.unsqueeze(2).expand(shape).flatten(1, 2)
        if self.cp_group is not None:
            # Ulysses: Q, K, V one after the other from sequence to head sharding; the kernel runs on the whole
            # sequence with its share of the heads (layout (b, s, H/cp, d), as DeepSpeed's flash path takes them)
            q, k, v = (_UlyssesExchange.apply(t.transpose(1, 2), self.cp_group, True).transpose(1, 2)
                       for t in (q, k, v))
        if self.selective:
            y = checkpoint(self._core, q, k, v, use_reentrant=False)
        else:
            y = self._core(q, k, v)
        if self.cp_group is not None:
            # the output back to sequence sharding: a new tensor, which the o projection saves, besides the
            # kernel's own (saved by SDPA for its backward)
            y = _UlyssesExchange.apply(y.transpose(1, 2), self.cp_group, False).reshape(b, s, -1)
            return cuda_dropout(self.o(y), self.dropout, self.training)
        if self.fused:
            # CUDA's flash kernel writes its output in q's (head-major) layout, so lit-gpt's
            # `y.transpose(1, 2).reshape(B, T, C)` copies it; CPU's kernel writes token-major, so make it head-major
            # first (a no-op on CUDA) to keep the copy the o projection reads
            y = y.contiguous()
        y = y.transpose(1, 2).reshape(b, s, -1)
        y = self.o(y)
        y = cuda_dropout(y, self.dropout, self.training)
        return y


class _WideKeyAttention(torch.autograd.Function):
    """Causal SDPA with a value width below the query/key width (MLA) as CUDA runs it: torch's memory-efficient
    kernel takes any value width and saves q, k, v, its output ((b, s, H, v) memory, read through a transposed view)
    and the fp32 log-sum-exp. CPU's SDPA falls back to the math path for such shapes (saving the s x s
    probabilities), so there this runs CPU's flash kernel on V zero-padded to the key width (the same result: the
    padding only adds zero output columns) and keeps the efficient kernel's saved set. The padded copies are
    transients of the call. On CUDA, SDPA itself picks the efficient kernel."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dv, pad = v.shape[-1], q.shape[-1] - v.shape[-1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, F.pad(v, (0, pad)), 0.0, True)
        y = out[..., :dv].transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, y, lse)
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> Any:
        q, k, v, y, lse = ctx.saved_tensors
        pad = q.shape[-1] - v.shape[-1]
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            F.pad(gy, (0, pad)), q, k, F.pad(v, (0, pad)), F.pad(y, (0, pad)), lse, 0.0, True)
        return gq, gk, gv[..., : v.shape[-1]]


class LatentAttention(nn.Module):
    """Multi-head latent attention in the op order of Hugging Face's `DeepseekV3Attention` (transformers
    models/deepseek_v3/modeling_deepseek_v3.py, SDPA path; DeepSeek-V2 sec. 2.1): the query through its latent
    (q_a, its RMSNorm, q_b) or one projection; one down projection to the kv latent and the shared rotary key,
    `split`; the latent's RMSNorm and kv_b to per-head key (nope) and value parts, `split` again (V stays a view of
    kv_b's output); rotary on the rope parts (the key's one head broadcast with `expand`), `cat` into Q and K;
    SDPA with a value width of its own; o. The latent norms are `_norm`'s (fused or the fp32 eager form)."""

    def __init__(self, m: ModelSpec, dropout: float, selective: bool, norm_impl: str = "fused"):
        super().__init__()
        x = m.mla
        assert x is not None
        h, a = m.hidden, m.heads
        self.nope, self.rope, self.v_dim, self.rank = x.qk_nope_dim, x.qk_rope_dim, x.v_head_dim, x.kv_lora_rank
        self.dropout, self.selective = dropout, selective
        qk = self.nope + self.rope
        if x.q_lora_rank:
            self.q_a = nn.Linear(h, x.q_lora_rank, bias=False)
            self.q_norm = _norm(m.model_copy(update={"hidden": x.q_lora_rank}), norm_impl)
            self.q_b = nn.Linear(x.q_lora_rank, a * qk, bias=False)
        else:
            self.q = nn.Linear(h, a * qk, bias=False)
        self.kv_a = nn.Linear(h, self.rank + self.rope, bias=False)
        self.kv_norm = _norm(m.model_copy(update={"hidden": self.rank}), norm_impl)
        self.kv_b = nn.Linear(self.rank, a * (self.nope + self.v_dim), bias=False)
        self.o = nn.Linear(a * self.v_dim, h, bias=False)
        self.cp_group: Any = None

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if v.shape[-1] < q.shape[-1] and q.device.type == "cpu":
            return _WideKeyAttention.apply(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_b(self.q_norm(self.q_a(x))) if hasattr(self, "q_a") else self.q(x)
        q = q.view(b, s, -1, self.nope + self.rope).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [self.nope, self.rope], dim=-1)
        latent, k_rot = torch.split(self.kv_a(x), [self.rank, self.rope], dim=-1)
        kv = self.kv_b(self.kv_norm(latent)).view(b, s, -1, self.nope + self.v_dim).transpose(1, 2)
        k_pass, v = torch.split(kv, [self.nope, self.v_dim], dim=-1)
        k_rot = k_rot.view(b, 1, s, self.rope)
        assert rope is not None
        cos, sin = rope
        q_rot = q_rot * cos + _rotate_half(q_rot) * sin
        k_rot = k_rot * cos + _rotate_half(k_rot) * sin
        q = torch.cat((q_pass, q_rot), dim=-1)
        k = torch.cat((k_pass, k_rot.expand(*k_pass.shape[:-1], -1)), dim=-1)
        y = checkpoint(self._core, q, k, v, use_reentrant=False) if self.selective else self._core(q, k, v)
        y = self.o(y.transpose(1, 2).reshape(b, s, -1))
        return cuda_dropout(y, self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, m: ModelSpec, dropout: float):
        super().__init__()
        self.gated = m.mlp == "swiglu"
        self.dropout = dropout
        if self.gated:
            self.gate = nn.Linear(m.hidden, m.ffn, bias=m.linear_bias)
            self.up = nn.Linear(m.hidden, m.ffn, bias=m.linear_bias)
        else:
            self.up = nn.Linear(m.hidden, m.ffn, bias=m.linear_bias)
        self.down = nn.Linear(m.ffn, m.hidden, bias=m.linear_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            y = self.down(F.silu(self.gate(x)) * self.up(x))
        else:
            y = self.down(F.gelu(self.up(x), approximate="tanh"))
        y = cuda_dropout(y, self.dropout, self.training)
        return y


class MoE(nn.Module):
    """A sparse MoE MLP in the form of Hugging Face's `MixtralSparseMoeBlock` (transformers
    models/mixtral/modeling_mixtral.py, read at 00d4b3d): a bias-free router, softmax over the experts in fp32,
    top-k, the k weights renormalised in place and cast back to the input dtype; then per expert the indices of its
    tokens (`torch.where` on the one-hot mask), the gathered tokens through the expert's SwiGLU / GELU MLP, the
    output times the tokens' weights, `index_add_` into the result. The routing is forced to balance (below).
    Shared experts (DeepSeek's, HF `DeepseekV3MoE`) are one MLP of width shared x expert_ffn on every token, added
    to the routed output."""

    def __init__(self, m: ModelSpec, dropout: float):
        super().__init__()
        moe = m.moe
        assert moe is not None
        self.k, self.dropout = moe.top_k, dropout
        self.gate = nn.Linear(m.hidden, moe.experts, bias=False)
        em = m.model_copy(update={"ffn": moe.expert_ffn, "moe": None})
        self.experts = nn.ModuleList(MLP(em, 0.0) for _ in range(moe.experts))
        sm = m.model_copy(update={"ffn": moe.shared_experts * moe.expert_ffn, "moe": None})
        self.shared = MLP(sm, 0.0) if moe.shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        xs = x.view(-1, h)
        w = F.softmax(self.gate(xs), dim=1, dtype=torch.float)
        # balanced round-robin routing (torchtitan's `_debug_force_load_balance`) in place of top-k: every expert
        # gets k * tok / E tokens, the balance the cost model assumes; `gather` saves its int64 index as topk does
        chosen = torch.arange(xs.shape[0] * self.k, device=xs.device).view(-1, self.k) % len(self.experts)
        w = w.gather(1, chosen)
        w /= w.sum(dim=-1, keepdim=True)
        w = w.to(xs.dtype)
        out = torch.zeros((b * s, h), dtype=xs.dtype, device=xs.device)
        mask = F.one_hot(chosen, num_classes=len(self.experts)).permute(2, 1, 0)
        for e, expert in enumerate(self.experts):
            slot, tok = torch.where(mask[e])
            if tok.numel() == 0:
                continue
            y = expert(xs[None, tok].reshape(-1, h)) * w[tok, slot, None]
            out.index_add_(0, tok, y.to(xs.dtype))
        out = out.reshape(b, s, h)
        if self.shared is not None:
            out = out + self.shared(x)
        return cuda_dropout(out, self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, m: ModelSpec, kernel: str, dropout: float, selective: bool, norm_impl: str = "fused",
                 qkv_impl: str = "separate", gqa_impl: str = "native", dense: bool = False):
        super().__init__()
        self.norm1 = _norm(m, norm_impl)
        if m.mla is not None:
            self.attn: nn.Module = LatentAttention(m, dropout, selective, norm_impl)
        else:
            self.attn = Attention(m, kernel, dropout, selective, qkv_impl, gqa_impl, norm_impl)
        # Gemma 2/3 (modeling_gemma2.py Gemma2DecoderLayer): x + post_attention_norm(attn(norm1 x)), then
        # + post_feedforward_norm(mlp(norm2 .)); registered in the order the forward uses them
        self.post_attn = _norm(m, norm_impl) if m.post_norms else None
        self.block = m.block
        self.norm2 = _norm(m, norm_impl) if m.block != "parallel-shared-norm" else None
        # an MoE model's first layers may keep a dense MLP of m.ffn (DeepSeek's first_k_dense_replace)
        self.mlp = MLP(m, dropout) if m.moe is None or dense else MoE(m, dropout)
        self.post_mlp = _norm(m, norm_impl) if m.post_norms else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if self.block == "sequential":
            # (no local names for the branch outputs: a reference would keep the attention output alive through
            # the MLP's forward, which no framework does)
            assert self.norm2 is not None
            if self.post_attn is None or self.post_mlp is None:
                x = x + self.attn(self.norm1(x), rope)
                return x + self.mlp(self.norm2(x))
            x = x + self.post_attn(self.attn(self.norm1(x), rope))
            return x + self.post_mlp(self.mlp(self.norm2(x)))
        # parallel residual, in GPT-NeoX's / lit-gpt's order: mlp(n2) + attn(n1) + x
        n1 = self.norm1(x)
        h = self.attn(n1, rope)
        n2 = n1 if self.norm2 is None else self.norm2(x)
        return self.mlp(n2) + h + x


class Embed(nn.Module):
    def __init__(self, m: ModelSpec, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(m.vocab, m.hidden)
        self.pos = nn.Embedding(m.max_positions, m.hidden) if m.positions == "learned" else None
        self.dropout = dropout
        self.seq_shard: tuple[int, int] | None = None  # (rank, size) under sequence parallelism
        self.seq_offset = 0  # the first position of this rank's tokens (context parallelism)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        if self.pos is not None:
            s = tokens.shape[1]
            w = self.pos.weight
            pos = (w.to_local() if hasattr(w, "to_local") else w)[self.seq_offset:self.seq_offset + s]
            if self.seq_shard is not None:  # the token embedding came out sharded along the sequence
                r, n = self.seq_shard
                pos = pos.chunk(n, dim=0)[r]
            x = x + pos
        x = cuda_dropout(x, self.dropout, self.training)
        return x


class Head(nn.Module):
    def __init__(self, m: ModelSpec, norm_impl: str = "fused", chunks: int = 0, chunk_size: int = 0):
        super().__init__()
        self.norm = _norm(m, norm_impl)
        self.out = nn.Linear(m.hidden, m.vocab, bias=m.head_bias)
        self.chunks, self.chunk_size = chunks, chunk_size
        self.softcap = 30.0 if m.final_logit_softcap else 0.0  # Gemma 2's final_logit_softcapping (its config's)

    def forward(self, x: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        return self.project(self.norm(x))

    def project(self, h: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        if self.chunks:
            # a chunked loss's model output (torchtune TransformerDecoder with num_output_chunks): the LM head
            # applied to each sequence chunk, a list of logits
            return [self._chunk(c) for c in h.tensor_split(self.chunks, dim=1)]
        if self.chunk_size:
            # lit-gpt's GPT.forward with lm_head_chunk_size: the head per fixed-size piece of the sequence
            return [self._chunk(c) for c in h.split(self.chunk_size, dim=1)]
        if not self.softcap:
            return self.out(h)
        # Gemma2ForCausalLM.forward: each step reassigns `logits`, so each input is freed once the next exists
        x = self.out(h)
        x = x / self.softcap
        x = torch.tanh(x)
        return x * self.softcap

    def _chunk(self, x: torch.Tensor) -> torch.Tensor:
        """The head on one sequence chunk, as aten::linear runs it outside a dispatch mode: a non-contiguous chunk
        (micro-batch > 1) with a bias goes through matmul and an in-place bias add (aten/native/Linear.cpp). Under
        the tracker's TorchDispatchMode `isTensorSubclassLike` holds and linear adds out of place, a logits-sized
        copy that a real run never makes."""
        bias = getattr(self.out, "bias", None)  # a QuantLinear (--quantize-head) has none
        if bias is None or x.is_contiguous():
            return self.out(x)
        return torch.matmul(x, self.out.weight.t()).add_(bias)


class Checkpointed(nn.Module):
    """Full recompute of one block: non-reentrant torch.utils.checkpoint around it."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return checkpoint(self.block, x, rope, use_reentrant=False)


def _op_sac_context() -> Any:
    """torchtitan's op-level SAC policy (torchtitan/distributed/activation_checkpoint.py, `selective_ac_option =
    "op"`): save the outputs of the listed ops, except every second `aten.mm` of the region; recompute the rest.
    The list has the CUDA SDPA kernels; the CPU flash kernel stands in for them here."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    ops = torch.ops
    save = {ops.aten.mm.default, ops.aten._scaled_dot_product_efficient_attention.default,
            ops.aten._scaled_dot_product_flash_attention.default,
            ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            ops._c10d_functional.reduce_scatter_tensor.default, ops.aten.max.default}
    meta: dict[str, int] = {}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        key = ("recompute" if ctx.is_recompute else "forward") + "_mm_count"
        if func == ops.aten.mm.default:
            meta[key] = meta.get(key, 0) + 1
        keep = func in save and not (func == ops.aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class OpCheckpointed(Checkpointed):
    """torchtitan's op-level selective activation checkpointing of one block (non-reentrant checkpoint with a
    selective policy; a fresh mm counter per forward and per recompute)."""

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return checkpoint(self.block, x, rope, use_reentrant=False, context_fn=_op_sac_context)


class GPT(nn.Module):
    """embed -> blocks -> head. Any part may be None on a pipeline stage that does not hold it."""

    def __init__(self, m: ModelSpec, kernel: str = "flash", dropout: float = 0.0, recompute: str = "none",
                 recompute_layers: int | None = None, norm_impl: str = "fused", qkv_impl: str = "separate",
                 gqa_impl: str = "native", loss_chunks: int = 0, loss_chunk_size: int = 0,
                 unit_starts: tuple[int, ...] = (0,), recompute_every: int | None = None):
        super().__init__()
        self.embed: nn.Module | None = Embed(m, dropout)
        blocks = []
        for i in range(m.layers):
            # --recompute-layers K: the first K layers of each pipeline stage (each model chunk when interleaved;
            # `unit_starts` are their first layers), Megatron's --recompute-method block; --recompute-every K:
            # the K-th, 2K-th, ... of each (torchtitan's count over a rank's blocks; whole multiples of K a chunk)
            j = i - max(s for s in unit_starts if s <= i)
            ck = (j + 1) % recompute_every == 0 if recompute_every else recompute_layers is None or j < recompute_layers
            blk = Block(m, kernel, dropout, selective=recompute == "selective" and ck, norm_impl=norm_impl,
                        qkv_impl=qkv_impl, gqa_impl=gqa_impl,
                        dense=m.moe is not None and i < m.moe.first_dense_layers)
            if recompute in ("full", "op") and ck:
                blk = Checkpointed(blk) if recompute == "full" else OpCheckpointed(blk)
            blocks.append(blk)
        self.layers = nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
        self.rotary = m.positions == "rotary"
        self.head_dim = m.mla.qk_rope_dim if m.mla is not None else m.head_dim  # the rotary width
        self.seq_offset = 0  # context parallelism: this rank's tokens start here in the sequence
        self.seq_shards = 1  # sequence parallelism: a later pipeline stage receives seq / tp tokens
        self.head: nn.Module | None = Head(m, norm_impl, loss_chunks, loss_chunk_size)
        if m.tied_embeddings:
            self.head.out.weight = self.embed.tok.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # token ids (first stage) or the received activations (the full sequence, or its SP shard)
        seq = x.shape[1] if self.embed is not None else x.shape[1] * self.seq_shards
        if self.embed is not None:
            x = self.embed(x)
        rope = None
        if self.rotary and len(self.layers):
            # once per forward and shared by every layer (HF LlamaModel's position_embeddings; torchtitan's
            # freqs_cis): the cost model's `rotary_cos_sin`, one pair per micro-batch per stage, in the dtype of
            # q and k (the autocast dtype under AMP).
            dt = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
            rope = rotary_cos_sin(seq, self.head_dim, x.device, dt, start=self.seq_offset)
        for blk in self.layers.values():
            x = blk(x, rope)
        if self.head is not None:
            # the norm's output replaces the last block's, which is freed unless saved (torchtune's and HF's
            # decoders reassign their hidden state the same way) before the LM head runs
            x = self.head.norm(x)
            x = self.head.project(x)
        return x


def inner_block(blk: nn.Module) -> Block:
    return blk.block if isinstance(blk, Checkpointed) else blk


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over fp32 logits (the `full` loss: the fp32 upcast is a real transient)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class CompiledChunkCE(torch.autograd.Function):
    """Stands for inductor's code for a compiled `F.cross_entropy(x.float(), y, reduction="sum")` on one chunk, as
    its generated forward and backward read (TORCH_LOGS=output_code; test_compiled_chunked_ce_saves_compute_dtype_
    logits checks the saved set): forward keeps the compute-dtype input, the row max and the log-sum-exp (one fp32
    each per row) and returns the loss; backward writes the compute-dtype gradient in one fused kernel. The fp32
    intermediates never exist in memory there; here they are computed with the tracker paused (`untracked`), a
    few rows at a time (`ROWS_ELEMS` logits per piece), so that a GPU run sees no more scratch than the kernels'."""

    ROWS_ELEMS = 1 << 18  # logits per untracked piece: 1 MiB of each fp32 intermediate

    @staticmethod
    def _pieces(x: torch.Tensor) -> range:
        rows = max(1, CompiledChunkCE.ROWS_ELEMS // max(1, x.shape[1]))
        return range(0, x.shape[0], max(1, piece_size(x, rows, x.shape[0])))

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor, untracked: Any) -> torch.Tensor:
        row_max = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
        lse = torch.empty_like(row_max)
        loss = torch.empty((), dtype=torch.float32, device=x.device)
        with untracked():
            total = torch.zeros((), dtype=torch.float32, device=x.device)
            pieces = CompiledChunkCE._pieces(x)
            for lo in pieces:
                hi = lo + pieces.step
                xf = x[lo:hi].float()
                row_max[lo:hi] = xf.amax(-1, keepdim=True)
                lse[lo:hi] = (xf - row_max[lo:hi]).exp().sum(-1, keepdim=True).log()
                total += (row_max[lo:hi] + lse[lo:hi]).sum() - xf.gather(1, y[lo:hi, None]).sum()
            loss.copy_(total)
        ctx.save_for_backward(x, y, row_max, lse)
        ctx.untracked = untracked
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        x, y, row_max, lse = ctx.saved_tensors
        grad = torch.empty_like(x)
        with ctx.untracked():
            pieces = CompiledChunkCE._pieces(x)
            for lo in pieces:
                hi = lo + pieces.step
                p = (x[lo:hi].float() - row_max[lo:hi] - lse[lo:hi]).exp()
                p.scatter_add_(1, y[lo:hi, None], -torch.ones_like(p[:, :1]))
                grad[lo:hi] = p * grad_loss
        return grad, None, None


def chunked_loss_fn(logits: list[torch.Tensor], targets: torch.Tensor, kind: str,
                    untracked: Any = contextlib.nullcontext) -> torch.Tensor:
    """A chunked cross-entropy over the model's list of logits, mean over the tokens.

    `chunked` / `chunked-eager`: torchtune's CEWithChunkedOutputLoss, the labels split like the logits
    (`tensor_split` along the sequence), each chunk upcast and cross-entropied (summed); compiled, the per-chunk
    function is what torch.compile builds (`CompiledChunkCE`), eager each chunk's fp32 log-softmax is saved.
    `lit-gpt`: lit_gpt/utils.py `chunked_cross_entropy` on a list: the labels split in the logits' chunk size,
    `cross_entropy(..., reduction="none")` per chunk on the logits as they are (no upcast), concatenated, summed."""
    if kind == "lit-gpt":
        pieces = targets.split(logits[0].shape[1], dim=1)
        losses = [F.cross_entropy(x.reshape(-1, x.shape[-1]), y.reshape(-1), reduction="none")
                  for x, y in zip(logits, pieces)]
        return torch.cat(losses).sum() / targets.numel()
    total: Any = 0.0
    for x, y in zip(logits, targets.tensor_split(len(logits), dim=1)):
        x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1)
        if kind == "chunked":
            total = total + CompiledChunkCE.apply(x2, y2, untracked)
        else:
            total = total + F.cross_entropy(x2.float(), y2, reduction="sum")
    return total / targets.numel()


class LoRALinear(nn.Module):
    """A frozen base linear plus a trainable low-rank update B(A(dropout(x))) (Hu et al. 2021); B starts at zero
    as in PEFT, whose LoRA layers each own their dropout."""

    def __init__(self, base: nn.Linear, rank: int, dropout: float = 0.0, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.base = base
        self.dropout = dropout
        dev = base.weight.device
        self.lora_a = nn.Linear(base.in_features, rank, bias=False, device=dev, dtype=dtype)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False, device=dev, dtype=dtype)
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(cuda_dropout(x, self.dropout, self.training)))


class FusedQKVLoRA(nn.Module):
    """lit-gpt's LoRAQKVLinear on a fused QKV matrix: one dropout and one A for the adapted projections together
    (A is r x n rows), a B per projection, and the B outputs scattered into a zero tensor of the fused width with
    `index_copy` (lit-gpt `zero_pad`), whose autograd keeps its source."""

    def __init__(self, base: nn.Linear, rank: int, dropout: float, groups: int, rep: int, head_dim: int,
                 adapted: tuple[str, ...], dtype: torch.dtype = torch.float32):
        super().__init__()
        self.base, self.rank, self.dropout = base, rank, dropout
        self.groups, self.rep, self.d = groups, rep, head_dim
        widths = {"q": rep * groups * head_dim, "k": groups * head_dim, "v": groups * head_dim}
        dev = base.weight.device
        self.lora_a = nn.Linear(base.in_features, rank * len(adapted), bias=False, device=dev, dtype=dtype)
        self.lora_b = nn.ModuleList(nn.Linear(rank, widths[p], bias=False, device=dev, dtype=dtype) for p in adapted)
        for b in self.lora_b:
            nn.init.zeros_(b.weight)
        self.adapted = adapted

    def _index(self, device: Any) -> torch.Tensor:
        # the fused layout is per KV group (q_per_kv query heads, k, v); its columns for the adapted projections
        cols = torch.arange(self.base.out_features, device=device).view(self.groups, self.rep + 2, self.d)
        r = self.rep
        parts = {"q": cols[:, :r].reshape(-1), "k": cols[:, r].reshape(-1), "v": cols[:, r + 1].reshape(-1)}
        return torch.cat([parts[p] for p in self.adapted])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        a = self.lora_a(cuda_dropout(x, self.dropout, self.training))
        lora = torch.cat([b(ai) for b, ai in zip(self.lora_b, a.split(self.rank, dim=-1), strict=True)], dim=-1)
        flat = lora.reshape(-1, lora.shape[-1])
        padded = flat.new_zeros(flat.shape[0], out.shape[-1]).index_copy(1, self._index(x.device), flat)
        return out + padded.view(out.shape)


def cast_params(model: nn.Module, dtype: torch.dtype) -> None:
    """`model.to(dtype)` for the floating-point parameters, by assigning `.data`: Module._apply swaps the tensors of a
    fake-tensor model (`--device meta`), which fails while the tracker holds weak references to them."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def apply_lora(model: nn.Module, targets: str, rank: int, base_dtype: torch.dtype, dropout: float = 0.0,
               adapter_dtype: torch.dtype = torch.float32) -> None:
    """Freeze every base weight, store it in `base_dtype` (the compute dtype, as PEFT loads a base model), and
    wrap the targeted projections with adapters in the recipe's parameter dtype: fp32 trained under autocast
    (memcalc's AMP recipe), or bf16 with no master copy (lit-gpt `bf16-true`, torchtune)."""
    for p in model.parameters():
        p.requires_grad_(False)
    cast_params(model, base_dtype)
    names = lora_projections(targets)
    for module in list(model.modules()):
        if isinstance(module, Attention) and module.fused:
            adapted = tuple(p for p in ("q", "k", "v") if p in names)
            if adapted:
                module.qkv = FusedQKVLoRA(module.qkv, rank, dropout, module.groups, module.rep, module.d, adapted,
                                          adapter_dtype)
        for name in names:
            child = getattr(module, name, None)
            if isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, rank, dropout, adapter_dtype))
