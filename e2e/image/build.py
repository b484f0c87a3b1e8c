"""Builds the gpudra image as an OCI archive without a container engine (`make image`).

The same layout as the Dockerfile: Debian (bookworm, minimal) with its python3 as the
base layer, and a virtual environment in /opt/gpudra holding the wheel and its
dependencies from PyPI as the second layer; default user 65532, entry point `gpudra`.
containerd loads the result: `ctr -n k8s.io images import <archive>`.

Why our own OCI writer (`e2e.image.oci`, shared with the real node's images): an image
layout is a few JSON files and gzip'd tars named by their sha256, so the stdlib writes
it; no daemon, no registry, no extra tools. Only debootstrap (Debian package) is needed,
for the base; the base layer is cached outside the repository and rebuilt only when its
inputs change.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as a file (`make image`): `e2e` imports from the root
    sys.path.insert(0, str(REPO))
from e2e.cache import cache_root  # noqa: E402
from e2e.image import oci  # noqa: E402
from e2e.progress import step  # noqa: E402

SUITE = "bookworm"
PYTHON = "3.11"  # bookworm's python3; wheels are chosen for it
# tini: PID 1 of the node agent's container, reaping the MPS daemons it starts.
BASE_PACKAGES = ("python3", "ca-certificates", "tini")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# Wheels bookworm's glibc (2.36) can load, newest first.
PLATFORMS = (
    "manylinux_2_36_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)
USER = "65532:65532"
ENV = (
    "PATH=/opt/gpudra/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "PYTHONUNBUFFERED=1",
    "PYTHONDONTWRITEBYTECODE=1",
)
ENTRYPOINT = ("tini", "--", "gpudra")
CMD = ("--help",)
CREATED = "1970-01-01T00:00:00Z"  # fixed, so the same inputs give the same image digest
BASE_COMMENT = f"debian {SUITE} minbase + python3"
APP_COMMENT = "gpudra wheel in /opt/gpudra"
# Left out of the base layer: runtime mounts, caches and documentation (as in -slim).
BASE_EXCLUDE = (
    "dev/",
    "proc/",
    "sys/",
    "run/",
    "tmp/",
    "var/cache/apt/",
    "var/lib/apt/lists/",
    "var/log/",
    "usr/share/doc/",
    "usr/share/man/",
    "usr/share/info/",
    "usr/share/locale/",
)


class BuildError(Exception):
    """A one-line reason the image could not be built, with the fix."""


def log(msg: str) -> None:
    print(f"image: {msg}", file=sys.stderr, flush=True)


# --- layers ---------------------------------------------------------------------------------


def _walk(root: Path, exclude: Sequence[str]) -> Iterator[Path]:
    """Every path under root in sorted order; excluded folders are kept but emptied."""
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root).as_posix()
        prefix = "" if rel == "." else rel + "/"
        if prefix and any(prefix.startswith(e) for e in exclude):
            dirnames.clear()
            continue
        dirnames.sort()
        entries = sorted([*dirnames, *filenames])
        for name in entries:
            yield Path(dirpath) / name


def write_layer(
    root: Path, out: Path, exclude: Sequence[str] = (), mtime: int | None = None
) -> oci.Layer:
    """A reproducible gzip'd layer of everything under `root` (owned by root; `mtime`
    fixes times)."""

    def normalize(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        if mtime is not None:
            info.mtime = mtime
        return info

    raw = out.with_suffix(".tar.tmp")
    with tarfile.open(raw, "w", format=tarfile.GNU_FORMAT) as tar:
        for path in _walk(root, exclude):
            arcname = path.relative_to(root).as_posix()
            info = tar.gettarinfo(str(path), arcname)
            if info.ischr() or info.isblk() or info.isfifo():
                continue
            info = normalize(info)
            if info.isreg():
                with path.open("rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    layer = oci.gzip_layer(raw, out)
    raw.unlink()
    return layer


def write_image(out: Path, name: str, base: oci.Layer, app: oci.Layer) -> str:
    """The archive `make image` writes, under the Dockerfile's runtime config; returns the
    manifest digest."""
    config = {
        "User": USER,
        "Env": list(ENV),
        "Entrypoint": list(ENTRYPOINT),
        "Cmd": list(CMD),
        "WorkingDir": "/",
    }
    history = [{"created": CREATED, "comment": c} for c in (BASE_COMMENT, APP_COMMENT)]
    return oci.write_oci_archive(out, name, [base, app], config, history, created=CREATED)


# --- the base and the application ---------------------------------------------------------


def bases_dir() -> Path:
    """Where base layers are cached, one folder per set of inputs."""
    return cache_root() / "image"


def debootstrap_installable() -> bool:
    """Whether the base layer can be built here: debootstrap is there, or root can install it."""
    if shutil.which("debootstrap") is not None:
        return True
    return os.geteuid() == 0 and shutil.which("apt-get") is not None


def ensure_debootstrap() -> None:
    """Installs debootstrap from Debian when it is missing, as the real node's build
    installs runc: `make test` on a fresh machine must not skip the chart for want of it."""
    if shutil.which("debootstrap") is not None:
        return
    script = REPO / "e2e" / "tools" / "apt-install.sh"
    why = "it builds the image's Debian base layer"
    if subprocess.run(["bash", str(script), why, "debootstrap"], check=False).returncode != 0:
        raise BuildError(
            "debootstrap is not installed and could not be: `apt-get install debootstrap` "
            "(or, with a Docker engine, `docker build -t gpudra .`)"
        )


def base_cached() -> bool:
    """Whether any base layer is cached, so a build needs no debootstrap."""
    return any(bases_dir().glob("base-*/layer.json"))


def base_layer(mirror: str) -> oci.Layer:
    """Debian minbase with python3, cached by its inputs; debootstrap runs only when missing."""
    key = hashlib.sha256(f"{SUITE} {mirror} {' '.join(BASE_PACKAGES)}".encode()).hexdigest()[:12]
    cache = bases_dir() / f"base-{SUITE}-{key}"
    meta = cache / "layer.json"
    if meta.exists():
        return _cached_layer(cache)
    if os.geteuid() != 0:
        raise BuildError("debootstrap needs root: run `make image` as root")
    ensure_debootstrap()
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"base-{SUITE}-", dir=cache.parent))
    try:
        rootfs = tmp / "rootfs"
        with step(
            f"building the image's Debian {SUITE} base layer",
            f"debootstrap from {mirror}, cached in {cache.parent} for later builds",
            "3-5 minutes, more with a slow mirror",
        ):
            proc = subprocess.run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    f"--include={','.join(BASE_PACKAGES)}",
                    SUITE,
                    str(rootfs),
                    mirror,
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode != 0:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
                raise BuildError(f"debootstrap failed: {' '.join(tail)}; check the mirror {mirror}")
            if not (rootfs / "usr" / "bin" / f"python{PYTHON}").exists():
                raise BuildError(
                    f"{SUITE} did not install python{PYTHON}; update PYTHON in this script"
                )
            layer = write_layer(rootfs, tmp / "layer.tar.gz", BASE_EXCLUDE)
        shutil.rmtree(rootfs)
        # The keys older checkouts read too (they share the cache): comment included.
        record = {"digest": layer.digest, "diff_id": layer.diff_id, "size": layer.size}
        (tmp / "layer.json").write_text(json.dumps({**record, "comment": BASE_COMMENT}))
        if cache.exists():
            shutil.rmtree(cache)
        tmp.rename(cache)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return _cached_layer(cache)


def _cached_layer(cache: Path) -> oci.Layer:
    """The base layer from its cache folder; layer.json keeps the digests so that a build
    does not hash hundreds of MiB again."""
    data = json.loads((cache / "layer.json").read_text())
    return oci.Layer(
        oci.MEDIA_LAYER_GZIP, data["digest"], data["diff_id"], data["size"], cache / "layer.tar.gz"
    )


def app_layer(work: Path) -> oci.Layer:
    """/opt/gpudra: a virtual environment for bookworm's python3 with the wheel installed."""
    wheels = work / "wheel"
    _pip("wheel", "--quiet", "--no-deps", "-w", str(wheels), str(REPO))
    (wheel,) = wheels.glob("gpudra-*.whl")
    root = work / "app"
    venv = root / "opt" / "gpudra"
    site = venv / "lib" / f"python{PYTHON}" / "site-packages"
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    _pip(
        "install",
        "--quiet",
        "--no-compile",
        "--disable-pip-version-check",
        "--target",
        str(site),
        "--only-binary=:all:",
        "--implementation",
        "cp",
        "--python-version",
        PYTHON,
        *platforms,
        str(wheel),
    )
    shutil.rmtree(site / "bin", ignore_errors=True)  # scripts with this machine's shebang
    bin_dir = venv / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(f"/usr/bin/python{PYTHON}")
    (bin_dir / "python").symlink_to("python3")
    (venv / "lib64").symlink_to("lib")
    (venv / "pyvenv.cfg").write_text(
        f"home = /usr/bin\ninclude-system-site-packages = false\nversion = {PYTHON}\n"
    )
    script = bin_dir / "gpudra"
    script.write_text(
        "#!/opt/gpudra/bin/python3\nimport sys\n\nfrom gpudra.cli import main\n\n"
        "if __name__ == '__main__':\n    sys.exit(main())\n"
    )
    script.chmod(0o755)
    if sys.version_info[:2] == tuple(int(x) for x in PYTHON.split(".")):
        # Bytecode in the image: the read-only root filesystem cannot cache it at run time.
        subprocess.run(
            [
                sys.executable,
                "-m",
                "compileall",
                "-q",
                "--invalidation-mode",
                "unchecked-hash",
                "-s",
                str(root),
                "-p",
                "/",
                str(venv),
            ],
            check=True,
        )
    else:
        log(f"no bytecode: this Python is not {PYTHON}, so modules compile at start")
    return write_layer(root, work / "app.tar.gz", mtime=0)


