"""debug_server.tools.envinfo: what is collected, and one test per trap warning."""

from __future__ import annotations

from debug_server.tools.envinfo import collect_env, env_warnings

BASE = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2", "TORCH_FR_BUFFER_SIZE": "2000"}


def job(*envs: dict[str, str]) -> dict[int, dict[str, str]]:
    return {r: {**BASE, **e} for r, e in enumerate(envs)}


def test_collect_env_keeps_only_debug_relevant_variables():
    env = collect_env({
        "NCCL_DEBUG": "INFO", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "MASTER_ADDR": "h", "MASTER_PORT": "1",
        "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "TORCHCOMM_FR_DUMP_TEMP_FILE": "/d/rank_",
        "HOME": "/root", "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0", "RANK": "3",
    })
    assert list(env) == sorted(env)
    assert set(env) == {"NCCL_DEBUG", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_BUFFER_SIZE",
                        "TORCH_DISTRIBUTED_DEBUG", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE",
                        "LOCAL_WORLD_SIZE", "TORCHCOMM_FR_DUMP_TEMP_FILE"}


def test_collect_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth7")
    assert collect_env()["NCCL_SOCKET_IFNAME"] == "eth7"


def test_clean_environment_has_no_warnings():
    per_rank = job({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": "/logs/nccl.%h.%p.log"},
                   {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": "/logs/nccl.%h.%p.log"})
    assert env_warnings(per_rank, multi_host=True) == []


def test_fr_buffer_size_zero_warns_recorder_disabled():
    [w] = env_warnings(job({"TORCH_FR_BUFFER_SIZE": "0"}, {"TORCH_FR_BUFFER_SIZE": "0"}), False)
    assert w.startswith("TORCH_FR_BUFFER_SIZE=0: the c10d Flight Recorder is disabled")
    assert w.endswith("(ranks 0-1)")


def test_legacy_trace_buffer_size_zero_warns_when_new_name_unset():
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
    per_rank = {0: {**env}, 1: {**env}}
    [w] = env_warnings(per_rank, False)
    assert w.startswith("TORCH_NCCL_TRACE_BUFFER_SIZE=0: the c10d Flight Recorder is disabled")


def test_new_name_wins_over_legacy_and_disagreement_is_reported():
    per_rank = job({"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"},
                   {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"})
    [w] = env_warnings(per_rank, False)
    assert "disagree (TORCH_FR_BUFFER_SIZE wins)" in w
    assert "disabled" not in w


def test_unset_buffer_size_on_torchcomms_path_warns():
    env = {"TORCH_DISTRIBUTED_USE_TORCHCOMMS": "1"}
    [w] = env_warnings({0: env, 1: env}, False)
    assert "TORCH_FR_BUFFER_SIZE is unset" in w and "defaults the Flight Recorder to 0" in w


def test_unset_buffer_size_on_c10d_path_is_fine():
    # c10d's own backends default to 2000 entries in torch 2.13.
    assert env_warnings({0: {}, 1: {}}, False) == []


def test_non_integer_buffer_size_warns():
    [w] = env_warnings(job({"TORCH_FR_BUFFER_SIZE": "2k"}, {"TORCH_FR_BUFFER_SIZE": "2k"}), False)
    assert w.startswith("TORCH_FR_BUFFER_SIZE='2k' is not an integer")


def test_dump_on_timeout_off_warns():
    e = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    [w] = env_warnings(job(e, e), False)
    assert w.startswith("TORCH_NCCL_DUMP_ON_TIMEOUT=0: the watchdog writes no Flight Recorder dump")


def test_async_error_handling_1_warns_teardown():
    e = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    [w] = env_warnings(job(e, e), False)
    assert w.startswith("TORCH_NCCL_ASYNC_ERROR_HANDLING=1: on a collective timeout")
    assert "tears the process down" in w and "(ranks 0-1)" in w


def test_async_error_handling_legacy_alias_and_other_values():
    legacy = {"NCCL_ASYNC_ERROR_HANDLING": "1"}
    [w] = env_warnings(job(legacy, legacy), False)
    assert w.startswith("NCCL_ASYNC_ERROR_HANDLING=1")
    # The TORCH_ name takes precedence over the alias.
    both = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert env_warnings(job(both, both), False) == []


def test_nccl_debug_file_without_host_on_multi_host_job_warns():
    e = {"NCCL_DEBUG_FILE": "/shared/nccl.%p.log"}
    [w] = env_warnings(job(e, e), multi_host=True)
    assert "has no %h (host): hosts and ranks write the same file" in w
    assert env_warnings(job(e, e), multi_host=False) == []


def test_nccl_debug_file_without_pid_warns_for_ranks_on_one_host():
    e = {"NCCL_DEBUG_FILE": "/tmp/nccl.log"}
    [w] = env_warnings(job(e, e), multi_host=False)
    assert "has no %p (pid)" in w and "ranks on one host" in w
    [w] = env_warnings(job(e, e), multi_host=True)
    assert "has no %h (host) or %p (pid)" in w


def test_nccl_variable_differing_between_ranks_warns():
    per_rank = job({"NCCL_IB_HCA": "mlx5_0"}, {"NCCL_IB_HCA": "mlx5_1"}, {})
    [w] = env_warnings(per_rank, False)
    assert w.startswith("NCCL_IB_HCA differs between ranks ('mlx5_0' on rank 0; 'mlx5_1' on rank 1; "
                        "unset on rank 2)")


def test_identical_traps_are_one_line_with_rank_ranges():
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    per_rank = {r: dict(env) for r in range(6)}
    per_rank[4] = {}
    warnings = env_warnings(per_rank, False)
    trap = [w for w in warnings if w.startswith("TORCH_NCCL_ASYNC_ERROR_HANDLING=1")]
    assert len(trap) == 1 and trap[0].endswith("(ranks 0-3, 5)")
    # ...and the variable differing on rank 4 is its own warning.
    assert any(w.startswith("TORCH_NCCL_ASYNC_ERROR_HANDLING differs between ranks") for w in warnings)
