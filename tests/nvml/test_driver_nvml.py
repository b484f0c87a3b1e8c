"""The driver root's NVML, loaded by its full path before pynvml asks the dynamic
linker for `libnvidia-ml.so.1`: the chart's agent sees the host's driver under /host,
where its own linker does not look.

A library built here stands in for NVML: its soname is NVML's, and it exports one
function. Each load happens in a child process, so this one's linker never holds it.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from gpudra.driver.driverroot import NVML_LIBRARY, DriverRoot
from gpudra.driver.nvml import preload_nvml
from gpudra.driver.nvml.standin import install_driver_root

from e2e.debian_driver import debian_layout
from e2e.shared_libraries import ANSWER, PROBE, shared_library

DRIVER_ROOT = Path("/run/nvidia/driver")
LIBRARY_DIR = "usr/lib/x86_64-linux-gnu"
# The child: the production preload (when asked), then pynvml's own way of loading
# NVML, by soname, and a call into what it got.
CHILD = f"""
import ctypes, sys
from pathlib import Path
from gpudra.driver.driverroot import DriverRoot
from gpudra.driver.nvml import preload_nvml
if sys.argv[1] == "preload":
    loaded = preload_nvml(DriverRoot(Path(sys.argv[2]), Path(sys.argv[3])))
    print(loaded.path if loaded is not None else "nothing preloaded")
try:
    print(ctypes.CDLL("libnvidia-ml.so.1").{PROBE}())
except (OSError, AttributeError) as err:
    print("not loaded:", err)
"""


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A host's / as a container sees it, with the driver root's NVML in it."""
    folder = tmp_path / "host" / str(DRIVER_ROOT).lstrip("/") / LIBRARY_DIR
    shared_library(folder / NVML_LIBRARY, NVML_LIBRARY)
    return tmp_path / "host"


def child(*args: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout.splitlines()


def test_the_preloaded_library_answers_pynvmls_load_by_soname(host: Path) -> None:
    library = host / str(DRIVER_ROOT).lstrip("/") / LIBRARY_DIR / NVML_LIBRARY
    assert child("preload", str(DRIVER_ROOT), str(host)) == [str(library), str(ANSWER)]


def test_a_debian_packaged_nvml_is_preloaded_through_its_alternatives_link(
    tmp_path: Path,
) -> None:
    """Debian's `libnvidia-ml.so.1` is an absolute link through /etc/alternatives to
    `nvidia/current/`: followed in the driver root, not in this process's /, it is
    found and loaded, and pynvml's load by soname gets it."""
    host = tmp_path / "host"
    install_driver_root(host, "535.261.03")
    library = debian_layout(host)[NVML_LIBRARY]
    library.unlink()
    shared_library(library, NVML_LIBRARY)
    assert child("preload", "/", str(host)) == [str(library), str(ANSWER)]


def test_without_the_preload_the_soname_is_not_found_there(host: Path) -> None:
    assert child("plain")[-1].startswith("not loaded:")


def test_a_root_without_nvml_preloads_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A driver on the linker's own path (or none): pynvml looks as it always did."""
    with caplog.at_level(logging.INFO, logger="gpudra.driver.nvml"):
        assert preload_nvml(DriverRoot(DRIVER_ROOT, tmp_path)) is None
    assert "no NVML library under the driver root" in caplog.text


def test_a_library_that_does_not_load_is_logged_and_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "usr/lib64"
    folder.mkdir(parents=True)
    (folder / NVML_LIBRARY).write_text("not a library\n")
    with caplog.at_level(logging.WARNING, logger="gpudra.driver.nvml"):
        assert preload_nvml(DriverRoot(Path("/"), tmp_path)) is None
    assert "does not load" in caplog.text


def test_the_agent_loads_the_driver_roots_nvml_before_discovery(
    host: Path, tmp_path: Path, short_tmp: Path
) -> None:
    """`gpudra node --nvml real` with the chart's flags logs the library it loaded
    from the driver root (then stops here: no API server to reach)."""
    proc = subprocess.run(
        [sys.executable, "-m", "gpudra.cli", "node",
         "--node-name", "n1", "--nvml", "real", "--driver-root", str(DRIVER_ROOT),
         "--host-root", str(host), "--state-dir", str(tmp_path / "state"),
         "--kubelet-root", str(short_tmp), "--kubeconfig", str(tmp_path / "none")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode != 0  # no API server
    loaded = [
        json.loads(line)
        for line in proc.stderr.splitlines()
        if line.startswith("{") and "NVML library loaded" in line
    ]
    library = host / str(DRIVER_ROOT).lstrip("/") / LIBRARY_DIR / NVML_LIBRARY
    assert len(loaded) == 1, proc.stderr
    assert loaded[0]["path"] == str(library)
    assert loaded[0]["driver_root"] == str(DRIVER_ROOT)
