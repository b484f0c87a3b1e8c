"""CDI specs for prepared claims: build, write atomically, remove, list.

One spec file per claim, named after the claim UID, in the dynamic CDI directory
(/var/run/cdi), written at prepare and removed at unprepare. The container
runtime reads it when it creates a container that uses one of its devices.

Kind `k8s.<driver name>/claim` (`claim_kind`; `k8s.gpu.nvidia.com/claim` for the
default name, as the upstream DRA driver names it): each driver on a node has its own
kind, so two drivers' specs of one claim never define the same device, and an agent
lists and sweeps only its own files. The NVIDIA container toolkit owns vendor `nvidia.com`
(`nvidia.com/gpu=0`, `nvidia.com/gpu=GPU-<uuid>`, `nvidia.com/gpu=all`), and
the same device defined in two specs at one priority is a conflict that fails
every container using it. A separate vendor also means the toolkit's regenerated
`nvidia.yaml` and our per-claim files never overwrite or clean up each other.

When the toolkit's own spec is installed, a claim can reference its devices
(`nvidia.com/gpu=<uuid>`) instead of carrying device nodes and driver mounts:
the toolkit then injects exactly what it injects for any other workload.

Pure data in, files out: nothing here knows about Kubernetes or gRPC.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Final, Literal, TypeAlias

from gpudra.api import jsonbytes
from gpudra.common.files import atomic_write, fsync_dir
from gpudra.driver.driverroot import DriverRoot

__all__ = [
    "CONTROL_DEVICE_NODES",
    "DEFAULT_CDI_ROOT",
    "DEFAULT_KIND",
    "DEFAULT_TOOLKIT_SPEC_PATHS",
    "DRIVER_UTILITIES",
    "LIBRARY_MOUNT_OPTIONS",
    "TOOLKIT_KIND",
    "CdiDevice",
    "CdiError",
    "CdiSpecStore",
    "ContainerEdits",
    "DeviceNode",
    "DeviceNumbers",
    "Hook",
    "Mount",
    "ToolkitSpec",
    "build_spec",
    "cdi_device_name",
    "claim_kind",
    "driver_common_edits",
    "find_driver_files",
    "find_toolkit_spec",
    "minimum_cdi_version",
    "numbered",
    "qualified_id",
    "toolkit_device_ids",
    "validate_claim_uid",
]

log = logging.getLogger(__name__)

DEFAULT_CDI_ROOT: Final = Path("/var/run/cdi")
DEFAULT_KIND: Final = "k8s.gpu.nvidia.com/claim"
TOOLKIT_KIND: Final = "nvidia.com/gpu"
# Static dir first (what an administrator installed), then the toolkit's generated one.
DEFAULT_TOOLKIT_SPEC_PATHS: Final = (
    Path("/etc/cdi/nvidia.yaml"),
    Path("/etc/cdi/nvidia.json"),
    Path("/var/run/cdi/nvidia.yaml"),
    Path("/var/run/cdi/nvidia.json"),
)
CONTROL_DEVICE_NODES: Final = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
# What the container toolkit uses for driver libraries.
LIBRARY_MOUNT_OPTIONS: Final = ("ro", "nosuid", "nodev", "rbind", "rprivate")
# The driver's utilities a container may need, beside its libraries, as the NVIDIA
# container toolkit mounts them; found in `DRIVER_TOOL_DIRS` (`DriverRoot.tool`).
DRIVER_UTILITIES: Final = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
# Searched after the driver's own library folders: CUDA images expect the driver there.
_LEGACY_LIBRARY_PATH: Final = ("/usr/local/nvidia/lib", "/usr/local/nvidia/lib64")

HookName: TypeAlias = Literal[
    "createRuntime", "createContainer", "startContainer", "poststart", "poststop", "prestart"
]
_HOOK_NAMES: Final = frozenset(
    {"createRuntime", "createContainer", "startContainer", "poststart", "poststop", "prestart"}
)

# Kubernetes object UIDs are RFC 4122 UUIDs in lower case.
_UID_RE: Final = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_VENDOR_CLASS_RE: Final = re.compile(r"[A-Za-z]([A-Za-z0-9._-]*[A-Za-z0-9])?")
_DEVICE_NAME_RE: Final = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")
_ENV_KEY_RE: Final = re.compile(r"[^=\x00]+")
_ANNOTATION_KEY_RE: Final = re.compile(
    r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)


class CdiError(ValueError):
    """Input that would produce an invalid or unsafe CDI spec."""


# --- input data -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeviceNode:
    """A device node; major/minor/type are looked up by the runtime when left out."""

    path: str
    host_path: str | None = None
    type: Literal["c", "b", "u", "p"] | None = None
    major: int | None = None
    minor: int | None = None
    file_mode: int | None = None
    permissions: str | None = None
    uid: int | None = None
    gid: int | None = None


# (major, minor) of a device node the host may lack (emulated GPUs); None: unknown.
DeviceNumbers: TypeAlias = Callable[[str], tuple[int, int] | None]


def numbered(path: str, host_path: str | None, numbers: tuple[int, int] | None) -> DeviceNode:
    """A character device node, with its numbers when known: the runtime then makes
    the node in the container without looking at the host."""
    if numbers is None:
        return DeviceNode(path=path, host_path=host_path)
    return DeviceNode(path=path, host_path=host_path, type="c", major=numbers[0], minor=numbers[1])


@dataclass(frozen=True, slots=True)
class Mount:
    host_path: str
    container_path: str
    options: tuple[str, ...] = ()
    type: str | None = None


@dataclass(frozen=True, slots=True)
class Hook:
    hook_name: HookName
    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    timeout: int | None = None


@dataclass(frozen=True, slots=True)
class ContainerEdits:
    env: Mapping[str, str] = field(default_factory=dict)
    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()
    hooks: tuple[Hook, ...] = ()
    additional_gids: tuple[int, ...] = ()

    def is_empty(self) -> bool:
        return not (
            self.env or self.device_nodes or self.mounts or self.hooks or self.additional_gids
        )


@dataclass(frozen=True, slots=True)
class CdiDevice:
    """One device of a claim as it goes into the CDI spec (the kubelet is told only its
    qualified ID, in a `plugin.PreparedDevice`).

    `toolkit_ids` are the container toolkit's CDI IDs for the same device; when
    set, the device's nodes and the driver files come from the toolkit's spec.
    """

    name: str
    edits: ContainerEdits = field(default_factory=ContainerEdits)
    annotations: Mapping[str, str] = field(default_factory=dict)
    toolkit_ids: tuple[str, ...] = ()


# --- names ------------------------------------------------------------------------------------


def validate_claim_uid(uid: str) -> str:
    """Return `uid` if it is a Kubernetes UID; it becomes part of a file name."""
    if not isinstance(uid, str) or not _UID_RE.fullmatch(uid):
        raise CdiError(
            f"claim UID {uid!r} is not a Kubernetes UID (expected lower-case 8-4-4-4-12 hex digits)"
        )
    return uid


def _split_kind(kind: str) -> tuple[str, str]:
    vendor, sep, cdi_class = kind.partition("/")
    if (
        not sep
        or not _VENDOR_CLASS_RE.fullmatch(vendor)
        or not _VENDOR_CLASS_RE.fullmatch(cdi_class)
    ):
        raise CdiError(
            f"CDI kind {kind!r} must be vendor/class, each starting with a letter, ending "
            "with a letter or digit and containing only letters, digits, '.', '-', '_'"
        )
    return vendor, cdi_class


def _validate_device_name(name: str) -> str:
    if not isinstance(name, str) or not _DEVICE_NAME_RE.fullmatch(name):
        raise CdiError(
            f"CDI device name {name!r} must start and end with a letter or digit and "
            "contain only letters, digits, '_', '-', '.', ':'"
        )
    return name


def cdi_device_name(claim_uid: str, device_name: str) -> str:
    """`<claimUID>-<deviceName>`: unique on the node, so specs of claims never collide."""
    return _validate_device_name(f"{validate_claim_uid(claim_uid)}-{device_name}")


def claim_kind(driver_name: str) -> str:
    """The CDI kind of the claim specs of the DRA driver named `driver_name`.

    Named after the driver, as upstream's driver does, because the runtime drops a
    device that two specs of one priority define, and an agent sweeps the files of its
    kind that its checkpoint does not name: with one kind for every driver name, a claim
    with devices of two drivers lost them all, and two drivers sharing a CDI folder
    removed each other's specs."""
    kind = f"k8s.{driver_name}/claim"
    _split_kind(kind)
    return kind


