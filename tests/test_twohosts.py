"""The reference hang on two hosts: two network namespaces, the demo under torchrun on each.

Host ``nsh0`` (namespace ds19h0, 10.77.0.1) runs ranks 0-1 and the frontend, host ``nsh1``
(ds19h1, 10.77.0.2) runs ranks 2-3; rank 3 hangs. Both namespaces hang off a bridge in the root
namespace, which gets 10.77.0.254, so this test reaches the frontend from outside both hosts.
Each host has its own host name (``unshare --uts``), its own ``/etc/hosts`` (``ip netns exec``
mounts ``/etc/netns/<ns>/hosts``; nsh0's names itself 127.0.1.1, the Debian trap) and its own
disk under the one FR_DUMP_DIR path (``unshare --mount`` and a bind mount: a dump dir that is
not shared between hosts). All traffic stays inside the namespaces and the bridge made here;
every process is ended by process group and every namespace, link and file made here is removed
in the fixture's teardown.

Needs root and iproute2 (``ip netns``); elsewhere it skips and says why.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from httpget import request
from mpjob import DEMO, REPO, demo_hang_line, kill_all

pytestmark = [pytest.mark.job, pytest.mark.timeout(190)]

NAMESPACES = ("ds19h0", "ds19h1")
HOSTNAMES = ("nsh0", "nsh1")
ADDRS = ("10.77.0.1", "10.77.0.2")
IFNAMES = ("ve0", "ve1")  # inside the namespaces
BRIDGE, BRIDGE_PORTS, ROOT_ADDR = "ds19br", ("ds19b0", "ds19b1"), "10.77.0.254"
ETC_NETNS = Path("/etc/netns")
UNSHARE = ("unshare", "--uts", "--mount", "--propagation", "private")
# Each namespace has its own port space, so fixed ports cannot collide with anything outside.
FRONTEND_PORT, MASTER_PORT = 25999, 29500
FRONTEND = f"http://{ADDRS[0]}:{FRONTEND_PORT}"
TOKEN_HEADER = "X-Debug-Server-Token"
JOB_LIMIT_S = 140.0
"""Bound on the whole two-host job; the demo itself ends after about 35 s."""
DEMO_ENV = {
    # The hang lasts COMM_TIMEOUT: long enough for the fixture's pages to see it through both
    # agents on a loaded box (with 12 s a full suite's run once ended it before they did).
    "HANGING_RANK": "3", "COMM_TIMEOUT": "30", "HANG_SECONDS": "34", "FR_DUMP_INTERVAL": "1",
    "FR_STALL_TIMEOUT": "3",
}


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


def _kill_namespace_processes() -> None:
    # torchrun starts each worker in a session of its own, so killing torchrun's process group
    # would leave them behind; every process in our namespaces is ours, listed by pid.
    for ns in NAMESPACES:
        for pid in _ip("netns", "pids", ns).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


def _teardown_network() -> None:
    for ns in NAMESPACES:  # deleting a namespace deletes its veth end, and with it the peer
        _ip("netns", "del", ns)
        shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
    _ip("link", "del", BRIDGE)
    for port in BRIDGE_PORTS:
        _ip("link", "del", port)
    try:
        ETC_NETNS.rmdir()  # only if empty: someone else's namespaces may use it
    except OSError:
        pass


def _setup_network() -> str | None:
    """Build the two hosts; returns why it cannot be done here, or None."""
    if os.geteuid() != 0:
        return "not root: ip netns needs CAP_SYS_ADMIN and CAP_NET_ADMIN"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command on PATH"
    _teardown_network()  # leftovers of a run that was killed
    steps = [("netns", "add", NAMESPACES[0]), ("netns", "add", NAMESPACES[1]),
             ("link", "add", BRIDGE, "type", "bridge"),
             ("addr", "add", f"{ROOT_ADDR}/24", "dev", BRIDGE), ("link", "set", BRIDGE, "up")]
    for k, ns in enumerate(NAMESPACES):
        steps += [("link", "add", BRIDGE_PORTS[k], "type", "veth", "peer", "name", IFNAMES[k],
                   "netns", ns),
                  ("link", "set", BRIDGE_PORTS[k], "master", BRIDGE),
                  ("link", "set", BRIDGE_PORTS[k], "up"),
                  ("-n", ns, "addr", "add", f"{ADDRS[k]}/24", "dev", IFNAMES[k]),
                  ("-n", ns, "link", "set", IFNAMES[k], "up"), ("-n", ns, "link", "set", "lo", "up")]
    for step in steps:
        proc = _ip(*step)
        if proc.returncode != 0:
            return f"`ip {' '.join(step)}` failed: {proc.stderr.strip()}"
    for k, ns in enumerate(NAMESPACES):
        own = "127.0.1.1" if k == 0 else ADDRS[k]  # nsh0 resolves its own name to loopback
        try:
            (ETC_NETNS / ns).mkdir(parents=True, exist_ok=True)
            (ETC_NETNS / ns / "hosts").write_text(
                f"127.0.0.1 localhost\n{own} {HOSTNAMES[k]}\n{ADDRS[1 - k]} {HOSTNAMES[1 - k]}\n")
        except OSError as e:
            return f"cannot write {ETC_NETNS / ns / 'hosts'}: {e.strerror or e}"
    probe = subprocess.run(["ip", "netns", "exec", NAMESPACES[0], *UNSHARE, "sh", "-c",
                            f"echo {HOSTNAMES[0]} > /proc/sys/kernel/hostname && "
                            f"mount --bind /tmp /tmp && cat /proc/sys/kernel/hostname"],
                           capture_output=True, text=True, timeout=20)
    if probe.returncode != 0 or probe.stdout.strip() != HOSTNAMES[0]:
        return f"{' '.join(UNSHARE)} in a network namespace failed: {probe.stderr.strip()[:200]}"
    return None


def _agent_cmdlines(ns: str) -> list[str]:
    out = []
    for pid in _ip("netns", "pids", ns).stdout.split():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "debug_server.agent" in cmd:
            out.append(cmd)
    return out


@dataclass
class TwoHosts:
    out: list[Path]
    """Each host's torchrun output (stdout and stderr)."""
    dump_dir: Path
    """FR_DUMP_DIR on both hosts, each with its own disk mounted there."""
    disks: list[Path]
    """What each host wrote into its dump dir, seen from here."""
    token: str
    link: str
    fr: dict[str, Any]
    stacks: str
    no_token_status: int
    codes: list[int | None]
    agents: list[list[str]]
    """Each host's agent processes (their command lines) while the job hangs."""
    stacks_json: dict[str, Any]


