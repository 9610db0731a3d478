"""The op methods of a communicator (TorchComms' API), a base of ``comms.Comm``.

Each op builds the C++ call c10d's own function would make (``calls.DirectCalls``) and, on our
recorder's path, its record (sizes as c10d's recorder writes them), then hands both to the op
path (``Comm._run``; on the c10d-backed path with no hook, ``Comm._issue``, which builds no
record). With ``async_op=False``, c10d orders the current stream after the collective (NCCL) or
waits on the host (gloo), exactly as a bare ``torch.distributed`` call does. ``async_op or
self._had_p2p``: see ``Comm._issue``. These frames are dropped from recorded stacks
(``frames.OP_PATH_FILES``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import ReduceOp

from debug_server.recording.calls import Call, DirectCalls
from debug_server.recording.records import OpRecord
from debug_server.recording.work import BackedWork, CommWork

__all__ = ["AnyWork", "CommOps"]

# What an op returns: a work object when async_op=True, else None.
AnyWork = CommWork | BackedWork | None


class CommOps:
    """The op methods; ``comms.Comm`` holds the state and the op path they use."""

    _calls: DirectCalls
    _backed: bool
    _had_p2p: bool
    _rank: int
    _pre_hooks: list[Callable[[OpRecord], None]]
    _post_hooks: list[Callable[[OpRecord], None]]
    _issue: Callable[..., BackedWork | None]
    _run: Callable[[OpRecord, Call], CommWork | None]
    _record1: Callable[..., OpRecord]
    _record: Callable[..., OpRecord]

    def all_reduce(self, tensor: torch.Tensor, op: Any = ReduceOp.SUM, async_op: bool = False) -> AnyWork:
        call = self._calls.all_reduce(tensor, op, async_op or self._had_p2p)
        if self._backed and not self._pre_hooks and not self._post_hooks:
            return self._issue("all_reduce", call, async_op)
        return self._run(self._record1("all_reduce", tensor, async_op), call)

    def broadcast(self, tensor: torch.Tensor, root: int, async_op: bool = False) -> AnyWork:
        call = self._calls.broadcast(tensor, root, async_op or self._had_p2p)
        if self._backed and not self._pre_hooks and not self._post_hooks:
            return self._issue("broadcast", call, async_op)
        return self._run(self._record1("broadcast", tensor, async_op), call)

    def reduce(self, tensor: torch.Tensor, root: int, op: Any = ReduceOp.SUM, async_op: bool = False) -> AnyWork:
        call = self._calls.reduce(tensor, root, op, async_op or self._had_p2p)
        if self._backed and not self._pre_hooks and not self._post_hooks:
            return self._issue("reduce", call, async_op)
        return self._run(self._record1("reduce", tensor, async_op), call)

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, async_op: bool = False) -> AnyWork:
        call = self._calls.all_gather(tensor_list, tensor, async_op or self._had_p2p)
        if self._backed and not self._pre_hooks and not self._post_hooks:
            return self._issue("all_gather", call, async_op)
        # Sizes as c10d's recorder writes them: the outputs as one flattened tensor, so analyzers
        # apply the same numel rule (output = input x group size) to both APIs.
        out = (torch.Size([sum(t.shape[0] if t.dim() else 1 for t in tensor_list), *tensor.shape[1:]]),)
        return self._run(self._record("all_gather", (tensor,), tensor_list[:1], async_op, output_shapes=out), call)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> AnyWork:
        call = self._calls.all_gather_single(output, input, async_op or self._had_p2p)
        if self._backed and not self._pre_hooks and not self._post_hooks:
            return self._issue("all_gather_single", call, async_op)
        return self._run(self._record("all_gather_single", (input,), (output,), async_op), call)

    def reduce_scatter(
        self, output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM, async_op: bool = False
    ) -> AnyWork:
        call = self._calls.reduce_scatter(output, input_list, op, async_op or self._had_p2p)
        if self._backed and not self._pre_hooks and not self._post_hooks:
            return self._issue("reduce_scatter", call, async_op)
        inp = (torch.Size([sum(t.shape[0] if t.dim() else 1 for t in input_list), *output.shape[1:]]),)
        return self._run(self._record("reduce_scatter", input_list[:1], (output,), async_op, input_shapes=inp), call)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        async_op: bool = False,
    ) -> AnyWork:
        call = self._calls.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                             async_op or self._had_p2p)
        if self._backed and not self._pre_hooks and not self._post_hooks:
            return self._issue("all_to_all_single", call, async_op)
        return self._run(self._record("all_to_all_single", (input,), (output,), async_op), call)

    def send(self, tensor: torch.Tensor, dst: int, async_op: bool = False) -> AnyWork:
        call = self._calls.send(tensor, dst, async_op)
        if self._backed and not self._pre_hooks and not self._post_hooks:
            return self._issue("send", call, async_op, p2p=True)
        return self._run(self._record1("send", tensor, async_op, peer=f"{self._rank}->{dst}"), call)

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> AnyWork:
        call = self._calls.recv(tensor, src, async_op)
        if self._backed and not self._pre_hooks and not self._post_hooks:
            return self._issue("recv", call, async_op, p2p=True)
        return self._run(self._record1("recv", tensor, async_op, peer=f"{self._rank}<-{src}"), call)

    def barrier(self, async_op: bool = False) -> AnyWork:
        call = self._calls.barrier(async_op or self._had_p2p)
        if self._backed and not self._pre_hooks and not self._post_hooks:
            return self._issue("barrier", call, async_op)
        return self._run(self._record("barrier", (), (), async_op), call)