def qualified_id(name: str, kind: str = DEFAULT_KIND) -> str:
    """The fully qualified CDI device ID `vendor/class=name` handed to the kubelet."""
    _split_kind(kind)
    return f"{kind}={_validate_device_name(name)}"


# --- spec building ----------------------------------------------------------------------------


# The widths the CDI library decodes into (specs-go): a number past one fails the
# whole spec's load, so the builder refuses it.
_UINT32_MAX: Final = 2**32 - 1
_INT64_MAX: Final = 2**63 - 1
_NODE_NUMBER_MAX: Final = {
    "major": _INT64_MAX,
    "minor": _INT64_MAX,
    "fileMode": _UINT32_MAX,
    "uid": _UINT32_MAX,
    "gid": _UINT32_MAX,
}


def _absolute(path: str, what: str) -> str:
    if not isinstance(path, str) or not path.startswith("/") or "\x00" in path:
        raise CdiError(f"{what} {path!r} must be an absolute path")
    return path


def _edits_json(edits: ContainerEdits) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if edits.env:
        env = []
        for key, value in edits.env.items():
            if not _ENV_KEY_RE.fullmatch(key) or "\x00" in value:
                raise CdiError(f"environment variable name {key!r} is invalid")
            env.append(f"{key}={value}")
        out["env"] = env
    if edits.device_nodes:
        nodes = []
        for node in edits.device_nodes:
            item: dict[str, Any] = {"path": _absolute(node.path, "device node path")}
            if node.host_path is not None:
                item["hostPath"] = _absolute(node.host_path, "device node host path")
            if node.type is not None:
                if node.type not in ("c", "b", "u", "p"):
                    raise CdiError(f"device node type {node.type!r} must be one of b, c, u, p")
                item["type"] = node.type
            if node.permissions is not None:
                if not node.permissions or set(node.permissions) - set("rwm"):
                    raise CdiError(f"device node permissions {node.permissions!r}: use r, w, m")
                item["permissions"] = node.permissions
            for key, number in (
                ("major", node.major),
                ("minor", node.minor),
                ("fileMode", node.file_mode),
                ("uid", node.uid),
                ("gid", node.gid),
            ):
                if number is not None:
                    if not 0 <= number <= _NODE_NUMBER_MAX[key]:
                        raise CdiError(
                            f"device node {node.path}: {key} {number} must be from 0 to "
                            f"{_NODE_NUMBER_MAX[key]}"
                        )
                    item[key] = number
            nodes.append(item)
        out["deviceNodes"] = nodes
    if edits.mounts:
        mounts = []
        for mount in edits.mounts:
            item = {
                "hostPath": _absolute(mount.host_path, "mount host path"),
                "containerPath": _absolute(mount.container_path, "mount container path"),
            }
            if mount.options:
                item["options"] = list(mount.options)
            if mount.type:
                item["type"] = mount.type
            mounts.append(item)
        out["mounts"] = mounts
    if edits.hooks:
        hooks = []
        for hook in edits.hooks:
            if hook.hook_name not in _HOOK_NAMES:
                raise CdiError(
                    f"hook name {hook.hook_name!r}; accepted: {', '.join(sorted(_HOOK_NAMES))}"
                )
            item = {"hookName": hook.hook_name, "path": _absolute(hook.path, "hook path")}
            if hook.args:
                item["args"] = list(hook.args)
            if hook.env:
                for entry in hook.env:
                    # The library's check: a name before the first "=".
                    if entry.find("=") <= 0 or "\x00" in entry:
                        raise CdiError(
                            f"hook {hook.hook_name} environment entry {entry!r}: give NAME=value"
                        )
                item["env"] = list(hook.env)
            if hook.timeout is not None:
                item["timeout"] = hook.timeout
            hooks.append(item)
        out["hooks"] = hooks
    if edits.additional_gids:
        if any(not 0 <= gid <= _UINT32_MAX for gid in edits.additional_gids):
            raise CdiError(f"additional GIDs must be from 0 to {_UINT32_MAX}")
        out["additionalGids"] = list(edits.additional_gids)
    return out


