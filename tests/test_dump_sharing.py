"""The recorder's pickles share equal values between entries, and the analyzer reads them alike."""

from __future__ import annotations

import json
from typing import Any

import pytest
from mpjob import assert_ok, run_job

from debug_server.analysis.digest import digest_dump
from debug_server.dumpio import load_dump

pytestmark = pytest.mark.job

# Two float32 sizes in turn (gradient buckets), then a float64 op of the first size.
SCRIPT = r'''
import datetime, os
import torch
from debug_server.recording.comms import new_comm
from debug_server.recording.hooks import FlightRecorderHook

comm = new_comm("gloo", torch.device("cpu"), "main_comm", timeout=datetime.timedelta(seconds=30))
hook = FlightRecorderHook(max_entries=100).register_with_comm(comm)
a, b = torch.ones(8), torch.ones(4)
for _ in range(3):
    comm.all_reduce(a)
    comm.all_reduce(b)
comm.all_reduce(torch.ones(8, dtype=torch.float64))
hook.dump_file(comm.get_rank())
torch.distributed.barrier()
torch.distributed.destroy_process_group()
'''


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    work = tmp_path_factory.mktemp("sharing")
    prefix = work / "per_rank" / "rank_"
    results = run_job(SCRIPT, 2, work, timeout=90,
                      extra_env={"TORCHCOMM_FR_DUMP_TEMP_FILE": str(prefix)})
    assert_ok(results)
    return {r: load_dump(f"{prefix}{r}") for r in range(2)}


def test_entries_with_equal_sizes_and_dtypes_share_one_object_in_the_pickle(
    dumps: dict[int, dict[str, Any]],
) -> None:
    e = dumps[0]["entries"]
    assert len(e) == 7
    # Entries 0, 2, 4 reduce the 8-element float32 tensor; 1, 3, 5 the 4-element one.
    assert e[0]["input_sizes"] is e[2]["input_sizes"] is e[4]["input_sizes"] is e[6]["input_sizes"]
    assert e[1]["output_sizes"] is e[3]["output_sizes"] is e[5]["output_sizes"]
    assert e[0]["input_dtypes"] is e[1]["input_dtypes"] is e[5]["output_dtypes"]
    assert e[0]["process_group"] is e[6]["process_group"]


def test_each_entry_keeps_its_own_sizes_and_dtypes(dumps: dict[int, dict[str, Any]]) -> None:
    got = [
        (e["input_sizes"], e["output_sizes"], e["input_dtypes"], e["output_dtypes"])
        for e in dumps[1]["entries"]
    ]
    f8, f4 = ([[8]], [[8]], ["Float"], ["Float"]), ([[4]], [[4]], ["Float"], ["Float"])
    assert got == [f8, f4, f8, f4, f8, f4, ([[8]], [[8]], ["Double"], ["Double"])]
    assert dumps[1]["entries"][6]["process_group"] == ("main_comm", "gloo")


def test_digest_of_shared_entries_equals_digest_of_unshared_copies(
    dumps: dict[int, dict[str, Any]],
) -> None:
    # A JSON round trip gives every entry its own lists (and frames), as PyTorch's dumps have.
    copy = json.loads(json.dumps(dumps[0]))
    assert copy["entries"][0]["input_sizes"] is not copy["entries"][2]["input_sizes"]
    shared, unshared = digest_dump(0, dumps[0]), digest_dump(0, copy)
    assert shared == unshared
    assert [s[2:] for s in shared.sigs] == [
        (((8,),), ((8,),), ("Float",), ("Float",)),
        (((4,),), ((4,),), ("Float",), ("Float",)),
        (((8,),), ((8,),), ("Double",), ("Double",)),
    ]
    assert [(seq, sig) for seq, sig, _, _ in shared.colls[0][2]] == [
        (0, 0), (1, 1), (2, 0), (3, 1), (4, 0), (5, 1), (6, 2)
    ]

