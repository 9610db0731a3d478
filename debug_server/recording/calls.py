"""How a communicator calls c10d: the C++ ``ProcessGroup`` method itself, with cached options.

``torch.distributed.all_reduce`` and its siblings are Python wrappers around one C++ call
(``group.allreduce([tensor], opts)``): a decorator, a torch-function check, tensor checks, a
group lookup, the group-rank translation of ``src``/``dst``, a fresh options object per call, a
coalescing check, then the call and, for ``async_op=False``, ``work.wait()`` when the backend
returned a work. Measured on one pinned core (torch 2.13), the wrapper costs 1.5-2.5 us per op;
c10d's Flight Recorder records inside the C++ call, so it sees the same op either way.

``DirectCalls`` makes that C++ call directly with options built once per (op, root, async) and
cached: the communicator's ranks are its group's ranks (checked once), so no translation is
needed per op, and the wrapper's "not in group" case cannot arise (a communicator exists only
on its members: ``split`` refuses others). It returns ``(fn, args, kwargs)``; the communicator's op path (``comms``) makes
the call, so that the stack c10d records for the op has only op path frames above the
user's call site (``frames.OP_PATH_FILES``), which the recorders drop. The caller then waits when ``async_op`` is False
and a work came back, exactly as torch's wrapper does.

Where the wrapper does more than the call, the public function is used instead (the fallback,
always correct): complex and float8 tensors (viewed as real / uint8 by the wrapper), tensor
subclasses with ``__torch_function__``, a group inside ``_coalescing_manager``, a P2P op with
this rank as its peer (``send``/``recv`` reject it), ops with tensor lists (``all_gather``,
``reduce_scatter``: the wrapper checks and converts each tensor) and ``barrier`` (it picks a
device and always waits), a reduce op that is not a plain ``ReduceOp`` member (premul_sum:
options are then built per call), and any torch whose process group lacks a method used here.

Versions: the ``asyncOp`` option (torch >= 2.7) is set when it exists; without it the C++ call
is asynchronous and the sync path waits, as those torches' wrappers do. ``all_gather_single``
and ``all_to_all_single`` are the newer names of ``_allgather_base`` and ``alltoall_base``;
the newer is used where the group has it (torch 2.13's wrappers call those).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

# (fn, positional args, keyword args): one call of c10d, made by the communicator's op path.
Call = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]

_NO_KW: dict[str, Any] = {}
_RED_OP_TYPE = type(dist.ReduceOp.SUM)
_HAS_ASYNC_OPT = hasattr(_c10d.AllreduceOptions(), "asyncOp")
# Dtypes the wrappers pass through unchanged (complex is viewed as real, float8 as uint8 for
# broadcast on some GPUs): only these take the direct call.
_PLAIN_DTYPES = frozenset({
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool,
})
_has_torch_function = torch._C._has_torch_function_unary


def _opts(cls: Any, async_op: bool, **fields: Any) -> Any:
    opts = cls()
    for k, v in fields.items():
        setattr(opts, k, v)
    if _HAS_ASYNC_OPT:
        opts.asyncOp = async_op
    return opts


def _coalesce_state() -> dict[Any, Any]:
    # The one dict c10d keeps for _coalescing_manager (a property of its _World singleton).
    state = getattr(dist.distributed_c10d._world, "pg_coalesce_state", None)
    return state if isinstance(state, dict) else {}


class DirectCalls:
    """The calls of one communicator's process group (see the module doc)."""

    __slots__ = ("_pg", "_ranks", "_rank", "_direct", "_coalescing", "_cache", "_allreduce",
                 "_broadcast", "_reduce", "_gather_single", "_a2a_single", "_send", "_recv")

    def __init__(self, pg: Any, ranks: list[int], rank: int) -> None:
        self._pg = pg
        self._ranks = ranks  # global ranks, index = rank in the communicator (= in the group)
        self._rank = rank
        self._coalescing = _coalesce_state()
        self._cache: dict[Any, Any] = {}
        self._allreduce = getattr(pg, "allreduce", None)
        self._broadcast = getattr(pg, "broadcast", None)
        self._reduce = getattr(pg, "reduce", None)
        self._gather_single = getattr(pg, "all_gather_single", None) or getattr(pg, "_allgather_base", None)
        self._a2a_single = getattr(pg, "all_to_all_single", None) or getattr(pg, "alltoall_base", None)
        self._send = getattr(pg, "send", None)
        self._recv = getattr(pg, "recv", None)
        try:
            same = list(dist.get_process_group_ranks(pg)) == list(ranks)
        except Exception:  # a torch without it, or a group c10d does not know
            same = False
        self._direct = same and None not in (
            self._allreduce, self._broadcast, self._reduce, self._gather_single, self._a2a_single,
            self._send, self._recv)

    @property
    def direct(self) -> bool:
        """False when every op takes the public function (see the module doc)."""
        return self._direct

    def _check_rank(self, what: str, rank: Any) -> int:
        # Before anything is counted or issued: a bad rank must not use up a sequence number.
        try:
            r = operator.index(rank)
        except TypeError:
            r = -1
        if not 0 <= r < len(self._ranks):
            raise ValueError(f"{what} {rank!r} is not a rank of this communicator (size {len(self._ranks)})")
        return r

    def _plain(self, tensor: Any) -> bool:
        return (self._direct and tensor.dtype in _PLAIN_DTYPES and not _has_torch_function(tensor)
                and self._pg not in self._coalescing)

    def _cached(self, key: tuple[Any, ...], cls: Any, async_op: bool, **fields: Any) -> Any:
        """Options for ``key``, built on the first call (the hot ops look the cache up inline)."""
        opts = self._cache.get(key)
        if opts is None:
            opts = self._cache[key] = _opts(cls, async_op, **fields)
        return opts

    def all_reduce(self, tensor: torch.Tensor, op: Any, async_op: bool) -> Call:
        if self._plain(tensor):
            opts = self._cache.get((op, async_op))
            if opts is None:
                opts = _opts(_c10d.AllreduceOptions, async_op, reduceOp=op)
                # Only ReduceOp's members are keys by value; a ReduceOp object (premul_sum) is
                # made per call, so caching it would only grow the cache.
                if type(op) is _RED_OP_TYPE:
                    self._cache[(op, async_op)] = opts
            return self._allreduce, ([tensor], opts), _NO_KW
        return dist.all_reduce, (tensor,), {"op": op, "group": self._pg, "async_op": async_op}

    def broadcast(self, tensor: torch.Tensor, root: int, async_op: bool) -> Call:
        root = self._check_rank("root", root)
        if self._plain(tensor):
            opts = self._cache.get(("bc", root, async_op)) or self._cached(
                ("bc", root, async_op), _c10d.BroadcastOptions, async_op, rootRank=root, rootTensor=0)
            return self._broadcast, ([tensor], opts), _NO_KW
        return dist.broadcast, (tensor,), {"src": self._ranks[root], "group": self._pg, "async_op": async_op}

    def reduce(self, tensor: torch.Tensor, root: int, op: Any, async_op: bool) -> Call:
        root = self._check_rank("root", root)
        if self._plain(tensor) and type(op) is _RED_OP_TYPE:
            opts = self._cached(("rd", root, op, async_op), _c10d.ReduceOptions, async_op,
                                reduceOp=op, rootRank=root, rootTensor=0)
            return self._reduce, ([tensor], opts), _NO_KW
        return dist.reduce, (tensor,), {"dst": self._ranks[root], "op": op, "group": self._pg,
                                        "async_op": async_op}

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, async_op: bool) -> Call:
        if self._plain(input) and self._plain(output):
            opts = self._cached(("ag", async_op), _c10d.AllgatherOptions, async_op)
            return self._gather_single, (output, input, opts), _NO_KW
        return dist.all_gather_into_tensor, (output, input), {"group": self._pg, "async_op": async_op}

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None,
                          input_split_sizes: list[int] | None, async_op: bool) -> Call:
        if self._plain(input) and self._plain(output) and output.dtype == input.dtype:
            opts = self._cached(("a2a", async_op), _c10d.AllToAllOptions, async_op)
            return self._a2a_single, (output, input, output_split_sizes or [], input_split_sizes or [],
                                      opts), _NO_KW
        return dist.all_to_all_single, (output, input, output_split_sizes, input_split_sizes), {
            "group": self._pg, "async_op": async_op}

    def send(self, tensor: torch.Tensor, dst: int, async_op: bool) -> Call:
        """Always returns a work when direct (c10d's send has no sync form): the caller waits."""
        dst = self._check_rank("dst", dst)
        if dst != self._rank and self._plain(tensor):
            return self._send, ([tensor], dst, 0), _NO_KW
        fn = dist.isend if async_op else dist.send
        return fn, (tensor,), {"dst": self._ranks[dst], "group": self._pg}

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool) -> Call:
        src = self._check_rank("src", src)
        if src != self._rank and self._plain(tensor):
            return self._recv, ([tensor], src, 0), _NO_KW
        fn = dist.irecv if async_op else dist.recv
        return fn, (tensor,), {"src": self._ranks[src], "group": self._pg}

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, async_op: bool) -> Call:
        return dist.all_gather, (tensor_list, tensor), {"group": self._pg, "async_op": async_op}

    def reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor], op: Any,
                       async_op: bool) -> Call:
        return dist.reduce_scatter, (output, input_list), {"op": op, "group": self._pg, "async_op": async_op}

    def barrier(self, async_op: bool) -> Call:
        return dist.barrier, (), {"group": self._pg, "async_op": async_op}
