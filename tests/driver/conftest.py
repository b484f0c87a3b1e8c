"""Shared by the driver tests: the anyio backend, a small real filesystem to fill, and a
count of the CDI edits converted."""

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from gpudra.driver import cdi as cdi_module
from gpudra.driver.cdi import ContainerEdits


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[ContainerEdits]:
    """Every ContainerEdits the CDI code checks and converts to a spec's JSON, in order:
    what is converted once for many specs shows as one entry."""
    converted: list[ContainerEdits] = []
    real = cdi_module._edits_json

    def counting(edits: ContainerEdits) -> dict[str, Any]:
        converted.append(edits)
        return real(edits)

    monkeypatch.setattr(cdi_module, "_edits_json", counting)
    return converted


def _fill(folder: Path) -> None:
    """Fill the filesystem of `folder` to the last byte."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (65536, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                continue
    finally:
        os.close(fd)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs, so a full disk is a real ENOSPC from the kernel."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0755", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.fixture
def fill_small_fs(small_fs: Path) -> Callable[[], None]:
    """Call to fill `small_fs` completely (a file named `filler`; unlink it to free)."""
    return lambda: _fill(small_fs)


@pytest.fixture
def fill_folder() -> Callable[[Path], None]:
    """Call with a folder to fill its file system from there (a file named `filler` in
    it), as a container that may write that folder could."""
    return _fill
