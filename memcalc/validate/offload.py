"""Activation offloading as memcalc models it (`--offload-activations`, docs/methodology.md "Activation
offloading"): the saved tensors of each transformer block go to host memory, double-buffered one block at a time.

- forward: a tensor saved inside block l is copied to the host and its device original kept until block l+1's
  forward ends (the copy is in flight meanwhile); so during block l the device holds blocks l-1 and l.
- backward: the first unpack of block l makes block l resident (the last block's originals never left) and
  reloads block l-1 ahead of its backward; each reloaded storage is released once every saved reference to it
  has been unpacked, as autograd releases what it saved.

Granularity and timing follow Transformer Engine's double-buffered CPU offload (Megatron `--cpu-offloading`);
torchtune's `OffloadActivations` works per tensor (a stash of recent tensors in forward, no look-ahead in
backward) and keeps at most about as much. Not offloaded: what is saved outside the blocks (embedding, final
norm, LM head, loss), parameters and views of them, autocast's weight casts, and the rotary tables every block
shares. Storages are copied once per block however many saved tensors view them (what memcalc counts).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole of t's storage. Views (`as_strided`, not `set_`): under FakeTensorMode
    (`--device meta`) a tensor made with `set_` keeps its storage alive after every reference is gone, so the
    offloaded originals were never freed there (a fake run measured 3.7x a real one's peak)."""
    st = t.untyped_storage()
    size = t.element_size()
    if st.nbytes() % size:
        return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
    return t.detach().as_strided((st.nbytes() // size,), (1,), 0).view(torch.uint8)


def _view_as(data: torch.Tensor, dtype: torch.dtype, offset: int, shape: tuple[int, ...],
             stride: tuple[int, ...]) -> torch.Tensor:
    """The saved tensor (dtype, offset, shape, stride) over `data`, a uint8 copy of its whole storage."""
    if data.numel() % dtype.itemsize:
        return torch.empty(0, dtype=dtype, device=data.device).set_(data.untyped_storage(), offset, shape, stride)
    return data.view(dtype).as_strided(shape, stride, offset)


class BlockOffload:
    def __init__(self, blocks: list[nn.Module], tracker: Any, device: torch.device) -> None:
        self.tracker = tracker
        self.device = device
        self.active = False
        self.cur: int | None = None  # block whose forward is running
        self.bwd_cur: int | None = None  # block whose backward is running
        self.skip: set[int] = set()  # storages every block shares (rotary tables)
        self.host: dict[int, dict[int, torch.Tensor]] = {}  # block -> storage key -> host bytes
        self.stash: dict[int, dict[int, torch.Tensor]] = {}  # block -> storage key -> device original (bytes)
        self.resident: dict[int, dict[int, torch.Tensor]] = {}  # block -> storage key -> device bytes
        self.refs: dict[int, dict[int, int]] = {}  # block -> storage key -> saved references not yet unpacked
        self.reloaded_uids: set[int] = set()  # tracker ids of the reload copies (measured as activations)
        # bytes and copies each way while the tracker counts (the measured steps): compared with memcalc's
        # host-copy terms
        self.copied = {"to_host": [0, 0], "from_host": [0, 0]}
        for i, blk in enumerate(blocks):
            blk.register_forward_pre_hook(self._pre_hook(i))
            blk.register_forward_hook(self._post_hook(i))

    def _count(self, way: str, nbytes: int) -> None:
        if self.tracker.counting:
            self.copied[way][0] += 1
            self.copied[way][1] += nbytes

    # -- forward
    def _pre_hook(self, i: int) -> Any:
        def hook(mod: nn.Module, args: Any) -> None:
            if not self.active:
                return
            self.cur = i
            for a in args[1:]:
                for x in a if isinstance(a, (tuple, list)) else (a,):
                    if isinstance(x, torch.Tensor):
                        self.skip.add(x.untyped_storage()._cdata)

        return hook

    def _post_hook(self, i: int) -> Any:
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            if not self.active:
                return
            self.stash.pop(i - 1, None)  # block i-1's copy to the host is complete
            self.cur = None

        return hook

    @contextlib.contextmanager
    def forward(self) -> Any:
        """Around the model's forward (not the loss): saved tensors of the blocks are offloaded."""
        self.host, self.stash, self.resident, self.refs = {}, {}, {}, {}
        self.skip, self.bwd_cur, self.active = set(), None, True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self.active, self.cur = False, None

    def _keep(self, t: torch.Tensor) -> bool:
        if self.cur is None or isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return True
        st = t.untyped_storage()
        if st.nbytes() == 0 or st._cdata in self.skip:
            return True
        uid = self.tracker.uid_of(t)
        return uid is not None and uid in self.tracker.copy_uids

    def _pack(self, t: torch.Tensor) -> Any:
        if self._keep(t):
            return t
        i = self.cur
        st = t.untyped_storage()
        key = st._cdata
        refs = self.refs.setdefault(i, {})
        if key not in refs:
            whole = _storage_bytes(t)
            with self.tracker.paused():
                if whole.device.type == "cuda":
                    host = torch.empty(whole.numel(), dtype=torch.uint8, pin_memory=True)
                    host.copy_(whole, non_blocking=True)
                else:
                    host = whole.clone()
            self.host.setdefault(i, {})[key] = host
            self._count("to_host", whole.numel())
            self.stash.setdefault(i, {})[key] = whole
            refs[key] = 0
        refs[key] += 1
        return (i, key, t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride()))

    # -- backward
    def _reload(self, i: int) -> None:
        host = self.host.pop(i, {})
        out: dict[int, torch.Tensor] = {}
        for key, h in host.items():
            d = h.to(self.device, non_blocking=True) if self.device.type == "cuda" else h.clone()
            self._count("from_host", h.numel())
            uid = self.tracker.uid_of(d)
            if uid is not None:
                self.reloaded_uids.add(uid)
            out[key] = d
        self.resident[i] = out

    def _enter(self, i: int) -> None:
        self.bwd_cur = i
        self.resident.pop(i + 1, None)
        if i in self.stash:  # the last block: its originals never left
            self.resident[i] = self.stash.pop(i)
            self.host.pop(i, None)
        elif i not in self.resident:
            self._reload(i)
        if i - 1 in self.host:
            self._reload(i - 1)  # ahead of its backward

    def _unpack(self, h: Any) -> torch.Tensor:
        if isinstance(h, torch.Tensor):
            return h
        i, key, dtype, offset, shape, stride = h
        if i != self.bwd_cur:
            self._enter(i)
        data = self.resident[i][key]
        t = _view_as(data, dtype, offset, shape, stride)
        self.refs[i][key] -= 1
        if self.refs[i][key] == 0:
            del self.resident[i][key]
        return t
