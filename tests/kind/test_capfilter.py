"""The private engine's runtime (e2e/kind/capfilter.py) as dockerd runs it: the script
the engine writes, exec'd with runc's arguments, with a stand-in runc that records what
it was given. Capabilities outside this machine's bounding set leave the spec; the rest
and every argument pass through."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.kind import capfilter
from e2e.kind.engine import runtime_script

ALL = list(capfilter.CAPABILITIES)


def _bounding() -> frozenset[str]:
    return capfilter.bounding_set(Path("/proc/self/status").read_text())


@pytest.fixture
def runtime(tmp_path: Path) -> Path:
    script = tmp_path / "runtime"
    script.write_text(runtime_script(sys.executable))
    script.chmod(0o755)
    return script


@pytest.fixture
def fake_runc(tmp_path: Path) -> Path:
    runc = tmp_path / "runc"
    runc.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path / "argv"}\n')
    runc.chmod(0o755)
    return runc


def _run(runtime: Path, runc: Path, *argv: str) -> list[str]:
    env = {**os.environ, "GPUDRA_RUNC": str(runc)}
    subprocess.run([str(runtime), *argv], env=env, check=True, timeout=30)
    return (runc.parent / "argv").read_text().splitlines()


def test_bounding_set_reads_the_mask() -> None:
    status = "Name:\tx\nCapBnd:\t0000000000000005\n"
    assert capfilter.bounding_set(status) == {"CAP_CHOWN", "CAP_DAC_READ_SEARCH"}
    with pytest.raises(ValueError, match="CapBnd"):
        capfilter.bounding_set("Name:\tx\n")


def test_create_keeps_only_capabilities_the_machine_has(
    tmp_path: Path, runtime: Path, fake_runc: Path
) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    sets = ("bounding", "effective", "permitted", "inheritable", "ambient")
    config = {"process": {"args": ["sh"], "capabilities": {k: [*ALL, "CAP_FUTURE"] for k in sets}}}
    (bundle / "config.json").write_text(json.dumps(config))
    argv = ["--root", "/x", "create", "--bundle", str(bundle), "--pid-file", "/p", "id1"]
    assert _run(runtime, fake_runc, *argv) == argv
    caps = json.loads((bundle / "config.json").read_text())["process"]["capabilities"]
    have = _bounding()
    for key in sets:
        assert caps[key] == [*(n for n in ALL if n in have), "CAP_FUTURE"]


def test_exec_process_file_is_filtered_too(tmp_path: Path, runtime: Path, fake_runc: Path) -> None:
    process = tmp_path / "process.json"
    process.write_text(json.dumps({"args": ["sh"], "capabilities": {"bounding": ALL}}))
    argv = ["exec", "--process", str(process), "--detach", "id1"]
    assert _run(runtime, fake_runc, *argv) == argv
    kept = json.loads(process.read_text())["capabilities"]["bounding"]
    assert kept == [n for n in ALL if n in _bounding()]


def test_a_machine_that_lacks_a_capability_drops_only_that_one() -> None:
    process = {"capabilities": {"effective": ["CAP_SYS_ADMIN", "CAP_SYS_RESOURCE"]}}
    allowed = frozenset(ALL) - {"CAP_SYS_RESOURCE"}
    assert capfilter.filter_process(process, allowed) is True
    assert process["capabilities"]["effective"] == ["CAP_SYS_ADMIN"]
    assert capfilter.filter_process(process, allowed) is False


def test_commands_without_a_spec_pass_through(runtime: Path, fake_runc: Path) -> None:
    argv = ["--root", "/x", "kill", "id1", "9"]
    assert _run(runtime, fake_runc, *argv) == argv
