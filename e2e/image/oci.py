"""The one OCI image-layout archive writer for the images built here without an engine.

`make image` (gzip'd layers in files, hundreds of MiB) and the real node's pause and test
images (one small uncompressed layer in memory) need the same few files: layer blobs named
by their sha256, a config, a manifest, an index that names the image, and `oci-layout`,
in a tar that `ctr images import` loads. The stdlib writes them, so no daemon, registry
or extra tool is needed. Output depends only on the inputs (sorted JSON, fixed order,
owners and mtimes), so a rebuild gives the same digests.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar"
MEDIA_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
# Names the image on import, so `ctr images import` needs no `--base-name`.
NAME_ANNOTATION = "io.containerd.image.name"
REF_ANNOTATION = "org.opencontainers.image.ref.name"
ARCHITECTURE = "amd64"
OS = "linux"


@dataclass(frozen=True)
class Layer:
    """A layer blob: `digest` names it as stored, `diff_id` its uncompressed tar (they
    differ only when gzip'd); `blob` is its bytes, or the file holding them when large."""

    media_type: str
    digest: str
    diff_id: str
    size: int
    blob: bytes | Path


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def tar_layer(data: bytes) -> Layer:
    """An uncompressed layer in memory: for small images, where gzip would save little."""
    digest = _digest(data)
    return Layer(MEDIA_LAYER, digest, digest, len(data), data)


def gzip_layer(raw: Path, out: Path) -> Layer:
    """Gzips the layer tar `raw` into `out` in one pass, hashing both sides on the way
    (no second read of a large file); mtime 0 in the header keeps the digest reproducible."""
    diff = hashlib.sha256()
    packed = hashlib.sha256()
    with raw.open("rb") as src, out.open("wb") as dst:
        sink = _HashingWriter(dst, packed.update)
        with gzip.GzipFile(fileobj=sink, mode="wb", mtime=0, compresslevel=6) as gz:
            while chunk := src.read(1 << 20):
                diff.update(chunk)
                gz.write(chunk)
    return Layer(
        MEDIA_LAYER_GZIP,
        f"sha256:{packed.hexdigest()}",
        f"sha256:{diff.hexdigest()}",
        out.stat().st_size,
        out,
    )


class _HashingWriter:
    """A file-like sink that hashes what gzip writes to the blob."""

    def __init__(self, dst: BinaryIO, update: Callable[[bytes], object]) -> None:
        self.dst = dst
        self.update = update

    def write(self, data: bytes) -> int:
        self.update(data)
        return self.dst.write(data)

    def flush(self) -> None:
        self.dst.flush()


def ref_name(name: str) -> str:
    """The tag of `name` (`latest` when it has none; a registry's port is not a tag)."""
    last = name.rsplit("/", 1)[-1]
    return last.rsplit(":", 1)[1] if ":" in last else "latest"


def _json(value: object) -> bytes:
    return json.dumps(value, sort_keys=True).encode()


def write_oci_archive(
    out: Path,
    name: str,
    layers: Sequence[Layer],
    config: Mapping[str, object],
    history: Sequence[Mapping[str, str]],
    created: str | None = None,
) -> str:
    """Writes image `name` as an OCI image-layout tar at `out`; returns the manifest digest.

    `config` is the image's runtime config (Entrypoint, Env, ...), `history` its entries,
    `created` its creation time (left out when None). The archive is written beside `out`
    and renamed, so an interrupted build never leaves a truncated archive to be reused.
    """
    image: dict[str, object] = {
        "architecture": ARCHITECTURE,
        "os": OS,
        "config": dict(config),
        "rootfs": {"type": "layers", "diff_ids": [la.diff_id for la in layers]},
        "history": [dict(h) for h in history],
    }
    if created is not None:
        image["created"] = created
    image_blob = _json(image)
    manifest_blob = _json(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": {
                "mediaType": MEDIA_CONFIG,
                "digest": _digest(image_blob),
                "size": len(image_blob),
            },
            "layers": [
                {"mediaType": la.media_type, "digest": la.digest, "size": la.size} for la in layers
            ],
        }
    )
    digest = _digest(manifest_blob)
    index = {
        "schemaVersion": 2,
        "mediaType": MEDIA_INDEX,
        "manifests": [
            {
                "mediaType": MEDIA_MANIFEST,
                "digest": digest,
                "size": len(manifest_blob),
                "platform": {"architecture": ARCHITECTURE, "os": OS},
                "annotations": {NAME_ANNOTATION: name, REF_ANNOTATION: ref_name(name)},
            }
        ],
    }
    blobs: dict[str, bytes | Path] = {la.digest: la.blob for la in layers}
    blobs[_digest(image_blob)] = image_blob
    blobs[digest] = manifest_blob
    partial = out.with_suffix(".partial")
    with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
        _add(tar, "oci-layout", _json({"imageLayoutVersion": "1.0.0"}))
        _add(tar, "index.json", _json(index))
        for blob_digest, blob in blobs.items():
            _add(tar, f"blobs/sha256/{blob_digest.removeprefix('sha256:')}", blob)
    partial.replace(out)
    return digest


def _add(tar: tarfile.TarFile, path: str, blob: bytes | Path) -> None:
    """A regular file owned by root, mode 0644, mtime 0: the archive depends on content only."""
    info = tarfile.TarInfo(path)
    info.mode, info.mtime = 0o644, 0
    if isinstance(blob, bytes):
        info.size = len(blob)
        tar.addfile(info, io.BytesIO(blob))
        return
    info.size = blob.stat().st_size
    with blob.open("rb") as f:
        tar.addfile(info, f)