def _annotations(annotations: Mapping[str, str], where: str) -> dict[str, str]:
    for key, value in annotations.items():
        if not isinstance(key, str) or not _ANNOTATION_KEY_RE.fullmatch(key):
            raise CdiError(f"{where}: annotation key {key!r} is not a valid qualified name")
        if not isinstance(value, str):
            raise CdiError(f"{where}: annotation {key!r} must have a string value")
    return dict(annotations)


def _marker_env(device_name: str) -> dict[str, str]:
    # CDI rejects a device with no edits; in toolkit mode ours would have none.
    key = "GPUDRA_DEVICE_" + re.sub(r"[^A-Za-z0-9]", "_", device_name).upper()
    return {key: device_name}


_VERSIONS: Final = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0")


def _edits_level(edits: Mapping[str, Any]) -> int:
    """The index in `_VERSIONS` that one containerEdits needs (`minimum_cdi_version`)."""
    if edits.get("additionalGids") or edits.get("intelRdt"):
        return 4
    if any(n.get("hostPath") for n in edits.get("deviceNodes") or ()):
        return 2
    if any(m.get("type") for m in edits.get("mounts") or ()):
        return 1
    return 0


def minimum_cdi_version(spec: Mapping[str, Any]) -> str:
    """The lowest cdiVersion whose schema covers the fields `spec` uses.

    Older runtimes only load versions they know, so writing the minimum keeps
    specs loadable on the widest range of containerd and CRI-O releases. Rules
    follow the CDI library: mount `type` 0.4.0; device `hostPath` or a device
    name starting with a non-letter 0.5.0; annotations or a '.' in the class
    0.6.0; `additionalGids` or `intelRdt` 0.7.0.
    """
    devices: Sequence[Mapping[str, Any]] = spec.get("devices") or ()
    needed = _edits_level(spec.get("containerEdits") or {})
    for d in devices:
        needed = max(needed, _edits_level(d.get("containerEdits") or {}))
    return _version(spec, needed)


