"""kind's node image, built here without a registry, for when none is reachable.

`kind build node-image` always pulls etcd, CoreDNS, pause, kindnetd and a storage
provisioner from registries, so offline it cannot run. This builds the same image by
hand, the way kind's own base image and node build do (kind's module source, read from
the Go module proxy, gives the entrypoint, units and containerd config):

1. Debian (debootstrap) with the packages kind's base Dockerfile installs, kind's base
   files, the same units enabled and removed, `systemd-sysctl` masked (it would change
   global sysctls of the host such as fs.protected_*) and a unit that applies only
   kind's per-network-namespace sysctls. Cached as a tar by its inputs.
2. `docker import` of that tar, then in a build container: containerd (the build the
   real node uses), kubelet, kubeadm, kubectl in /usr/bin, `/kind/version`, and the
   control-plane images kubeadm asks for (`kubeadm config images list`) preloaded into
   containerd's k8s.io namespace, as kind does: OCI archives of the binaries we build
   (kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy, etcd, CoreDNS)
   and our pause, written by `e2e.image.oci`.
3. `docker commit` with kind's entrypoint, `container=docker` and systemd's stop signal,
   tagged by the Kubernetes version and a digest of every input, so a changed input
   builds a new image and an unchanged one is reused.

kindnet cannot be built offline (the module proxy does not serve it), so clusters from
this image disable kind's default CNI; `e2e.kind.network` configures pod networking.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from e2e.cache import cache_root
from e2e.cluster.harness import BUILD_SCRIPT as K8S_BUILD
from e2e.image import oci
from e2e.image.build import DEFAULT_MIRROR, ensure_debootstrap, write_layer
from e2e.kind.engine import Docker
from e2e.node import images
from e2e.pins import TOOL_VERSIONS, PinMissing, pinned
from e2e.progress import BuildFailed, build_script, step

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CONTAINERD_BUILD = REPO / "e2e" / "node" / "build.sh"
COREDNS_BUILD = REPO / "e2e" / "tools" / "build-coredns.sh"
SUITE = "bookworm"
# kind's base Dockerfile (images/base), less what only storage tests and rootless
# engines use; plus Debian's runc and CNI plugins (kind builds its own) and dbus.
PACKAGES = (
    "systemd", "dbus", "conntrack", "iptables", "nftables", "iproute2", "ethtool",
    "util-linux", "mount", "kmod", "libseccomp2", "bash", "ca-certificates", "jq",
    "procps", "socat", "runc", "containernetworking-plugins",
)  # fmt: skip
# Units kind's Dockerfile enables, and those it masks plus systemd-sysctl (global
# sysctls of the host) here.
ENABLED = ("kubelet.service", "containerd.service", "undo-mount-hacks.service")
MASKED = ("systemd-binfmt.service", "systemd-sysctl.service")
# kind's sysctl files hold only per-network-namespace keys; systemd-sysctl is masked,
# so this unit applies them (and nothing of the host's).
NET_SYSCTL_UNIT = "gpudra-net-sysctls.service"
NET_SYSCTL_FILES = ("10-network-magic.conf", "10-network-security.conf")
EXCLUDE = ("./dev/*", "./proc/*", "./sys/*", "./var/cache/apt/archives/*.deb",
           "./var/lib/apt/lists/*")  # fmt: skip
IMAGE_REPOSITORY = "gpudra.local/kind-node"
BIN_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# kind's own node image's metadata (its Dockerfile and `docker commit` changes). Older
# engines (Debian's 20.10) take no STOPSIGNAL change, so the build container is run with
# it and the commit keeps it.
COMMIT_CHANGES = (
    'ENTRYPOINT [ "/usr/local/bin/entrypoint", "/sbin/init" ]',
    "CMD []",
    "ENV container=docker",
)
STOP_SIGNAL = "SIGRTMIN+3"  # systemd exits on it (SIGTERM re-executes it)
# Control-plane images: which binary each runs, and how (kubeadm's manifests call the
# binary by name; CoreDNS's deployment passes only arguments).
BINARY_IMAGES = {
    "kube-apiserver": ("kube-apiserver", None),
    "kube-controller-manager": ("kube-controller-manager", None),
    "kube-scheduler": ("kube-scheduler", None),
    "kube-proxy": ("kube-proxy", None),
    "etcd": ("etcd", None),
    "coredns": ("coredns", ["/usr/local/bin/coredns"]),
}
# containerd's sandbox image in kind's config; kubeadm names its own pause tag too.
KIND_SANDBOX = "registry.k8s.io/pause:3.10"


class NodeImageError(Exception):
    """A one-line reason the node image could not be built, with the fix."""


@dataclass(frozen=True)
class Inputs:
    """What the node image is built from; its digest names the image."""

    version: str  # the Kubernetes pin, v1.Y.Z
    k8s_bin: Path
    containerd_bin: Path
    coredns: Path
    kind_base: Path  # kind's images/base of the pinned kind module
    kubeadm_images: tuple[str, ...]

    def digest(self) -> str:
        h = hashlib.sha256()
        for line in self._describe():
            h.update(line.encode() + b"\n")
        return h.hexdigest()[:12]

    def _describe(self) -> Iterable[str]:
        yield f"recipe {_file_hash(Path(__file__))} {_file_hash(images.PAUSE_SOURCE)}"
        yield f"base {base_key()} kind {self.kind_base.parent.parent.name}"
        yield f"version {self.version} images {' '.join(self.kubeadm_images)}"
        binaries = [self.k8s_bin / n for n in ("kubelet", "kubeadm", "kubectl", "etcd")]
        binaries += [self.k8s_bin / n for n in BINARY_IMAGES if (self.k8s_bin / n).exists()]
        binaries += [self.containerd_bin / n for n in CONTAINERD_BINARIES]
        binaries.append(self.coredns)
        for b in binaries:
            st = b.stat()
            yield f"{b} {st.st_size} {st.st_mtime_ns}"

    @property
    def image(self) -> str:
        return f"{IMAGE_REPOSITORY}:{self.version}-{self.digest()}"


CONTAINERD_BINARIES = ("containerd", "ctr", "containerd-shim-runc-v2")


def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def mirror() -> str:
    return os.environ.get("GPUDRA_DEBIAN_MIRROR", DEFAULT_MIRROR)


def cache_dir() -> Path:
    return cache_root() / "kind-node"


# -- inputs ----------------------------------------------------------------------------


def _build(script: Path, what: str, prefix: str, env: dict[str, str]) -> Path:
    try:
        return build_script(script, prefix=prefix, what=what, env=env)
    except BuildFailed as e:
        raise NodeImageError(f"{what} failed: {e}") from e


def kind_module(version: str) -> Path:
    """kind's module source from the Go module proxy (in Go's module cache)."""
    proc = subprocess.run(
        ["go", "mod", "download", "-json", f"sigs.k8s.io/kind@{version}"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "GOFLAGS": "-mod=mod", "GOSUMDB": os.environ.get("GOSUMDB", "off")},
    )
    try:
        info = json.loads(proc.stdout)
    except ValueError:
        info = {}
    if proc.returncode != 0 or "Dir" not in info:
        detail = info.get("Error") or proc.stderr.strip()[-200:] or "no output"
        raise NodeImageError(
            f"go mod download sigs.k8s.io/kind@{version} failed ({detail}): check that "
            "the Go module proxy is reachable"
        )
    return Path(info["Dir"]) / "images" / "base"


def gather(version: str) -> Inputs:
    """Builds (or finds cached) every input for Kubernetes `version` (a pin, v1.Y.Z)."""
    env = {**os.environ, "K8S_VERSION": version.removeprefix("v"),
           "K8S_EXTRA_COMMANDS": "kubeadm kube-proxy"}  # fmt: skip
    k8s_bin = _build(K8S_BUILD, f"building Kubernetes {version}", "build", env)
    containerd_bin = _build(CONTAINERD_BUILD, "building containerd", "build", dict(os.environ))
    listed = subprocess.run(
        [str(k8s_bin / "kubeadm"), "config", "images", "list", "--kubernetes-version", version],
        capture_output=True,
        text=True,
        check=False,
    )
    if listed.returncode != 0:
        raise NodeImageError(f"kubeadm config images list failed: {listed.stderr.strip()}")
    wanted = tuple(listed.stdout.split())
    coredns_tag = next((i.rsplit(":", 1)[1] for i in wanted if "/coredns" in i), None)
    if coredns_tag is None:
        raise NodeImageError(f"kubeadm {version} names no CoreDNS image: {' '.join(wanted)}")
    coredns = _build(
        COREDNS_BUILD,
        f"building CoreDNS {coredns_tag}",
        "build-coredns",
        {**os.environ, "COREDNS_VERSION": coredns_tag},
    )
    try:
        kind_version = pinned("KIND_VERSION", TOOL_VERSIONS)
    except PinMissing as e:
        raise NodeImageError(str(e)) from e
    kind_base = kind_module(kind_version)
    return Inputs(version, k8s_bin, containerd_bin, coredns, kind_base, wanted)


# -- step 1: the Debian base -------------------------------------------------------------


def base_key() -> str:
    """The base tar's cache key: suite, mirror and packages."""
    return hashlib.sha256(f"{SUITE} {mirror()} {' '.join(PACKAGES)}".encode()).hexdigest()[:12]


