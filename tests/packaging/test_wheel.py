"""The wheel maps the top-level folders into `gpudra` and ships nothing else."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUBPACKAGES = ("api", "cli", "common", "driver", "webhook")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(REPO)],
        check=True,
        timeout=300,
    )
    (whl,) = out.glob("gpudra-*.whl")
    return zipfile.ZipFile(whl)


def test_every_module_is_shipped_under_gpudra(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for sub in SUBPACKAGES:
        for src in (REPO / sub).rglob("*.py"):
            if "__pycache__" in src.parts:
                continue
            rel = src.relative_to(REPO).as_posix()
            assert f"gpudra/{rel}" in names, f"{rel} missing from the wheel"
    assert not any(n.startswith(("tests/", "e2e/", "gpudra/tests", "gpudra/e2e")) for n in names)
    assert not any("__pycache__" in n for n in names)


def test_console_entry_point(wheel: zipfile.ZipFile) -> None:
    (ep,) = [n for n in wheel.namelist() if n.endswith("entry_points.txt")]
    text = wheel.read(ep).decode()
    assert "gpudra = gpudra.cli:main" in text
    assert "kubectl-gpudra = gpudra.cli:main" in text


def test_dependencies_have_lower_bounds(wheel: zipfile.ZipFile) -> None:
    (meta,) = [n for n in wheel.namelist() if n.endswith("METADATA")]
    reqs = [
        ln.split(":", 1)[1].strip()
        for ln in wheel.read(meta).decode().splitlines()
        if ln.startswith("Requires-Dist:") and "extra ==" not in ln
    ]
    names = {r.split(">=")[0] for r in reqs}
    assert {
        "grpcio",
        "kubernetes-asyncio",
        "nvidia-ml-py",
        "cryptography",
        "pydantic",
        "anyio",
    } <= names
    assert all(">=" in r for r in reqs), reqs