def _host_cmd(k: int, disk: Path, dump_dir: Path) -> list[str]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={k}",
                "--nproc_per_node=2", f"--master_addr={ADDRS[0]}", f"--master_port={MASTER_PORT}",
                str(DEMO)]
    shell = (f"echo {HOSTNAMES[k]} > /proc/sys/kernel/hostname && "
             f"mount --bind {disk} {dump_dir} && exec \"$@\"")
    return ["ip", "netns", "exec", NAMESPACES[k], *UNSHARE, "sh", "-c", shell, "sh", *torchrun]


def _get(path: str, token: str | None, accept: str = "*/*") -> tuple[int, str]:
    headers = {"Accept": accept, **({TOKEN_HEADER: token} if token else {})}
    try:
        return request(f"{FRONTEND}{path}", headers=headers, timeout=60)  # a loaded box
    except OSError as e:
        # Not listening yet (rank 0 prints its link as it starts the frontend): status 0, so
        # a poll goes on and a single read fails its assertion with the reason.
        reason = getattr(e, "reason", e)
        if isinstance(reason, ConnectionRefusedError):
            return 0, f"refused: {reason}"
        raise


def _wait_for(path: Path, pattern: str, proc: subprocess.Popen[str],
              deadline: float) -> re.Match[str]:
    while time.monotonic() < deadline:
        m = re.search(pattern, path.read_text(errors="replace"))
        if m:
            return m
        if proc.poll() is not None:
            raise AssertionError(f"{pattern!r} not in {path.name}; the host's torchrun exited "
                                 f"{proc.returncode}:\n{path.read_text()[-4000:]}")
        time.sleep(0.3)
    raise AssertionError(f"{pattern!r} not in {path.name} in time:\n{path.read_text()[-4000:]}")