def base_tar() -> Path:
    """Debian with kind's packages as a tar, cached by `base_key` (debootstrap is the
    slow step; kind's files go in later, in the build container)."""
    out = cache_dir() / f"base-{SUITE}-{base_key()}.tar"
    if out.exists():
        return out
    if os.geteuid() != 0:
        raise NodeImageError("debootstrap needs root: run make e2e-kind as root")
    ensure_debootstrap()
    out.parent.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix="kind-base-", dir=out.parent) as tmp,
        step(
            f"building kind's Debian {SUITE} node base",
            f"debootstrap from {mirror()} with kind's packages, cached in {out.parent}",
            "about a minute, more with a slow mirror",
        ),
    ):
        rootfs = Path(tmp) / "rootfs"
        proc = subprocess.run(
            ["nice", "-n", "19", "debootstrap", "--variant=minbase",
             f"--include={','.join(PACKAGES)}", SUITE, str(rootfs), mirror()],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
            raise NodeImageError(f"debootstrap failed: {' '.join(tail)}; check the mirror")
        partial = out.with_suffix(".partial")
        excludes = [f"--exclude={e}" for e in EXCLUDE]
        subprocess.run(
            ["tar", "--numeric-owner", "--xattrs", *excludes, "-C", str(rootfs), "-cf",
             str(partial), "."],
            check=True,
        )  # fmt: skip
        partial.replace(out)
    return out


def base_layer(base: Path) -> oci.Layer:
    """The base tar as a gzip'd image layer (kube-proxy's image runs on it), cached
    beside it with its digests."""
    blob = base.with_suffix(".tar.gz")
    meta = base.with_suffix(".layer.json")
    if not meta.exists():
        with step("compressing the node base for kube-proxy's image", "once", "a minute"):
            layer = oci.gzip_layer(base, blob)
        meta.write_text(json.dumps({"digest": layer.digest, "diff_id": layer.diff_id}))
    data = json.loads(meta.read_text())
    return oci.Layer(oci.MEDIA_LAYER_GZIP, data["digest"], data["diff_id"],
                     blob.stat().st_size, blob)  # fmt: skip


# What kind's base Dockerfile removes after installing packages (units that must not
# run in a node); run in the build container.
REMOVALS = (
    "rm -f /lib/systemd/system/sysinit.target.wants/systemd-tmpfiles-setup.service"
    " /lib/systemd/system/multi-user.target.wants/* /etc/systemd/system/*.wants/*"
    " /lib/systemd/system/local-fs.target.wants/* /lib/systemd/system/sockets.target.wants/*udev*"
    " /lib/systemd/system/sockets.target.wants/*initctl* /lib/systemd/system/basic.target.wants/*"
    " && echo ReadKMsg=no >> /etc/systemd/journald.conf"
)


# After kind's files are in: the Dockerfile's folder modes, and containerd told to keep
# pods' oom_score_adj at or above its own, as kind does for rootless engines. Lowering it
# needs CAP_SYS_RESOURCE, which a sandboxed host can withhold even from root; runc then
# fails every pod with "can't get final child's PID from pipe". Where containerd may
# lower it, the clamp changes nothing (containerd itself runs at -999).
AFTER_COPY = (
    "chmod 755 /kind /kind/bin && sed -i"
    " 's/restrict_oom_score_adj = false/restrict_oom_score_adj = true/'"
    " /etc/containerd/config.toml && grep -q 'restrict_oom_score_adj = true'"
    " /etc/containerd/config.toml"
)


def kind_files(root: Path, kind_base: Path) -> None:
    """kind's base files with the Dockerfile's modes, the units enabled and masked as
    symlinks, our sysctl unit, /sbin/init and the CNI plugin folder, under `root`."""
    files = kind_base / "files"
    copy_tree(files / "usr" / "local" / "bin", root / "usr" / "local" / "bin", 0o755)
    copy_tree(files / "kind", root / "kind", 0o644)
    copy_tree(files / "kind" / "bin", root / "kind" / "bin", 0o755)
    copy_tree(files / "etc", root / "etc", 0o644)
    etc_systemd = root / "etc" / "systemd" / "system"
    (etc_systemd / NET_SYSCTL_UNIT).write_text(net_sysctl_unit())
    (etc_systemd / NET_SYSCTL_UNIT).chmod(0o644)
    wants = etc_systemd / "multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    for name in (*ENABLED, NET_SYSCTL_UNIT):
        (wants / name).symlink_to(f"/etc/systemd/system/{name}")
    for name in MASKED:
        (etc_systemd / name).symlink_to("/dev/null")
    (root / "etc" / "kubernetes" / "manifests").mkdir(parents=True, exist_ok=True)
    (root / "usr" / "sbin").mkdir(parents=True, exist_ok=True)
    (root / "usr" / "sbin" / "init").symlink_to("/usr/lib/systemd/systemd")
    # containerd looks for CNI plugins in /opt/cni/bin; Debian installs them here.
    (root / "opt" / "cni").mkdir(parents=True, exist_ok=True)
    (root / "opt" / "cni" / "bin").symlink_to("/usr/lib/cni")


def net_sysctl_unit() -> str:
    loads = "".join(f"ExecStart=/usr/sbin/sysctl -p /etc/sysctl.d/{f}\n" for f in NET_SYSCTL_FILES)
    return (
        "[Unit]\n"
        "Description=kind's network sysctls (this node's network namespace only)\n"
        "Before=containerd.service kubelet.service\n\n"
        f"[Service]\nType=oneshot\n{loads}\n"
        "[Install]\nWantedBy=multi-user.target\n"
    )


def copy_tree(src: Path, dst: Path, mode: int) -> None:
    """Files of `src` (recursively) into `dst` with `mode`, as Dockerfile `COPY --chmod`."""
    for f in sorted(src.rglob("*")):
        if f.is_file():
            target = dst / f.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, target)
            target.chmod(mode)