def _version(spec: Mapping[str, Any], edits_need: int) -> str:
    """`minimum_cdi_version` of `spec`, whose containerEdits need `edits_need` (an index
    in `_VERSIONS`): the rules on names, annotations and the kind."""
    needed = edits_need
    devices: Sequence[Mapping[str, Any]] = spec.get("devices") or ()
    if needed < 2 and any(not str(d.get("name", "a"))[:1].isalpha() for d in devices):
        needed = 2
    kind = str(spec.get("kind", ""))
    if needed < 3 and (
        spec.get("annotations")
        or any(d.get("annotations") for d in devices)
        or "." in kind.partition("/")[2]
    ):
        needed = 3
    return _VERSIONS[needed]


def convert_edits(edits: ContainerEdits) -> tuple[dict[str, Any], int]:
    """`edits` checked and converted to a spec's containerEdits, with the index in
    `_VERSIONS` they need; raises CdiError."""
    out = _edits_json(edits)
    return out, _edits_level(out)


class ConvertedEdits:
    """`convert_edits` done once per edits object: a whole GPU's edits and the node's
    common edits (dozens of mounts on a real node) are the same objects on every
    prepare (`ClaimSpecs`), so each is checked and converted for the first spec and
    reused after. By identity, holding each object converted, so that an id is never
    taken for another object's; the oldest go first beyond `limit` (edits made for one
    claim, a MIG device's or an MPS member's, pass through). The JSON handed back is
    shared: serialise it, never change it. A bad one raises and is never kept. Specs
    that are synced are built in worker threads, so what is kept changes under a lock.
    """

    def __init__(self, limit: int = 256) -> None:
        self._limit = limit
        self._by_id: dict[int, tuple[ContainerEdits, dict[str, Any], int]] = {}
        self._lock = threading.Lock()

    def __call__(self, edits: ContainerEdits) -> tuple[dict[str, Any], int]:
        key = id(edits)
        hit = self._by_id.get(key)
        if hit is not None and hit[0] is edits:
            return hit[1], hit[2]
        out, level = convert_edits(edits)
        with self._lock:
            kept = self._by_id
            while len(kept) >= self._limit:
                del kept[next(iter(kept))]
            kept[key] = (edits, out, level)
        return out, level


