"""Container images for the real node without a registry.

No registry is reachable, so the pod sandbox (`pause`) and the test image are built
here from what the machine has: a static `pause` compiled with gcc, and busybox from
Debian's `busybox-static` package (`sh`, `ls`, `cat`, `env`, `sleep`, ... as applet
links). Each is written as an OCI image-layout archive with one uncompressed layer by
`e2e.image.oci` (the writer `make image` uses too), cached next to the other build
outputs and imported with `ctr images import`. The writer is deterministic (fixed
mtimes and owners), so a rebuild gives the same digests.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from e2e.cache import cache_root
from e2e.image import oci

HERE = Path(__file__).resolve().parent
PAUSE_SOURCE = HERE / "pause.c"
PAUSE_IMAGE = "gpudra.local/pause:1"
TEST_IMAGE = "gpudra.local/busybox:1"
BUSYBOX_PACKAGE = "busybox-static"


class ImageError(Exception):
    """A one-line, actionable reason an image could not be built."""


@dataclass(frozen=True)
class Entry:
    """One file, directory or symlink of a layer."""

    path: str
    data: bytes | None = None
    mode: int = 0o755
    link: str | None = None


def cache_dir() -> Path:
    """Same cache root as the Kubernetes and containerd builds."""
    return cache_root() / "node-images"


def _layer(entries: Iterable[Entry]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            info = tarfile.TarInfo(e.path)
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mode = e.mode
            if e.link is not None:
                info.type = tarfile.SYMTYPE
                info.linkname = e.link
                info.mode = 0o777
                tar.addfile(info)
            elif e.data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(e.data)
                tar.addfile(info, io.BytesIO(e.data))
    return buf.getvalue()


def _write(out: Path, name: str, entries: list[Entry], config: dict[str, object]) -> None:
    """One uncompressed layer and no creation time, so the same inputs give the same digest."""
    layer = oci.tar_layer(_layer(entries))
    oci.write_oci_archive(out, name, [layer], config, [{"created_by": "gpudra e2e/node/images.py"}])


def _skeleton() -> list[Entry]:
    """Mount points runc expects; it creates them too, but a read-only rootfs cannot."""
    return [Entry(d) for d in ("bin", "dev", "etc", "proc", "sys", "tmp", "var", "var/run")]


def build_pause(cache: Path) -> Path:
    src = PAUSE_SOURCE.read_bytes()
    out = cache / f"pause-{hashlib.sha256(src).hexdigest()[:12]}.tar"
    if out.exists():
        return out
    if shutil.which("gcc") is None:
        raise ImageError("gcc is missing, needed to build the pause image: apt-get install gcc")
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "pause"
        proc = subprocess.run(
            ["gcc", "-static", "-Os", "-s", "-o", str(binary), str(PAUSE_SOURCE)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            last = proc.stderr.strip().splitlines()[-1:] or ["no output"]
            raise ImageError(
                f"gcc -static could not build pause ({last[0]}): install libc6-dev "
                "(static libc) and try again"
            )
        entries = [*_skeleton(), Entry("pause", binary.read_bytes())]
    cache.mkdir(parents=True, exist_ok=True)
    _write(out, PAUSE_IMAGE, entries, {"Entrypoint": ["/pause"]})
    return out


def _busybox_deb(work: Path) -> Path:
    """The package file: from apt's cache when there, else `apt-get download`."""
    cached = sorted(Path("/var/cache/apt/archives").glob(f"{BUSYBOX_PACKAGE}_*.deb"))
    if cached:
        return cached[-1]
    if shutil.which("apt-get") is None:
        raise ImageError(
            f"no apt-get to fetch {BUSYBOX_PACKAGE} for the test image: put its .deb "
            "in /var/cache/apt/archives"
        )
    proc = subprocess.run(
        ["apt-get", "download", BUSYBOX_PACKAGE],
        cwd=work,
        capture_output=True,
        text=True,
        check=False,
    )
    debs = sorted(work.glob(f"{BUSYBOX_PACKAGE}_*.deb"))
    if proc.returncode != 0 or not debs:
        last = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        raise ImageError(
            f"apt-get download {BUSYBOX_PACKAGE} failed ({last[0]}): check that the "
            "Debian repositories are reachable (apt-get update)"
        )
    return debs[-1]


def build_test_image(cache: Path) -> Path:
    """Any cached build is reused: which busybox it holds does not matter to tests."""
    built = sorted(cache.glob("busybox-*.tar"))
    if built:
        return built[-1]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        deb = _busybox_deb(work)
        version = deb.name.split("_")[1].split("%3a")[-1].split(":")[-1]
        out = cache / f"busybox-{version}.tar"
        subprocess.run(["dpkg-deb", "-x", str(deb), str(work / "x")], check=True)
        busybox = work / "x" / "bin" / "busybox"
        applets = subprocess.run(
            [str(busybox), "--list"], capture_output=True, text=True, check=True
        ).stdout.split()
        entries = [
            *_skeleton(),
            Entry("bin/busybox", busybox.read_bytes()),
            *(Entry(f"bin/{a}", link="busybox") for a in applets if a != "busybox"),
            Entry("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n", 0o644),
            Entry("etc/group", b"root:x:0:\n", 0o644),
            Entry("root", mode=0o700),
        ]
    cache.mkdir(parents=True, exist_ok=True)
    _write(out, TEST_IMAGE, entries, {"Env": ["PATH=/bin"], "Cmd": ["sh"], "WorkingDir": "/"})
    return out


def build_all() -> dict[str, Path]:
    """Image name -> cached OCI archive, built when missing."""
    cache = cache_dir()
    return {PAUSE_IMAGE: build_pause(cache), TEST_IMAGE: build_test_image(cache)}
