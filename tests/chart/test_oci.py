"""The one OCI archive writer (`e2e.image.oci`), shared by `make image` and the real
node's pause and test images: what `ctr images import` reads must not drift, and the same
inputs must give the same bytes (cached archives and pinned images rely on it)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from e2e.image import build, oci

# What the writer in e2e/node/images.py gave before the two writers became one.
PINNED = "sha256:ae04ff3c4ccc9d97d3ae70485f1aed5e407ae0bca5416b2c320151974dad8d04"


def layer_tar(text: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("hello")
        info.size = len(text)
        tar.addfile(info, io.BytesIO(text))
    return buf.getvalue()


def members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        out = {}
        for m in tar.getmembers():
            assert m.isreg() and (m.mode, m.mtime, m.uid, m.gid) == (0o644, 0, 0, 0)
            f = tar.extractfile(m)
            assert f is not None
            out[m.name] = f.read()
        return out


def test_in_memory_image_as_the_real_node_imports_it(tmp_path: Path) -> None:
    layer = oci.tar_layer(layer_tar(b"hi\n"))
    assert layer.digest == layer.diff_id  # uncompressed: the blob is the diff
    out = tmp_path / "pause.tar"
    history = [{"created_by": "test"}]
    digest = oci.write_oci_archive(
        out, "gpudra.local/pause:1", [layer], {"Entrypoint": ["/pause"]}, history
    )
    files = members(out)
    assert not list(tmp_path.glob("*.partial"))
    assert list(files)[:2] == ["oci-layout", "index.json"]
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    for name, data in files.items():
        if name.startswith("blobs/"):
            assert name == "blobs/sha256/" + hashlib.sha256(data).hexdigest()

    (entry,) = json.loads(files["index.json"])["manifests"]
    assert entry["digest"] == digest
    assert entry["platform"] == {"architecture": "amd64", "os": "linux"}
    assert entry["annotations"] == {
        "io.containerd.image.name": "gpudra.local/pause:1",
        "org.opencontainers.image.ref.name": "1",
    }
    manifest = json.loads(files[f"blobs/sha256/{digest.removeprefix('sha256:')}"])
    assert manifest["layers"] == [
        {"mediaType": oci.MEDIA_LAYER, "digest": layer.digest, "size": layer.size}
    ]
    config_name = "blobs/sha256/" + manifest["config"]["digest"].removeprefix("sha256:")
    config = json.loads(files[config_name])
    assert "created" not in config  # nothing that changes between builds
    assert config["history"] == history
    assert config["config"] == {"Entrypoint": ["/pause"]}
    assert config["rootfs"] == {"type": "layers", "diff_ids": [layer.digest]}


def test_same_inputs_same_bytes_from_memory_or_file(tmp_path: Path) -> None:
    raw = tmp_path / "layer.tar"
    raw.write_bytes(layer_tar(b"hi\n"))
    packed = oci.gzip_layer(raw, tmp_path / "layer.tar.gz")
    data = packed.blob
    assert isinstance(data, Path)
    assert packed.media_type == oci.MEDIA_LAYER_GZIP
    assert packed.diff_id == "sha256:" + hashlib.sha256(raw.read_bytes()).hexdigest()
    assert packed.digest == "sha256:" + hashlib.sha256(data.read_bytes()).hexdigest()
    assert gzip.decompress(data.read_bytes()) == raw.read_bytes()
    in_memory = oci.Layer(
        packed.media_type, packed.digest, packed.diff_id, packed.size, data.read_bytes()
    )

    def write(layer: oci.Layer, out: Path) -> bytes:
        history = [{"created": "1970-01-01T00:00:00Z", "comment": "c"}]
        oci.write_oci_archive(out, "x/y:z", [layer], {}, history, "1970-01-01T00:00:00Z")
        return out.read_bytes()

    assert write(packed, tmp_path / "a.tar") == write(in_memory, tmp_path / "b.tar")


def test_manifest_digest_is_pinned(tmp_path: Path) -> None:
    """A change here changes every image's digest (the real node's pinned pause image
    among them): only on purpose."""
    digest = oci.write_oci_archive(
        tmp_path / "a.tar",
        "gpudra.local/pause:1",
        [oci.tar_layer(b"layer")],
        {"Entrypoint": ["/pause"]},
        [{"created_by": "gpudra e2e/node/images.py"}],
    )
    assert digest == PINNED


@pytest.mark.parametrize(
    ("name", "ref"),
    [
        ("gpudra.local/pause:1", "1"),
        (f"ghcr.io/gpudra/gpudra:{build.project_version()}", build.project_version()),
        ("localhost:5000/gpudra", "latest"),
        ("gpudra", "latest"),
    ],
)
def test_ref_name_is_the_tag(name: str, ref: str) -> None:
    assert oci.ref_name(name) == ref
