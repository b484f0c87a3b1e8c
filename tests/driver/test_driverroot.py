"""Files of the driver root found as the root's own tree has them: its symbolic links
followed inside it, whatever view of the host this process has."""

from __future__ import annotations

import os
from pathlib import Path

from gpudra.driver.driverroot import NVML_LIBRARY, DriverRoot
from gpudra.driver.nvml.standin import install_driver_root
from gpudra.driver.sharing import MPS_SERVER, find_tool, server_path

from e2e.debian_driver import LIBRARY_DIR, debian_layout

VERSION = "535.261.03"


def _debian(tmp_path: Path) -> DriverRoot:
    """A Debian-packaged driver installed on a host whose / this process sees at
    `tmp_path/host`, as the chart's agent sees it at /host."""
    host = tmp_path / "host"
    install_driver_root(host, VERSION)
    debian_layout(host)
    return DriverRoot(Path("/"), host)


def test_absolute_links_are_followed_inside_the_root(tmp_path: Path) -> None:
    root = _debian(tmp_path)
    nvml = f"/{LIBRARY_DIR}/nvidia/current/libnvidia-ml.so.{VERSION}"
    assert root.resolve(f"/{LIBRARY_DIR}/{NVML_LIBRARY}") == nvml
    assert root.resolve(f"{LIBRARY_DIR}/{NVML_LIBRARY}") == nvml
    assert root.library(NVML_LIBRARY) == root.seen / nvml.lstrip("/")
    # Followed from this process's own /, the same link names nothing.
    assert not (root.seen / LIBRARY_DIR / NVML_LIBRARY).exists()


def test_the_tools_are_found_through_the_alternatives(tmp_path: Path) -> None:
    root = _debian(tmp_path)
    assert find_tool("nvidia-smi", root) == root.seen / "usr/lib/nvidia/current/nvidia-smi"
    assert find_tool("nvidia-cuda-mps-control", root) == (
        root.seen / "usr/bin/nvidia-cuda-mps-control"
    )


def test_no_link_leads_out_of_the_root(tmp_path: Path) -> None:
    """A link to an absolute path, or up through `..` past the root, stays in the root:
    this process's own /etc/hostname is never what the root's files name."""
    root = DriverRoot(Path("/"), tmp_path)
    lib = tmp_path / "usr/lib64"
    lib.mkdir(parents=True)
    (lib / "absolute").symlink_to("/etc/hostname")
    (lib / "upwards").symlink_to("../../../../../../../../etc/hostname")
    assert Path("/etc/hostname").is_file()
    assert root.resolve("/usr/lib64/absolute") is None
    assert root.resolve("/usr/lib64/upwards") is None
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/hostname").write_text("the root's own\n")
    assert root.resolve("/usr/lib64/absolute") == "/etc/hostname"
    assert root.resolve("/usr/lib64/upwards") == "/etc/hostname"
    assert root.resolve("/../../etc/hostname") == "/etc/hostname"


def test_what_is_no_regular_file_resolves_to_nothing(tmp_path: Path) -> None:
    root = DriverRoot(Path("/"), tmp_path)
    lib = tmp_path / "usr/lib64"
    lib.mkdir(parents=True)
    (lib / "file").write_text("")
    (lib / "folder").mkdir()
    (lib / "dangling").symlink_to("missing")
    (lib / "loop-a").symlink_to("loop-b")
    (lib / "loop-b").symlink_to("loop-a")
    (lib / "to-folder").symlink_to("folder")
    os.mkfifo(lib / "fifo")
    for name in ("folder", "dangling", "loop-a", "to-folder", "fifo", "missing", "file/x"):
        assert root.resolve(f"/usr/lib64/{name}") is None, name
    assert root.resolve("/") is None
    assert root.resolve("/usr/lib64/folder/../file") == "/usr/lib64/file"
    assert root.resolve("/usr/lib64/to-folder/../file") == "/usr/lib64/file"


def test_a_chain_of_links_as_long_as_linux_allows_is_followed(tmp_path: Path) -> None:
    root = DriverRoot(Path("/"), tmp_path)
    (tmp_path / "f0").write_text("")
    for i in range(1, 41):
        (tmp_path / f"f{i}").symlink_to(f"f{i - 1}")
    assert root.resolve("/f40") == "/f0"
    (tmp_path / "f41").symlink_to("f40")
    assert root.resolve("/f41") is None  # 41 links: ELOOP


def test_the_mps_server_ends_the_path_its_control_daemon_searches(tmp_path: Path) -> None:
    """NVIDIA's control daemon starts its server with execlp: its PATH must name the
    root's server folder, after the folders it has (the pod image's own programs stay
    first)."""
    debian = _debian(tmp_path / "debian")
    assert server_path(debian, "/usr/bin:/bin") == f"/usr/bin:/bin:{debian.seen}/usr/sbin"
    assert server_path(debian, "") == f"{debian.seen}/usr/sbin"
    assert server_path(debian, f"/bin:{debian.seen}/usr/sbin") is None  # there already

    files = tmp_path / "files"
    install_driver_root(files, VERSION)
    assert server_path(DriverRoot(files), "/bin") == f"/bin:{files}/usr/bin"
    (files / "usr/bin" / MPS_SERVER).unlink()
    assert server_path(DriverRoot(files), "/bin") is None