# -- step 2: the control-plane images ------------------------------------------------------


def cri_base_spec(ctr: Path) -> dict[str, object]:
    """containerd's default OCI spec with kind's createContainer hook and no rlimits
    (kind's /etc/containerd/cri-base.json)."""
    proc = subprocess.run([str(ctr), "oci", "spec"], capture_output=True, text=True, check=True)
    spec: dict[str, object] = json.loads(proc.stdout)
    hooks = spec.setdefault("hooks", {})
    assert isinstance(hooks, dict)
    hooks.setdefault("createContainer", []).append({"path": "/kind/bin/mount-product-files.sh"})
    process = spec.get("process")
    if isinstance(process, dict):
        process.pop("rlimits", None)
    return spec


def binary_image(out: Path, name: str, binary: Path, entrypoint: list[str] | None,
                 work: Path, base: oci.Layer | None = None) -> None:  # fmt: skip
    """An image of one static binary in /usr/local/bin (over `base` when given)."""
    root = work / f"{out.stem}-root"
    (root / "usr" / "local" / "bin").mkdir(parents=True)
    for d in ("tmp", "etc", "var/run"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(binary, root / "usr" / "local" / "bin" / binary.name)
    layer = write_layer(root, work / f"{out.stem}.tar.gz", mtime=0)
    shutil.rmtree(root)
    config: dict[str, object] = {"Env": [BIN_PATH]}
    if entrypoint:
        config["Entrypoint"] = entrypoint
    layers = [base, layer] if base is not None else [layer]
    history = [{"created_by": "gpudra e2e/kind/nodeimage.py"} for _ in layers]
    oci.write_oci_archive(out, name, layers, config, history)


def control_plane_images(inputs: Inputs, base: Path, work: Path) -> list[Path]:
    """An OCI archive per image kubeadm lists, but pause (preloaded apart)."""
    out = []
    for wanted in inputs.kubeadm_images:
        short = wanted.rsplit("/", 1)[-1].split(":", 1)[0]
        if short == "pause":
            continue
        if short not in BINARY_IMAGES:
            raise NodeImageError(f"kubeadm asks for {wanted}, which this build cannot make")
        binary_name, entrypoint = BINARY_IMAGES[short]
        binary = inputs.coredns if short == "coredns" else inputs.k8s_bin / binary_name
        layer_base = None
        if short == "kube-proxy":
            # kube-proxy runs iptables; the node's own Debian gives it that.
            layer_base = base_layer(base)
        archive = work / f"{short}.oci.tar"
        binary_image(archive, wanted, binary, entrypoint, work, layer_base)
        out.append(archive)
    return out


# -- step 3: assemble in the engine --------------------------------------------------------


def ensure(engine: Docker, version: str, log: Callable[[str], None] = print) -> str:
    """The node image for Kubernetes `version`: reused when built from the same inputs."""
    inputs = gather(version)
    image = inputs.image
    if engine.docker("image", "inspect", image).returncode == 0:
        return image
    base = base_tar()
    with (
        step(
            f"building kind's node image for Kubernetes {version}",
            "Debian base, containerd, kubelet, kubeadm and the control-plane images "
            f"preloaded; kept in the engine as {image}",
            "under a minute",
        ),
        tempfile.TemporaryDirectory(prefix="kind-node-", dir=cache_dir()) as tmp,
    ):
        assemble(engine, inputs, base, Path(tmp), log)
    return image


def _docker(engine: Docker, *args: str, stdin: Path | None = None, timeout: float = 600) -> str:
    if stdin is None:
        proc = engine.docker(*args, timeout=timeout)
        ok, err, out = proc.returncode == 0, proc.stderr, proc.stdout
    else:
        with stdin.open("rb") as f:
            raw = subprocess.run(
                ["docker", *args], stdin=f, capture_output=True, env=engine.env(),
                timeout=timeout, check=False,
            )  # fmt: skip
        ok, err, out = raw.returncode == 0, raw.stderr.decode(), raw.stdout.decode()
    if not ok:
        raise NodeImageError(f"docker {' '.join(args[:2])} failed: {err.strip()[-400:]}")
    return out


def assemble(engine: Docker, inputs: Inputs, base: Path, work: Path,
             log: Callable[[str], None]) -> None:  # fmt: skip
    """The base imported once, then one build container: kind's Dockerfile steps, our
    files copied in, the images preloaded, committed as `inputs.image`."""
    base_image = f"gpudra.local/kind-base:{base_key()}"
    if engine.docker("image", "inspect", base_image).returncode != 0:
        _docker(engine, "import", str(base), base_image, timeout=900)
    archives = control_plane_images(inputs, base, work)
    pause = images.build_pause(images.cache_dir())
    additions = work / "additions"
    kind_files(additions, inputs.kind_base)
    populate_additions(additions, inputs)
    tar = work / "additions.tar"
    subprocess.run(["tar", "--numeric-owner", "-C", str(additions), "-cf", str(tar), "."],
                   check=True)  # fmt: skip
    container = f"gpudra-kind-build-{os.getpid()}"
    engine.docker("rm", "-f", container)
    _docker(engine, "run", "-d", "--name", container, "--entrypoint", "sleep",
            "--stop-signal", STOP_SIGNAL, "--security-opt", "seccomp=unconfined",
            base_image, "infinity")  # fmt: skip
    try:
        _docker(engine, "exec", container, "sh", "-c", REMOVALS)
        _docker(engine, "cp", "-", f"{container}:/", stdin=tar)
        _docker(engine, "exec", container, "sh", "-c", AFTER_COPY)
        preload(engine, container, [pause, *archives], inputs)
        changes = [arg for c in COMMIT_CHANGES for arg in ("--change", c)]
        _docker(engine, "commit", *changes, container, inputs.image)
    finally:
        engine.docker("rm", "-f", container)
    log(f"kind: node image {inputs.image} built")


def populate_additions(root: Path, inputs: Inputs) -> None:
    """The binaries, /kind/version and containerd's base spec, under `root`."""
    usr_bin = root / "usr" / "bin"
    usr_bin.mkdir(parents=True, exist_ok=True)
    for name in ("kubelet", "kubeadm", "kubectl"):
        shutil.copy2(inputs.k8s_bin / name, usr_bin / name)
    local_bin = root / "usr" / "local" / "bin"
    local_bin.mkdir(parents=True, exist_ok=True)
    for name in CONTAINERD_BINARIES:
        shutil.copy2(inputs.containerd_bin / name, local_bin / name)
    (root / "kind" / "version").write_text(inputs.version)
    containerd_etc = root / "etc" / "containerd"
    containerd_etc.mkdir(parents=True, exist_ok=True)
    spec = cri_base_spec(inputs.containerd_bin / "ctr")
    (containerd_etc / "cri-base.json").write_text(json.dumps(spec, indent=2) + "\n")


def preload(engine: Docker, container: str, archives: list[Path], inputs: Inputs) -> None:
    """containerd in the build container imports the archives, as kind's node build
    does (`ctr images import --no-unpack`, pinned so the kubelet never collects them)."""
    _docker(engine, "exec", "-d", container, "containerd")
    _docker(engine, "exec", container, "sh", "-c",
            "for i in $(seq 50); do ctr version >/dev/null 2>&1 && exit 0; sleep 0.2; done; "
            "ctr version")  # fmt: skip
    ctr = ("ctr", "--namespace=k8s.io")
    pinned_label = "--label=io.cri-containerd.pinned=pinned"
    for archive in archives:
        _docker(engine, "exec", "-i", container, *ctr, "images", "import", "--no-unpack",
                "--digests", pinned_label, "-", stdin=archive)  # fmt: skip
    pause_names = [i for i in inputs.kubeadm_images if "/pause:" in i]
    for name in {*pause_names, KIND_SANDBOX}:
        _docker(engine, "exec", container, *ctr, "images", "tag", "--force",
                images.PAUSE_IMAGE, name)  # fmt: skip
    listed = _docker(engine, "exec", container, *ctr, "images", "list", "-q").split()
    missing = sorted(set(inputs.kubeadm_images) - set(listed))
    if missing:
        raise NodeImageError(f"preloading left out {' '.join(missing)}")
    _docker(engine, "exec", container, "sh", "-c",
            "pkill containerd; for i in $(seq 50); do pgrep -x containerd >/dev/null || exit 0; "
            "sleep 0.2; done; exit 1")  # fmt: skip