def _seq4_missing_3(fr: dict[str, Any]) -> bool:
    return any(c["seq"] == 4 and c["op"] == "all_reduce" and c["missing_ranks"] == [3]
               for c in fr.get("collectives", []))


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoHosts]:
    why = _setup_network()
    if why is not None:
        _teardown_network()
        pytest.skip(f"two-host test needs network namespaces: {why}")
    tmp = tmp_path_factory.mktemp("twohosts")
    procs: list[subprocess.Popen[str]] = []
    files = []
    try:
        out = [tmp / f"{h}.out" for h in HOSTNAMES]
        dump_dir, disks = tmp / "dumps", [tmp / f"disk_{h}" for h in HOSTNAMES]
        for d in (dump_dir, *disks):
            d.mkdir()
        for k in (0, 1):
            env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                       FR_DUMP_DIR=str(dump_dir), DEBUG_SERVER_PORT=str(FRONTEND_PORT),
                       GLOO_SOCKET_IFNAME=IFNAMES[k], **DEMO_ENV)
            for var in ("TORCHCOMM_FR_DUMP_TEMP_FILE", "DEBUG_SERVER_HOST", "MASTER_ADDR",
                        "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
                env.pop(var, None)
            files.append(out[k].open("w"))
            procs.append(subprocess.Popen(_host_cmd(k, disks[k], dump_dir), env=env, stdout=files[-1],
                                          stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
        deadline = time.monotonic() + JOB_LIMIT_S
        m = _wait_for(out[0], r"\[rank 0\] debug server: (http://\S+/\?token=(\S+))", procs[0],
                      deadline)
        link, token = m.group(1), m.group(2)
        _wait_for(out[1], r"\[rank 3\] phase 2: hanging", procs[1], deadline)
        # Poll until every rank answers and the hang shows; the worker of a rank that just
        # entered all_reduce #4 may not have recorded it yet.
        fr: dict[str, Any] = {}
        while time.monotonic() < deadline:
            status, body = _get("/fr_trace?format=json", token)
            fr = json.loads(body) if status == 200 else {"error": body}
            # The frontend may have looked for an agent just before it registered.
            if fr.get("ranks_with_data") == [0, 1, 2, 3] and _seq4_missing_3(fr) and all(
                    (r.get("note") or "").startswith("via agent") for r in fr["ranks"]):
                break
            time.sleep(0.5)
        _, stacks = _get("/stacks?format=text", token)
        _, stacks_body = _get("/stacks?format=json", token)
        agents = [_agent_cmdlines(ns) for ns in NAMESPACES]
        no_token_status, _ = _get("/fr_trace", None)
        codes: list[int | None] = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        yield TwoHosts(out, dump_dir, disks, token, link, fr, stacks, no_token_status, codes,
                       agents, json.loads(stacks_body))
    finally:
        _kill_namespace_processes()
        kill_all(procs)
        for f in files:
            f.close()
        _teardown_network()


def test_both_hosts_run_the_demo_to_its_end(two_hosts: TwoHosts) -> None:
    for k, code in enumerate(two_hosts.codes):
        assert code == 0, f"host {HOSTNAMES[k]}: exit {code}\n{two_hosts.out[k].read_text()[-6000:]}"


def test_rank_0_prints_a_link_with_its_reachable_address_and_the_token(two_hosts: TwoHosts) -> None:
    assert two_hosts.link == f"{FRONTEND}/?token={two_hosts.token}"


def test_every_rank_registers_its_hosts_reachable_address(two_hosts: TwoHosts) -> None:
    urls = {r["rank"]: r["url"] for r in two_hosts.fr["ranks"]}
    hosts = {rank: re.match(r"http://([\d.]+):\d+$", url or "") for rank, url in urls.items()}
    assert {rank: m.group(1) if m else urls[rank] for rank, m in hosts.items()} == {
        0: ADDRS[0], 1: ADDRS[0], 2: ADDRS[1], 3: ADDRS[1]}


def test_fr_trace_from_outside_names_rank_3_missing_from_all_reduce_4(two_hosts: TwoHosts) -> None:
    fr = two_hosts.fr
    assert fr.get("ranks_with_data") == [0, 1, 2, 3], fr.get("ranks", fr)
    assert [r["status"] for r in fr["ranks"]] == ["ok"] * 4, fr["ranks"]
    assert _seq4_missing_3(fr), fr.get("collectives")


def test_stacks_from_outside_show_rank_3_at_the_sleep_line(two_hosts: TwoHosts) -> None:
    sections = re.split(r"^=== Rank (\d+)[^\n]*===$", two_hosts.stacks, flags=re.M)
    by_rank = {int(sections[i]): sections[i + 1] for i in range(1, len(sections) - 1, 2)}
    assert sorted(by_rank) == [0, 1, 2, 3], two_hosts.stacks[:2000]
    assert f'{DEMO.name}", line {demo_hang_line()} in hang_phase' in by_rank[3]


def test_request_without_token_gets_401(two_hosts: TwoHosts) -> None:
    assert two_hosts.no_token_status == 401


def test_hang_report_names_rank_3(two_hosts: TwoHosts) -> None:
    reports = sorted(two_hosts.disks[0].glob("hang_report_*.json"))
    assert reports, f"no hang report in {two_hosts.disks[0]}"
    rep = json.loads(reports[0].read_text())
    assert [c["rank"] for c in rep["culprits"]] == [3], rep["culprits"]
    assert any(f["kind"] == "missing_ranks" and f["ranks"] == [3] and f["seq"] == 4
               for f in rep["findings"]), rep["findings"]


def test_every_rank_writes_its_pickle_on_its_own_host(two_hosts: TwoHosts) -> None:
    h0, h1 = (d / "per_rank" for d in two_hosts.disks)
    assert sorted(p.name for p in h0.glob("rank_*")) == ["rank_0", "rank_1"]
    assert sorted(p.name for p in h1.glob("rank_*")) == ["rank_2", "rank_3"]


def test_dump_file_section_says_which_pickles_are_on_the_other_host(two_hosts: TwoHosts) -> None:
    texts = sorted(two_hosts.disks[0].glob("torchcomms_fr_trace_*.txt"))
    text = texts[-1].read_text()
    per_rank = two_hosts.dump_dir / "per_rank"
    assert (f"Rank 3: OK - FR pickle written to {per_rank}/rank_3 on host nsh1, "
            f"not on this host (nsh0)") in text
    assert f"Rank 1: OK - FR pickle written to {per_rank}/rank_1\n" in text
    assert "Ranks {2, 3} wrote their pickles on other hosts" in text
    assert "--allow-incomplete-ranks" in text


def test_demo_summary_suggests_allow_incomplete_ranks_and_gives_a_verdict(two_hosts: TwoHosts) -> None:
    out = two_hosts.out[0].read_text()
    summary = out[out.index("=" * 78):]
    verdict = re.search(r"^Verdict \(every rank, from the hang report\): (.*)$", summary, re.M)
    assert verdict and verdict.group(1).startswith("Rank 3 never joined all_reduce #4"), summary
    assert "Verdict on the pickles here: " in summary
    assert "No pickle here for ranks 2, 3: they are on the other hosts" in summary
    assert re.search(rf"debug_server\.fr_trace {two_hosts.dump_dir}/per_rank -p rank_ .*"
                     r"--allow-incomplete-ranks$", summary, re.M), summary


def test_each_host_runs_exactly_one_agent_for_its_own_ranks(two_hosts: TwoHosts) -> None:
    assert [len(a) for a in two_hosts.agents] == [1, 1], two_hosts.agents
    assert "--host-id nsh0 --ranks 0-1 " in two_hosts.agents[0][0]
    assert "--host-id nsh1 --ranks 2-3 " in two_hosts.agents[1][0]


def test_fr_trace_and_stacks_go_through_each_hosts_agent(two_hosts: TwoHosts) -> None:
    expected = ["via agent nsh0"] * 2 + ["via agent nsh1"] * 2
    assert [r.get("note") for r in two_hosts.fr["ranks"]] == expected
    assert [(r.get("note") or "").rpartition("; ")[2] for r in two_hosts.stacks_json["ranks"]] \
        == expected


def test_verdict_through_agents_names_rank_3_on_the_other_host_with_its_stack(
        two_hosts: TwoHosts) -> None:
    assert two_hosts.fr["verdict"].startswith("Rank 3 never joined all_reduce #4"), \
        two_hosts.fr["verdict"]
    assert f"{DEMO.name}:{demo_hang_line()}" in two_hosts.fr["verdict"], \
        two_hosts.fr["verdict"]
    rank3 = two_hosts.stacks_json["ranks"][3]
    assert f'{DEMO.name}", line {demo_hang_line()} in hang_phase' in rank3["stacks"]
