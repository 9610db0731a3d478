"""Shared fixtures: fake ranks (real worker apps on port 0), a real TCPStore, the reference demo.

The reference demo (``examples/hang_demo.py`` under torchrun) runs once per test
run: ``demo_live`` gives its frontend while it hangs, ``demo_done`` its dump dir and output after
it ended. Tests of the live hang are ordered before the others that read the demo, and under
pytest-xdist (``scripts/run_tests.sh`` runs ``-n ... --dist loadgroup``) every test that reads
it runs on one worker, so a parallel run still starts it once (``tests/xdist_groups.py``).
``browser`` is one headless Debian Chromium for the session. ``agent_fleet``: worker apps behind
agent apps, over the providers of the module's ``fleet_providers``.

Every test that starts a process is in the ``job`` tier (``tests/tiers.py``: the mark, or one of
the demo's and the browser's fixtures); ``ProcessGuard`` fails any other test that starts one.
Helpers are imported from helper modules (``fakes``, ``mpjob``, ``httpget``...), never from here
or from another test module.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fakes import MAIN_STACK, closed_port_url, make_job  # noqa: F401 - the two: see below
from fakes import agent_fleet as serve_agent_fleet
from mpjob import ReferenceDemo
from skip_policy import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401
from tiers import ProcessGuard, mark_jobs

from debug_server.rank.worker import StaticProvider, make_worker_app

# closed_port_url and make_job stay importable from here for test modules written before they
# moved to fakes (branches in flight); new code imports them from fakes.

FakeRank = Callable[..., Awaitable[str]]


@pytest.fixture
def fake_rank(aiohttp_server: Any) -> FakeRank:
    """``await fake_rank(dump, stacks=..., health=..., dump_path=...)`` -> base URL of a worker."""

    async def make(dump: Mapping[str, Any], *, stacks: str = MAIN_STACK,
                   health: Mapping[str, Any] | None = None, dump_path: str | None = None,
                   provider: Any = None) -> str:
        provider = provider or StaticProvider(dump, stacks=stacks, health=health,
                                              dump_path=dump_path)
        server = await aiohttp_server(make_worker_app(provider))
        return str(server.make_url("")).rstrip("/")

    return make


@pytest.fixture
def fake_job(fake_rank: FakeRank) -> Callable[..., Awaitable[list[str]]]:
    """``await fake_job(dumps, stacks={rank: text})`` -> one worker URL per rank."""

    async def make(dumps: Mapping[int, Mapping[str, Any]],
                   stacks: Mapping[int, str] | None = None,
                   dump_paths: Sequence[str] | None = None) -> list[str]:
        urls = []
        for r in sorted(dumps):
            urls.append(await fake_rank(
                dumps[r], stacks=(stacks or {}).get(r, MAIN_STACK),
                dump_path=dump_paths[r] if dump_paths else None))
        return urls

    return make


@pytest.fixture
async def agent_fleet(fleet_providers: Sequence[Any]) -> AsyncIterator[dict[str, Any]]:
    """Worker apps over the module's ``fleet_providers`` (rank = index) behind one agent app per
    4 ranks, with a collector through the agents and one asking every rank (``fakes.agent_fleet``
    says what it holds)."""
    async with serve_agent_fleet(fleet_providers) as fleet:
        yield fleet


@pytest.fixture
def tcp_store() -> Any:
    """A real TCPStore master on 127.0.0.1, port 0 (``.port`` says which)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    yield store
    del store



# ---------------------------------------------------------------------------------------------
# The reference demo, once per run


@pytest.fixture(scope="session")
def reference_demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReferenceDemo]:
    """The reference demo, started at its first use and ended (whole tree, by pid) at the end."""
    demo = ReferenceDemo(tmp_path_factory.mktemp("reference_demo"))
    try:
        yield demo
    finally:
        demo.close()


@pytest.fixture
def demo_live(reference_demo: ReferenceDemo) -> str:
    """The demo's frontend URL while rank 1 is missing from all_reduce #4 (checked per test)."""
    return reference_demo.wait_hung()


@pytest.fixture
def demo_done(reference_demo: ReferenceDemo) -> tuple[Path, str]:
    """``(dump_dir, output)`` of the demo once it has exited 0."""
    return reference_demo.dump_dir, reference_demo.wait_done()


DEMO_GROUP = "reference_demo"


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(ProcessGuard(), "process_guard")


