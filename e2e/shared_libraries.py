"""Real shared libraries standing in for the driver's (NVML, CUDA), for the tests that
load or preload them: built with gcc, with the driver library's soname and one function
that answers a known number."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

PROBE = "gpudra_probe"
ANSWER = 4242


def shared_library(path: Path, soname: str) -> Path:
    """A library at `path` whose soname is `soname` and which exports `PROBE`; skips
    the test where gcc is missing."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("needs gcc to build a stand-in shared library")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "probe.c"
        source.write_text(f"int {PROBE}(void) {{ return {ANSWER}; }}\n")
        argv = [gcc, "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(path), str(source)]
        subprocess.run(argv, check=True)
    return path
