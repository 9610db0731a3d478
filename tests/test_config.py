"""The settings record (``config.Settings``): one declaration per variable, parsed once, and the
page ``docs/settings.md`` generated from it."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from debug_server.config import ConfigError, Settings, settings_markdown, take_secrets

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "debug_server"


def test_settings_page_equals_the_one_generated_from_the_declarations() -> None:
    page = (REPO / "docs" / "settings.md").read_text()
    assert page == settings_markdown(), (
        "docs/settings.md is stale: python -m debug_server.config --markdown > docs/settings.md")


@pytest.mark.job
def test_markdown_command_prints_the_settings_page() -> None:
    out = subprocess.run([sys.executable, "-m", "debug_server.config", "--markdown"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out == settings_markdown()
    assert "| `DEBUG_SERVER_RECORDER` | auto, c10d, python | auto |" in out


def test_every_variable_of_ours_is_named_in_at_most_two_modules() -> None:
    # config/settings.py declares them; rank/server.py's start_debug_server docstring names two for users.
    named = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
                   if "DEBUG_SERVER_" in p.read_text())
    assert named == ["config/settings.py", "rank/server.py"], named


def test_every_variable_read_in_the_package_is_declared() -> None:
    declared = {n for f in dataclasses.fields(Settings) for n in f.metadata["env"]}
    spelled = {m for p in PKG.rglob("*.py")
               for m in re.findall(r"\bDEBUG_SERVER_[A-Z_]+\b", p.read_text())}
    assert spelled <= declared, sorted(spelled - declared)


def test_from_env_parses_each_setting_once_and_defaults_the_rest() -> None:
    s = Settings.from_env({"DEBUG_SERVER_RECORDER": "C10D", "DEBUG_SERVER_PTRACER": "0",
                           "TORCH_NCCL_TRACE_BUFFER_SIZE": "7", "DEBUG_SERVER_AGENT": ""})
    assert (s.recorder, s.ptracer, s.fr_buffer_size, s.agent) == ("c10d", "0", 7, None)
    assert s.start_marks == "1" and s.signal_stacks is False and s.dump_prefix is None
    both = Settings.from_env({"TORCH_FR_BUFFER_SIZE": "3", "TORCH_NCCL_TRACE_BUFFER_SIZE": "7"})
    assert both.fr_buffer_size == 3  # the first name set wins, as in c10d


@pytest.mark.parametrize(("name", "value"), [("DEBUG_SERVER_START_MARKS", "sometimes"),
                                             ("DEBUG_SERVER_SIGNAL_STACKS", "maybe"),
                                             ("TORCH_FR_BUFFER_SIZE", "lots")])
def test_a_bad_value_names_the_variable_and_the_value(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"{name}='{value}'"):
        Settings.from_env({name: value})


def test_the_token_never_shows_in_the_record_and_is_taken_out_of_the_environment() -> None:
    env = {"DEBUG_SERVER_AUTH_TOKEN": "s3cret-token-of-twenty", "DEBUG_SERVER_HOST": "h1",
           "DEBUG_SERVER_FRONTEND_CONFIG_FD": "5"}
    s = take_secrets(env)
    assert s.auth_token == "s3cret-token-of-twenty" and "s3cret" not in repr(s)
    assert env == {"DEBUG_SERVER_HOST": "h1"}
