"""Creates the development virtual environment.

The dev venv does not install gpudra itself: it links the package folders into a
small source tree (`.venv/src/gpudra/<sub> -> <repo>/<sub>`), the same shape the
wheel has, so edits are live and mypy sees real files (editable installs with
remapped folders rely on import hooks mypy cannot follow).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":  # run as a file by system python3: `e2e` imports from the root
    sys.path.insert(0, str(ROOT))
from e2e.progress import step  # noqa: E402 - standard library only, usable before the venv

SUBPACKAGES = ("api", "cli", "common", "driver", "webhook")


def main() -> int:
    env_dir = ROOT / ".venv"
    python = env_dir / "bin" / "python"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    with step(
        "installing the development environment in .venv",
        "gpudra's dependencies and the dev tools from PyPI (again when pyproject.toml changes)",
        "about a minute",
    ):
        if not python.exists():
            venv.EnvBuilder(with_pip=True, clear=False).create(env_dir)
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *reqs],
            check=True,
        )
    src = env_dir / "src" / "gpudra"
    src.mkdir(parents=True, exist_ok=True)
    for sub in SUBPACKAGES:
        link = src / sub
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(ROOT / sub, target_is_directory=True)
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(purelib, "gpudra-dev.pth").write_text(f"{src.parent}\n")
    # The commands a wheel installs (`gpudra`, and `kubectl-gpudra`, which kubectl finds
    # on PATH as the plugin behind `kubectl gpudra`), each running the CLI.
    for name, entry in project["scripts"].items():
        if entry != "gpudra.cli:main":
            raise SystemExit(f"pyproject.toml: [project.scripts] {name}: expected gpudra.cli:main")
        launcher = env_dir / "bin" / name
        launcher.write_text(f'#!/bin/sh\nexec "{python}" -m gpudra.cli "$@"\n')
        launcher.chmod(0o755)
    print(f"venv ready: {env_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main())
