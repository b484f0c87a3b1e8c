"""The image build files: the Dockerfile's shape, and the engine-free OCI archive that
`make image` writes (its layout must be what containerd imports)."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

from e2e.image import build, oci

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "Dockerfile").read_text()


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stages() -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instructions():
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


def test_dockerfile_is_multi_stage_with_a_non_root_runtime() -> None:
    build_stage, runtime = stages()
    assert build_stage[0][1].endswith("AS build")
    assert any(w == "COPY" and "--from=build" in r for w, r in runtime)
    (user,) = [r for w, r in runtime if w == "USER"]
    assert user.split(":")[0] not in ("0", "root")
    assert user == build.USER  # the same user as `make image`
    assert ("ENTRYPOINT", json.dumps(list(build.ENTRYPOINT))) in runtime
    # Nothing from the build stage's toolchain (pip, venv module) in the runtime.
    runtime_runs = " ".join(r for w, r in runtime if w == "RUN")
    assert "python3-venv" not in runtime_runs


def test_dockerfile_and_make_image_share_the_base() -> None:
    (suite,) = re.findall(r"^ARG DEBIAN_SUITE=(\S+)$", DOCKERFILE, re.M)
    assert suite == build.SUITE
    for _, rest in [i for i in instructions() if i[0] == "FROM"]:
        assert rest.startswith("debian:${DEBIAN_SUITE}-slim")
    env = " ".join(r for w, r in stages()[1] if w == "ENV")
    for var in build.ENV:
        assert var in env


def test_every_package_folder_reaches_the_build() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["force-include"])
    copied = {r.split()[0] for w, r in stages()[0] if w == "COPY" and "--from" not in r}
    assert folders <= copied
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    for folder in folders | {"pyproject.toml", "README.md"}:
        assert f"!{folder}/" in ignore or f"!{folder}" in ignore


def test_make_image_archive_is_a_valid_image_layout(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "opt" / "gpudra" / "bin").mkdir(parents=True)
    (root / "opt" / "gpudra" / "bin" / "gpudra").write_text("#!/bin/sh\n")
    (root / "opt" / "gpudra" / "bin" / "python3").symlink_to("/usr/bin/python3.11")
    (root / "tmp").mkdir()
    (root / "tmp" / "left-out").write_text("x")
    first = build.write_layer(root, tmp_path / "a.tar.gz", exclude=("tmp/",), mtime=0)
    again = build.write_layer(root, tmp_path / "b.tar.gz", exclude=("tmp/",), mtime=0)
    assert first.digest == again.digest  # reproducible
    assert first.media_type == oci.MEDIA_LAYER_GZIP
    assert isinstance(first.blob, Path)
    assert not list(tmp_path.glob("*.tmp"))  # the uncompressed tar is gone

    raw = gzip.decompress(first.blob.read_bytes())
    assert first.diff_id == "sha256:" + hashlib.sha256(raw).hexdigest()
    with tarfile.open(first.blob) as layer:
        names = layer.getnames()
        assert "opt/gpudra/bin/python3" in names
        assert "tmp" in names and "tmp/left-out" not in names
        assert all(m.uid == 0 and m.mtime == 0 for m in layer.getmembers())

    (tmp_path / "base" / "usr" / "bin").mkdir(parents=True)
    (tmp_path / "base" / "usr" / "bin" / "python3.11").write_text("")
    base = build.write_layer(tmp_path / "base", tmp_path / "base.tar.gz", mtime=0)
    archive = tmp_path / "image.oci.tar"
    digest = build.write_image(archive, "ghcr.io/gpudra/gpudra:9.9", base, first)
    out = tmp_path / "layout"
    with tarfile.open(archive) as tar:
        tar.extractall(out, filter="data")
    assert json.loads((out / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    (entry,) = json.loads((out / "index.json").read_text())["manifests"]
    assert entry["digest"] == digest
    assert entry["annotations"]["io.containerd.image.name"] == "ghcr.io/gpudra/gpudra:9.9"
    assert entry["annotations"]["org.opencontainers.image.ref.name"] == "9.9"

    def blob(d: str) -> bytes:
        data = (out / "blobs" / "sha256" / d.removeprefix("sha256:")).read_bytes()
        assert hashlib.sha256(data).hexdigest() == d.removeprefix("sha256:")
        return data

    manifest = json.loads(blob(digest))
    assert manifest["mediaType"] == oci.MEDIA_MANIFEST
    assert [(la["mediaType"], la["digest"], la["size"]) for la in manifest["layers"]] == [
        (oci.MEDIA_LAYER_GZIP, la.digest, len(blob(la.digest))) for la in (base, first)
    ]
    config = json.loads(blob(manifest["config"]["digest"]))
    assert config["rootfs"]["diff_ids"] == [base.diff_id, first.diff_id]
    assert config["created"] == build.CREATED
    assert [h["comment"] for h in config["history"]] == [build.BASE_COMMENT, build.APP_COMMENT]
    assert config["config"]["User"] == "65532:65532"
    assert config["config"]["Entrypoint"] == ["tini", "--", "gpudra"]


def test_make_image_runs_as_a_file() -> None:
    """`make image` and the real node's chart run build.py by path, not as a module."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "e2e" / "image" / "build.py"), "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--out" in proc.stdout