def _module_scoped(item: pytest.Item) -> bool:
    """Whether ``item`` uses a fixture set up once per module (a real job its tests share)."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d and d[-1].scope in ("module", "class", "package") for d in defs)


def _own_timeout(item: pytest.Item) -> float:
    """The test's own ``timeout`` mark (its own or its module's), 0 without one."""
    mark = item.get_closest_marker("timeout")
    return float(mark.args[0]) if mark is not None and mark.args else 0.0


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The demo's readers first (live ones before the rest) and in one group; tests that share
    a module-scoped job in one group per module. Under xdist a group runs on one worker, so a
    parallel run starts the demo, and each shared job, once (``tests/xdist_groups.py``)."""
    def uses(item: pytest.Item, name: str) -> bool:
        return name in getattr(item, "fixturenames", ())

    mark_jobs(items)  # before `-m` deselects (tests/tiers.py)
    live = [i for i in items if uses(i, "demo_live")]
    done = [i for i in items if uses(i, "reference_demo") and not uses(i, "demo_live")]
    # A test that sets its own timeout runs a real job: modules with such tests start first
    # (longest bound first; a module's tests stay together, in order), so a parallel run does
    # not end waiting on a long test that was handed out last.
    rest = [i for i in items if not uses(i, "reference_demo")]
    bound: dict[str, float] = {}
    for i in rest:
        module = i.nodeid.split("::", 1)[0]
        bound[module] = max(bound.get(module, 0.0), _own_timeout(i))
    rest.sort(key=lambda i: bound[i.nodeid.split("::", 1)[0]], reverse=True)
    items[:] = live + done + rest
    groups = {i.nodeid: DEMO_GROUP for i in live + done}
    groups.update((i.nodeid, i.nodeid.split("::", 1)[0]) for i in rest if _module_scoped(i))
    if hasattr(config, "workerinput"):
        from xdist_groups import publish

        publish(config, groups)


def _groups_folder(config: pytest.Config) -> Path:
    folder = getattr(config, "_test_groups_folder", None)
    if folder is None:
        folder = Path(tempfile.mkdtemp(prefix="debug_server_test_groups_"))
        config._test_groups_folder = folder  # type: ignore[attr-defined]
    return folder


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist controller: each worker writes its collection's groups into one temp folder."""
    from xdist_groups import hand_to_worker

    hand_to_worker(node, _groups_folder(node.config))


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` schedules by our groups (xdist's own reading of them is broken on
    this pytest, see ``tests/xdist_groups.py``); every other mode is xdist's."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist_groups import GroupScheduling

    return GroupScheduling(config, log, _groups_folder(config))


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = getattr(config, "_test_groups_folder", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# A real browser

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """Debian's headless Chromium through selenium (never a browser download).

    selenium is a test dependency: without it this errors. Without Chromium the test fails in
    CI (``scripts/_venv.sh`` installs it there, so its absence is a broken install step) and
    skips elsewhere, saying how to install it.
    """
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    driver_bin = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    if not (os.path.exists(CHROMIUM) and os.path.exists(driver_bin)):
        why = (f"{CHROMIUM} or {driver_bin} is missing (scripts/_venv.sh: apt-get install "
               "chromium chromium-driver)")
        if os.environ.get("CI"):
            pytest.fail(f"CI: {why}", pytrace=False)
        pytest.skip(why)
    profile = tempfile.mkdtemp(prefix="debug_server_chromium_")
    opts = Options()
    opts.binary_location = CHROMIUM
    # No outside network here (and none needed): keep Chromium from trying to phone home.
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                 "--window-size=1400,1100", f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    service = Service(executable_path=driver_bin)
    driver = webdriver.Chrome(service=service, options=opts)
    try:
        driver.set_page_load_timeout(30)
        yield driver
    finally:
        driver.quit()
        if service.process is not None and service.process.poll() is None:
            service.process.kill()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def screenshot(browser: Any, tmp_path: Path) -> Callable[[str], Path]:
    """``screenshot(name)``: the browser's whole page as a PNG, kept in
    ``$DEBUG_SERVER_SCREENSHOTS`` (default the test's tmp_path); returns its path."""
    def shoot(name: str) -> Path:
        out = Path(os.environ.get("DEBUG_SERVER_SCREENSHOTS") or tmp_path)
        out.mkdir(parents=True, exist_ok=True)
        # Tall enough for the whole page (selenium's Chrome driver shoots the viewport only).
        height = browser.execute_script("return document.documentElement.scrollHeight")
        browser.set_window_size(1400, min(max(int(height) + 120, 800), 4000))
        path = out / name
        assert browser.save_screenshot(str(path)), path
        return path

    return shoot


@pytest.fixture
def fresh_members(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's member-list cache (``protocol.members``), empty for the test and as it was
    after it: a frontend that holds a list sends ``pgknown``, so tests that count requests or
    learn lists must not see each other's."""
    from debug_server.protocol import members

    for name, empty in (("_text_of", {}), ("_digest_of", {}), ("_weight", {}), ("_chars", 0),
                        ("_by_len", {})):
        monkeypatch.setattr(members, name, empty)
