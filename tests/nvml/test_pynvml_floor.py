"""Production code reads only pynvml names that the oldest nvidia-ml-py it allows has.

A name newer than the floor in pyproject.toml breaks every node whose nvidia-ml-py is
pinned between the floor and that name's first release: at import for a constant read
into a table, at the first call for an entry point. The installed nvidia-ml-py is the
newest, so running the suite says nothing about the floor: each floor's names are
derived from its wheel into tests/nvml/pynvml-names/, and production's are read from
its source here.
"""

from __future__ import annotations

import ast
import json
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAMES = Path(__file__).parent / "pynvml-names"
# The subpackages of the `gpudra` wheel (pyproject.toml, tool.hatch).
PACKAGES = ("api", "cli", "common", "driver", "webhook")
# Where the library handed to production is the pynvml module itself (`load_nvml("real")`).
LIBRARY_PROTOCOL = ROOT / "driver" / "nvml" / "__init__.py"
PROFILES = ROOT / "driver" / "nvml" / "profiles"


def floor() -> str:
    """The version in the `nvidia-ml-py>=…` requirement of pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (version,) = (
        m.group(1)
        for req in project["dependencies"]
        if (m := re.fullmatch(r"nvidia-ml-py\s*>=\s*([0-9.]+)", req.strip()))
    )
    return version


def floor_names(version: str) -> frozenset[str]:
    lines = (NAMES / f"{version}.txt").read_text().splitlines()
    return frozenset(line for line in lines if line and not line.startswith("#"))


def _source_names(path: Path) -> Iterator[tuple[str, str]]:
    """(name, where) for each pynvml name the module reads: `pynvml.X`,
    `from pynvml import X`, `getattr(pynvml, "X")`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    where = path.relative_to(ROOT)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "pynvml":
                yield node.attr, f"{where}:{node.lineno}"
        elif isinstance(node, ast.ImportFrom) and node.module == "pynvml":
            yield from ((alias.name, f"{where}:{node.lineno}") for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id == "pynvml"
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            yield node.args[1].value, f"{where}:{node.lineno}"


def _library_entry_points() -> Iterator[tuple[str, str]]:
    """The methods of `NvmlLibrary`: production calls them on the pynvml module."""
    tree = ast.parse(LIBRARY_PROTOCOL.read_text())
    (protocol,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "NvmlLibrary")
    where = LIBRARY_PROTOCOL.relative_to(ROOT)
    for item in protocol.body:
        if isinstance(item, ast.FunctionDef):
            yield item.name, f"{where}:{item.lineno} (NvmlLibrary)"


def _profile_constants() -> Iterator[tuple[str, str]]:
    """pynvml constant names a built-in profile spells (the emulator looks them up)."""

    def strings(value: object) -> Iterator[str]:
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            for item in value.values():
                yield from strings(item)
        elif isinstance(value, list):
            for item in value:
                yield from strings(item)

    for path in sorted(PROFILES.glob("*.json")):
        for text in strings(json.loads(path.read_text())):
            if re.fullmatch(r"NVML_[A-Z0-9_]+", text):
                yield text, str(path.relative_to(ROOT))


def production_names() -> dict[str, set[str]]:
    """Every pynvml name production reads, with where it reads it."""
    found: dict[str, set[str]] = {}
    sources = (path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py")))
    for name, where in (
        *(pair for path in sources for pair in _source_names(path)),
        *_library_entry_points(),
        *_profile_constants(),
    ):
        found.setdefault(name, set()).add(where)
    return found


def test_the_floor_has_its_names_derived() -> None:
    version = floor()
    assert (NAMES / f"{version}.txt").is_file(), (
        f"pyproject.toml allows nvidia-ml-py {version}: derive its names into "
        f"tests/nvml/pynvml-names/{version}.txt as the file of an older floor says"
    )
    assert f"nvidia-ml-py {version}," in (NAMES / f"{version}.txt").read_text()


def test_production_reads_no_pynvml_name_the_floor_lacks() -> None:
    version = floor()
    used = production_names()
    # The scan sees each kind of read: a constant, an error class, an entry point.
    assert {"NVML_ERROR_GPU_IS_LOST", "NVMLError_GpuIsLost", "nvmlInit"} <= used.keys()
    missing = {name: sorted(used[name]) for name in sorted(used.keys() - floor_names(version))}
    assert not missing, f"pynvml names nvidia-ml-py {version} lacks: {missing}"
