"""The node image's own files (e2e/kind/nodeimage.py), laid out from a stand-in of
kind's images/base: kind's units enabled, systemd-sysctl masked so the node cannot
change the host's global sysctls, and only kind's network sysctls applied."""

from __future__ import annotations

from pathlib import Path

from e2e.kind import nodeimage


def _kind_base(root: Path) -> Path:
    files = root / "files"
    for rel, text in (
        ("usr/local/bin/entrypoint", "#!/bin/bash\n"),
        ("kind/bin/undo-mount-hacks.sh", "#!/bin/bash\n"),
        ("kind/README.txt", "kind\n"),
        ("etc/containerd/config.toml", "version = 2\n"),
        ("etc/systemd/system/kubelet.service", "[Service]\n"),
        ("etc/sysctl.d/10-network-magic.conf", "net.ipv4.conf.all.route_localnet=1\n"),
        ("etc/sysctl.d/10-network-security.conf", "net.ipv4.conf.all.rp_filter=1\n"),
    ):
        (files / rel).parent.mkdir(parents=True, exist_ok=True)
        (files / rel).write_text(text)
    return root


def test_units_enabled_masked_and_modes_as_kind_sets_them(tmp_path: Path) -> None:
    root = tmp_path / "root"
    nodeimage.kind_files(root, _kind_base(tmp_path / "base"))
    etc = root / "etc" / "systemd" / "system"
    for unit in ("kubelet.service", "containerd.service", nodeimage.NET_SYSCTL_UNIT):
        assert (
            str((etc / "multi-user.target.wants" / unit).readlink())
            == f"/etc/systemd/system/{unit}"
        )
    assert str((etc / "systemd-sysctl.service").readlink()) == "/dev/null"
    assert str((etc / "systemd-binfmt.service").readlink()) == "/dev/null"
    assert (root / "usr/local/bin/entrypoint").stat().st_mode & 0o777 == 0o755
    assert (root / "kind/bin/undo-mount-hacks.sh").stat().st_mode & 0o777 == 0o755
    assert (root / "kind/README.txt").stat().st_mode & 0o777 == 0o644
    assert str((root / "usr/sbin/init").readlink()) == "/usr/lib/systemd/systemd"
    assert str((root / "opt/cni/bin").readlink()) == "/usr/lib/cni"


def test_the_sysctl_unit_loads_only_kinds_network_files() -> None:
    unit = nodeimage.net_sysctl_unit()
    loads = [ln for ln in unit.splitlines() if ln.startswith("ExecStart=")]
    assert loads == [
        f"ExecStart=/usr/sbin/sysctl -p /etc/sysctl.d/{f}" for f in nodeimage.NET_SYSCTL_FILES
    ]


def test_the_image_name_changes_with_any_input(tmp_path: Path) -> None:
    bins = tmp_path / "bin"
    bins.mkdir()
    names = ("kubelet", "kubeadm", "kubectl", "etcd", *nodeimage.BINARY_IMAGES,
             *nodeimage.CONTAINERD_BINARIES)  # fmt: skip
    for name in names:
        (bins / name).write_bytes(b"1")
    kind = tmp_path / "kind@v0.33.0" / "images" / "base"
    kind.mkdir(parents=True)
    args = ("v1.36.5", bins, bins, bins / "coredns", kind, ("registry.k8s.io/pause:3.10.2",))
    first = nodeimage.Inputs(*args).image
    assert first.startswith(f"{nodeimage.IMAGE_REPOSITORY}:v1.36.5-")
    assert nodeimage.Inputs(*args).image == first
    (bins / "kubelet").write_bytes(b"22")
    assert nodeimage.Inputs(*args).image != first