def build_spec(
    claim_uid: str,
    devices: Sequence[CdiDevice],
    *,
    kind: str = DEFAULT_KIND,
    common_edits: ContainerEdits | None = None,
    annotations: Mapping[str, str] | None = None,
    convert: Callable[[ContainerEdits], tuple[dict[str, Any], int]] = convert_edits,
) -> dict[str, Any]:
    """The CDI spec for one claim, ready to serialise.

    `common_edits` go in the top-level containerEdits, applied once whenever any
    device of the claim is used (control nodes, driver libraries); pass none when
    the devices reference the toolkit's spec, which brings its own. `convert` turns
    each edits into the spec's JSON (checked) and the version it needs, by default
    afresh each time (`ConvertedEdits` remembers them).
    """
    validate_claim_uid(claim_uid)
    _split_kind(kind)
    if not devices:
        raise CdiError(f"claim {claim_uid}: a CDI spec needs at least one device")
    spec_devices: list[dict[str, Any]] = []
    seen: set[str] = set()
    needed = 0
    for device in devices:
        name = cdi_device_name(claim_uid, device.name)
        if name in seen:
            raise CdiError(f"claim {claim_uid}: device {device.name!r} is listed twice")
        seen.add(name)
        edits, level = convert(device.edits)
        if not edits:
            edits = {"env": [f"{k}={v}" for k, v in _marker_env(device.name).items()]}
        needed = max(needed, level)
        item: dict[str, Any] = {"name": name}
        if device.annotations:
            item["annotations"] = _annotations(device.annotations, f"device {device.name}")
        item["containerEdits"] = edits
        spec_devices.append(item)
    spec: dict[str, Any] = {"cdiVersion": "", "kind": kind}
    if annotations:
        spec["annotations"] = _annotations(annotations, "spec")
    spec["devices"] = spec_devices
    if common_edits is not None and not common_edits.is_empty():
        spec["containerEdits"], level = convert(common_edits)
        needed = max(needed, level)
    spec["cdiVersion"] = _version(spec, needed)
    return spec


def find_driver_files(
    driver_root: Path = Path("/"), *, host_view: Path = Path("/")
) -> tuple[str, ...]:
    """The driver's libraries and utilities, as absolute paths inside `driver_root`.

    Versioned names and their soname links are both listed (each is mounted with the
    content of the file it resolves to, under its own name: `driver_common_edits`), so
    programs linked against either find them. Only names that resolve to a regular
    file inside the root count (`DriverRoot.resolve`). Nothing found (no driver
    installed) gives an empty tuple. They are looked for where this process sees the
    root (`host_view`, see `DriverRoot`).
    """
    root = DriverRoot(driver_root, host_view)
    found = [f"/{folder}/{name}" for folder, names in root.libraries().items() for name in names]
    found.extend(tool[0] for name in DRIVER_UTILITIES if (tool := root.tool(name)) is not None)
    return tuple(found)


