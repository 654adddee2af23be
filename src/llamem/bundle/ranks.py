"""CpuMemoryTracker for one rank of a data-parallel run on CPU: what a GPU of the same run would hold.

A launch bundle's `train.py --cpu` runs every planned GPU as a CPU process (gloo) under this
tracker. Two things of a `fully_shard` (FSDP2) run are invisible to the plain tracker, which sees
the storages ATen ops create (torch 2.13):

- DTensor parameters, gradients and optimizer state are wrapper tensors whose own storage has the
  *global* size; the bytes a rank holds are those of its local shard (`_local_tensor`).
- FSDP2 frees the all-gathered parameters with `untyped_storage().resize_(0)` and allocates them
  again with `resize_(n)` (`free_storage` / `alloc_storage` in
  torch/distributed/fsdp/_fully_shard/_fsdp_param.py); resizing a storage is no ATen op, so no
  dispatch mode sees it.

A tensor-parallel run's loss on the vocabulary shards (`loss_parallel`) is invisible too, but for
its handlers' results: DTensor runs them inside the op's dispatch, where a dispatch mode is off.
Their local functions (`_log_softmax` and the fused `_nll_loss_and_log_softmax_backward` in
torch/distributed/tensor/parallel/loss.py) make the tokens x vocabulary / tp buffers a GPU holds.

`RankTracker` counts the local shards, follows storage resizes and enters itself again around
those two functions while it is active. It also keeps the highest live bytes between two
`take_high_water()` calls, however often a monitor resets the peak at its phase boundaries.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from llamem.runtime.tracker import CpuMemoryTracker
from llamem.trace.tracer import rounded

LOSS_PARALLEL_FUNCTIONS = ("_log_softmax", "_nll_loss_and_log_softmax_backward")
"""`loss_parallel`'s local functions whose ops a dispatch mode misses (run inside DTensor's handlers)."""


def plain_tensors(tensor: torch.Tensor):
    """The tensors that hold a tensor's bytes: itself, or a wrapper subclass's inner tensors."""
    if not is_traceable_wrapper_subclass(tensor):
        yield tensor
        return
    names, _context = tensor.__tensor_flatten__()
    for name in names:
        inner = getattr(tensor, name)
        if isinstance(inner, torch.Tensor):
            yield from plain_tensors(inner)


class RankTracker(CpuMemoryTracker):
    """A CpuMemoryTracker that counts DTensor shards, follows `UntypedStorage.resize_`, and keeps
    `run_peak_bytes` (the whole run) and a high-water mark per window (`take_high_water`)."""

    def __init__(self, *args, **kwargs) -> None:
        self._window_bytes = 0
        self.run_peak_bytes = 0
        self._depth = 0
        """How many times the tracker is entered: the patches go in at the first and out at the last exit."""
        self._restore: list = []
        super().__init__(*args, **kwargs)

    # Every update of the peak also raises the window's and the run's high-water marks.
    @property
    def peak_bytes(self) -> int:
        return self._peak_bytes

    @peak_bytes.setter
    def peak_bytes(self, value: int) -> None:
        self._peak_bytes = value
        self._window_bytes = max(self._window_bytes, value)
        self.run_peak_bytes = max(self.run_peak_bytes, value)

    def take_high_water(self) -> int:
        """The highest live bytes since the last call (or since the tracker was created)."""
        high = self._window_bytes
        self._window_bytes = self.current_bytes
        return high

    # Wrapper subclasses: count what they hold ---------------------------------------------
    def _new_storages(self, out) -> list:
        tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        return super()._new_storages([inner for t in tensors for inner in plain_tensors(t)])

    def label(self, tensor: torch.Tensor, category: str) -> None:
        for inner in plain_tensors(tensor):
            super().label(inner, category)

    # Storage resizes and loss_parallel's handlers -----------------------------------------
    def __enter__(self):
        self._depth += 1
        if self._depth == 1:
            self._patch_resize()
            self._patch_loss_parallel()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._depth -= 1
            if self._depth == 0:
                for restore in reversed(self._restore):
                    restore()
                self._restore.clear()

    def _patch_resize(self) -> None:
        original, tracker = torch.UntypedStorage.resize_, self

        def resize_(storage, size):
            result = original(storage, size)
            tracker._resized(storage, int(size))
            return result

        own = torch.UntypedStorage.__dict__.get("resize_")  # normally inherited from StorageBase
        torch.UntypedStorage.resize_ = resize_
        self._restore.append(lambda: delattr(torch.UntypedStorage, "resize_") if own is None
                             else setattr(torch.UntypedStorage, "resize_", own))

    def _patch_loss_parallel(self) -> None:
        try:
            from torch.distributed.tensor.parallel import loss as module
        except ImportError:  # a torch without DTensor's loss_parallel
            return
        for name in LOSS_PARALLEL_FUNCTIONS:
            original = getattr(module, name, None)
            if original is not None:
                setattr(module, name, self._visible(original))
                self._restore.append(lambda name=name, original=original: setattr(module, name, original))

    def _visible(self, function):
        """`function` with its ops counted: the tracker entered again where DTensor's dispatch turned it off."""
        tracker = self

        def counted(*args, **kwargs):
            if tracker in _get_current_dispatch_mode_stack():
                return function(*args, **kwargs)
            with tracker:
                return function(*args, **kwargs)

        return counted

    def _event(self, action: str, allocation) -> None:
        if allocation.size_bytes:  # a storage emptied by resize_(0) was freed then, not when it dies
            super()._event(action, allocation)

    def _resized(self, storage, nbytes: int) -> None:
        """A resize frees the old bytes and allocates the new ones, under the same record."""
        allocation = self.live.get(id(storage))
        if allocation is None:
            if nbytes:
                self._add(storage, self.category, "resize_")
            return
        size_bytes = rounded(nbytes) if nbytes else 0  # an emptied storage holds nothing
        self._event("free", allocation)
        self.current_bytes += size_bytes - allocation.size_bytes
        allocation.size_bytes, allocation.nbytes = size_bytes, nbytes
        self._event("alloc", allocation)
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
