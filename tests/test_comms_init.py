"""How ``new_comm`` initialises the default group when the job has not (issue 31).

On CUDA it binds the group to the communicator's device (``device_id``): NCCL then makes the
default communicator at once and splits every later group from it; left lazy, each group is an
NCCL communicator of its own, and two such ran an overlapped step up to 9 % apart on H200s, bare
torch against bare torch (``scripts/gpu/step_by_init_mode.py``). No GPU here: ``init_process_group``
is replaced by a recorder of its arguments (the one part a CPU machine cannot run), which ends
``new_comm`` there.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist

from debug_server.recording import comms


class _Stop(Exception):
    pass


def _init_kwargs(monkeypatch: pytest.MonkeyPatch, backend: str, device: Any) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def init(**kwargs: Any) -> None:
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    with pytest.raises(_Stop):
        comms.new_comm(backend, device, "main_comm", timeout=30)
    return seen


def test_new_comm_binds_the_default_group_it_makes_to_the_cuda_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    kw = _init_kwargs(monkeypatch, "nccl", torch.device("cuda", 1))
    assert kw["device_id"] == torch.device("cuda", 1)
    assert kw["backend"] == "nccl" and kw["timeout"] == datetime.timedelta(seconds=30)


def test_a_cuda_device_without_index_binds_the_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _init_kwargs(monkeypatch, "nccl", "cuda")["device_id"] == torch.device("cuda", 3)


def test_a_cpu_communicator_makes_the_default_group_without_a_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert "device_id" not in _init_kwargs(monkeypatch, "gloo", "cpu")