def driver_common_edits(
    *,
    driver_root: Path = Path("/"),
    dev_root: Path = Path("/"),
    libraries: Sequence[str] = (),
    hooks: Sequence[Hook] = (),
    host_view: Path | None = Path("/"),
    device_numbers: DeviceNumbers | None = None,
) -> ContainerEdits:
    """Control device nodes and driver library mounts shared by all GPUs of a claim.

    `driver_root` is where the driver is installed on the host (`/`, or e.g.
    `/run/nvidia/driver` with a containerised driver) and `libraries` are paths
    inside it, mounted at the same path in the container. `dev_root` holds the
    `/dev` with the NVIDIA nodes. `host_view` is where this process sees the
    host's `/` (None: do not check); nodes and files missing there are left
    out, as `nvidia-uvm-tools` often is. Checked, a library is mounted from the
    file it resolves to inside the driver root (`DriverRoot.resolve`), not from
    its own path, which the runtime would resolve on the host: a link to an
    absolute path names the host's file there, not the root's (see
    `gpudra.driver.driverroot`); one that resolves to no regular file is left
    out. With libraries, `LD_LIBRARY_PATH` lists
    their folders, so the container's linker finds them even where the image's
    linker cache does not cover the host's library folder (a Debian image on a
    RHEL host); it replaces the image's value, so the CUDA images' folders are
    kept at its end. `device_numbers` (emulated GPUs) gives a node's numbers, so
    it is listed with them whether or not the host has it.
    """

    def present(host_path: PurePosixPath) -> bool:
        return host_view is None or (host_view / host_path.relative_to("/")).exists()

    nodes: list[DeviceNode] = []
    for path in CONTROL_DEVICE_NODES:
        host = PurePosixPath(dev_root) / path.lstrip("/")
        numbers = device_numbers(path) if device_numbers is not None else None
        if numbers is not None or present(host):
            nodes.append(numbered(path, None if str(host) == path else str(host), numbers))
    mounts: list[Mount] = []
    root = None if host_view is None else DriverRoot(driver_root, host_view)
    for library in libraries:
        lib = PurePosixPath(_absolute(library, "driver library"))
        if ".." in lib.parts:
            raise CdiError(f"driver library {library!r} must not contain '..'")
        source = str(lib) if root is None else root.resolve(str(lib))
        if source is None:
            where = PurePosixPath(driver_root) / str(lib).lstrip("/")
            log.warning(
                "driver library not found: no regular file there inside the driver root",
                extra={"fields": {"path": str(where)}},
            )
            continue
        host = PurePosixPath(driver_root) / source.lstrip("/")
        mounts.append(Mount(str(host), str(lib), LIBRARY_MOUNT_OPTIONS))
    folders = dict.fromkeys(
        str(PurePosixPath(m.container_path).parent)
        for m in mounts
        if ".so" in PurePosixPath(m.container_path).name
    )
    env = {"LD_LIBRARY_PATH": ":".join([*folders, *_LEGACY_LIBRARY_PATH])} if folders else {}
    return ContainerEdits(
        env=env, device_nodes=tuple(nodes), mounts=tuple(mounts), hooks=tuple(hooks)
    )


# --- files ------------------------------------------------------------------------------------