def _pip(*args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise BuildError(
            f"pip {args[0]} failed: {' | '.join(detail)}; check that PyPI is reachable"
        )


def project_version() -> str:
    return str(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"])


def main(argv: Sequence[str] | None = None) -> int:
    version = project_version()
    parser = argparse.ArgumentParser(description="Build the gpudra image as an OCI archive.")
    parser.add_argument("--out", type=Path, default=REPO / "dist" / f"gpudra-{version}.oci.tar")
    parser.add_argument("--name", default=f"ghcr.io/gpudra/gpudra:{version}")
    parser.add_argument("--mirror", default=os.environ.get("GPUDRA_DEBIAN_MIRROR", DEFAULT_MIRROR))
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        base = base_layer(args.mirror)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with (
            tempfile.TemporaryDirectory(prefix="gpudra-image-") as tmp,
            step(
                "installing gpudra into the image",
                f"its wheel and the dependencies' wheels for Python {PYTHON} from PyPI",
                "about a minute",
            ),
        ):
            app = app_layer(Path(tmp))
            digest = write_image(args.out, args.name, base, app)
    except BuildError as e:
        print(f"image: {e}", file=sys.stderr)
        return 2
    mib = args.out.stat().st_size / (1 << 20)
    log(f"{args.name} ({digest}) -> {args.out} ({mib:.0f} MiB) in {time.monotonic() - start:.0f}s")
    log(f"load it into containerd: ctr -n k8s.io images import {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