class CdiSpecStore:
    """Per-claim spec files in one CDI directory, all of one kind.

    File name `<vendor>-<class>_<claimUID>.json` (the CDI library's transient
    spec naming); only names matching it are listed or removed, so other
    vendors' specs in the same directory are never touched.
    """

    def __init__(
        self, root: Path = DEFAULT_CDI_ROOT, *, kind: str = DEFAULT_KIND, durable: bool = False
    ) -> None:
        # Specs are not fsynced by default: the default root (/var/run/cdi) is a tmpfs,
        # and after a reboot the kubelet prepares every claim again, writing them anew.
        # Atomic replacement is all the runtime needs; the checkpoint is what is durable.
        self._durable = durable
        self._vendor, self._class = _split_kind(kind)
        self._root = root
        self._root_str = str(root)
        self._kind = kind
        self._prefix = f"{self._vendor}-{self._class}_"
        # Edits met before (the node's common ones, each whole GPU's) converted once.
        self._converted = ConvertedEdits()

    @property
    def root(self) -> Path:
        return self._root

    @property
    def durable(self) -> bool:
        """Whether writes and removals fsync (then they belong in a worker thread)."""
        return self._durable

    @property
    def kind(self) -> str:
        return self._kind

    def spec_path(self, claim_uid: str) -> Path:
        return Path(self._spec_file(claim_uid))

    def _spec_file(self, claim_uid: str, prefix: str | None = None) -> str:
        """The spec's path as a string: on the prepare path, which writes and removes a
        spec per claim, Path arithmetic costs more than the system calls. `prefix`:
        another kind's `<vendor>-<class>_`, for `remove`."""
        name = f"{prefix or self._prefix}{validate_claim_uid(claim_uid)}.json"
        if os.sep in name:  # belt and braces: a UID has no separator
            raise CdiError(f"claim UID {claim_uid!r} would leave the CDI directory")
        return f"{self._root_str}/{name}"

    def qualified_id(self, name: str) -> str:
        return f"{self._kind}={_validate_device_name(name)}"  # the kind is checked already

    def device_ids(self, claim_uid: str, device: CdiDevice) -> list[str]:
        """CDI IDs for the kubelet: ours first, then the toolkit's for the same device."""
        return [self.qualified_id(cdi_device_name(claim_uid, device.name)), *device.toolkit_ids]

    def build(
        self,
        claim_uid: str,
        devices: Sequence[CdiDevice],
        *,
        common_edits: ContainerEdits | None = None,
        annotations: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """The claim's spec (`build_spec`). Its containerEdits, the top-level ones and
        each device's, are shared with the next spec built from the same edits objects
        (`ConvertedEdits`): serialise it, do not change it."""
        return build_spec(
            claim_uid,
            devices,
            kind=self._kind,
            common_edits=common_edits,
            annotations=annotations,
            convert=self._converted,
        )

    def write(self, claim_uid: str, spec: Mapping[str, Any]) -> None:
        """Write (or replace) the claim's spec atomically, at `spec_path` (not returned:
        a prepare has no use for a Path, and making one costs more than the write's
        system calls)."""
        if spec.get("kind") != self._kind:
            raise CdiError(f"spec kind {spec.get('kind')!r} is not this store's {self._kind!r}")
        path = self._spec_file(claim_uid)
        # Compact: written and parsed by machines on every prepare (jq reads it too).
        data = jsonbytes.dumps(spec) + b"\n"
        # The folder is created on first use (and again if someone removed it).
        atomic_write(path, data, mode=0o644, durable=self._durable, folder_mode=0o755)

    def write_claim(
        self,
        claim_uid: str,
        devices: Sequence[CdiDevice],
        *,
        common_edits: ContainerEdits | None = None,
        annotations: Mapping[str, str] | None = None,
    ) -> None:
        spec = self.build(claim_uid, devices, common_edits=common_edits, annotations=annotations)
        self.write(claim_uid, spec)

    def remove(self, claim_uid: str, *, device_ids: Iterable[str] = ()) -> bool:
        """Delete the claim's spec; False when there was none (unprepare is idempotent).

        `device_ids`, the CDI IDs handed to the kubelet for the claim, name the kinds it
        was written under: the spec of another claim kind among them is deleted too. A
        release whose kind did not follow its driver name wrote it, and a claim prepared
        then is unprepared by this one.
        """
        paths = [self._spec_file(claim_uid)]
        for kind in sorted({i.partition("=")[0] for i in device_ids} - {self._kind}):
            with contextlib.suppress(CdiError):
                vendor, cdi_class = _split_kind(kind)
                if cdi_class == self._class:  # not the toolkit's `nvidia.com/gpu`
                    paths.append(self._spec_file(claim_uid, f"{vendor}-{cdi_class}_"))
        removed = False
        for path in paths:
            try:
                os.unlink(path)  # noqa: PTH108 - see _spec_file
            except FileNotFoundError:
                continue
            removed = True
        if removed and self._durable:
            fsync_dir(self._root)
        return removed

    def list_claim_uids(self) -> list[str]:
        """UIDs of claims that have a spec written by this store (for leftover cleanup)."""
        if not self._root.is_dir():
            return []
        uids = []
        for path in self._root.iterdir():
            name = path.name
            if not (name.startswith(self._prefix) and name.endswith(".json")):
                continue
            uid = name[len(self._prefix) : -len(".json")]
            if _UID_RE.fullmatch(uid) and path.is_file():
                uids.append(uid)
        return sorted(uids)

    def remove_temp_files(self) -> int:
        """Delete temp files a crash left mid-write; returns how many."""
        if not self._root.is_dir():
            return 0
        removed = 0
        for path in self._root.glob(f".{self._prefix}*.tmp"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += 1
        return removed


# --- the container toolkit's spec ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolkitSpec:
    """Device names defined by the NVIDIA container toolkit's CDI spec."""

    path: Path
    kind: str
    device_names: frozenset[str]

    def device_ids(self, uuid: str, *, index: str | None = None) -> list[str]:
        """The toolkit's ID for a GPU or MIG device, by UUID, else by index name.

        Index names ("0", or "0:1" for MIG) are only used when the caller gives
        one, because NVML and the spec generator may number devices differently.
        Empty when the spec does not have the device (e.g. a MIG device created
        after the spec was generated): write device nodes instead.
        """
        if uuid in self.device_names:
            return [f"{self.kind}={uuid}"]
        if index is not None and index in self.device_names:
            return [f"{self.kind}={index}"]
        return []


def _load_spec_file(path: Path) -> Any:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        return json.loads(text)
    # PyYAML comes with kubernetes-asyncio; imported lazily, as only this path needs it.
    yaml = importlib.import_module("yaml")
    return yaml.safe_load(text)


def find_toolkit_spec(paths: Sequence[Path] = DEFAULT_TOOLKIT_SPEC_PATHS) -> ToolkitSpec | None:
    """The first readable toolkit spec of kind `nvidia.com/gpu`, or None.

    A broken or foreign file is skipped with a warning: falling back to our own
    device nodes beats failing every prepare.
    """
    for path in paths:
        try:
            doc = _load_spec_file(path)
        except FileNotFoundError:
            continue
        except Exception as exc:  # any parse error means "not usable", never fatal
            log.warning(
                "ignoring unreadable CDI spec",
                extra={"fields": {"path": str(path), "error": str(exc)}},
            )
            continue
        if not isinstance(doc, dict) or doc.get("kind") != TOOLKIT_KIND:
            continue
        devices = doc.get("devices")
        names = frozenset(
            str(d["name"])
            for d in (devices if isinstance(devices, list) else [])
            if isinstance(d, dict) and d.get("name") is not None
        )
        if names:
            return ToolkitSpec(path=path, kind=TOOLKIT_KIND, device_names=names)
    return None


def toolkit_device_ids(
    uuid: str,
    *,
    index: str | None = None,
    paths: Sequence[Path] = DEFAULT_TOOLKIT_SPEC_PATHS,
) -> list[str]:
    """The toolkit's CDI IDs for a GPU/MIG UUID; empty when no toolkit spec has it."""
    spec = find_toolkit_spec(paths)
    return [] if spec is None else spec.device_ids(uuid, index=index)
