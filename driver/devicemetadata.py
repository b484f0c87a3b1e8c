"""Device metadata for containers: what devices a claim's request got, as a file the
container reads at a well-known path (Kubernetes' DRA device metadata, KEP-5304).

The upstream kubelet plugin helper (`k8s.io/dynamic-resource-allocation/kubeletplugin`,
`EnableDeviceMetadata`) writes one file per request of a prepared claim and a CDI mount
that puts it, read-only, at

    /var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/<request>/<driver>-metadata.json

for a claim the pod names, or under `resourceclaimtemplates/<pod claim name>/...` for a
claim made from a template, whose own name is generated: the pod claim name is the
claim's `resource.kubernetes.io/pod-claim-name` annotation. A program in the container
reads it with upstream's `devicemetadata` package, or as plain JSON. The file is a JSON
stream of one `DeviceMetadata` object per API version, newest first
(`metadata.resource.k8s.io/v1beta1`, then `v1alpha1`, the only one Kubernetes 1.36's
reader knows), so a reader of either release finds one it decodes.

Each device lists the attributes its ResourceSlice publishes (`publish.attribute`, the
one serializer of attribute values), as upstream's helper advises: the GPU's UUID,
product, PCI bus ID, MIG profile and so on, so a workload learns which GPU it got
without NVML.

Where gpudra differs from the helper, and why:
- The host files live under the agent's state folder, named by claim UID and request
  (`<state dir>/device-metadata/<uid>.<request>.json`), not in folders per claim name:
  a claim deleted and created again under its name while the old one is still
  prepared then never shares, or removes, the other's files. They sit side by side in
  one folder, with no folder per claim or request as the helper makes: on ext4 a
  folder made and removed per claim cost a prepare and unprepare about ten times what
  its file does (the removal most), on the event loop.
- The mount is a device of the claim's own CDI spec (`metadata_<request>`), written in
  the same atomic replace as its GPUs, so a claim has one spec to write and remove.

Everything that goes into a path is checked first: the pod claim name annotation is
the tenant's to write on a claim it makes itself, so it must be a DNS label (as the
pod's `resourceClaims[].name` it stands for is) or the prepare fails naming it.

Pure data in, files out: nothing here knows about Kubernetes' API or gRPC.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from gpudra.api import jsonbytes
from gpudra.api.names import (
    POD_CLAIM_NAME_ANNOTATION,
    base_request,
    dns_label_problem,
    dns_subdomain_problem,
)
from gpudra.common.files import atomic_write, remove_tree
from gpudra.driver.cdi import CdiDevice, CdiError, ContainerEdits, Mount, validate_claim_uid

__all__ = [
    "API_VERSIONS",
    "CONTAINER_DIR",
    "DEVICE_PREFIX",
    "DeviceMetadataStore",
    "MetadataDevice",
    "MetadataError",
    "MetadataRequest",
    "container_path",
    "metadata_stream",
    "mounted",
]

CONTAINER_DIR: Final = "/var/run/kubernetes.io/dra-device-attributes"
_CLAIMS_SUBDIR: Final = "resourceclaims"
_TEMPLATES_SUBDIR: Final = "resourceclaimtemplates"
_FILE_SUFFIX: Final = "-metadata.json"
_HOST_SUFFIX: Final = ".json"
API_GROUP: Final = "metadata.resource.k8s.io"
# Newest first: a reader takes the first object whose version it knows.
API_VERSIONS: Final = (f"{API_GROUP}/v1beta1", f"{API_GROUP}/v1alpha1")
# CDI device names of the mounts, `<claim uid>-metadata_<request>`: a request name is a
# DNS label and a GPU's device name one too, so the '_' keeps the two apart.
DEVICE_PREFIX: Final = "metadata_"
# What the upstream helper mounts the file with.
_MOUNT_OPTIONS: Final = ("ro", "bind")


class MetadataError(ValueError):
    """A name that cannot go into a metadata path; the message names it and the fix."""


@dataclass(frozen=True, slots=True)
class MetadataDevice:
    """One allocated device as the metadata lists it; `attributes` are already in the
    API's JSON form (`{"string": ...}`, `{"int": ...}`, ...)."""

    pool: str
    name: str
    attributes: Mapping[str, Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class MetadataRequest:
    """One request's devices. `name` is the allocation's request, with its subrequest
    where the claim had `firstAvailable` (`gpu/large`); its file goes under the base
    request's name (`gpu`), as the pod's containers name it."""

    name: str
    devices: tuple[MetadataDevice, ...]

    @property
    def base(self) -> str:
        return base_request(self.name)


def _check_label(what: str, value: str, fix: str) -> str:
    problem = dns_label_problem(value)
    if problem is not None:
        raise MetadataError(f"{what} {value!r} {problem}; {fix}")
    return value


def container_path(driver: str, claim_name: str, pod_claim_name: str | None, request: str) -> str:
    """Where a container finds the metadata of `request` (a base request name)
    (upstream's `metadata.ResourceClaimFilePath` and `ResourceClaimTemplateFilePath`)."""
    problem = dns_subdomain_problem(claim_name)
    if problem is not None:  # the API server allows no other claim name
        raise MetadataError(f"claim name {claim_name!r} {problem}")
    _check_label("request name", request, "the API server allows no other")
    if pod_claim_name:
        _check_label(
            f"annotation {POD_CLAIM_NAME_ANNOTATION}",
            pod_claim_name,
            "it names the pod's spec.resourceClaims[].name, which is one: remove or fix "
            "the annotation on the claim",
        )
        folder = f"{CONTAINER_DIR}/{_TEMPLATES_SUBDIR}/{pod_claim_name}"
    else:
        folder = f"{CONTAINER_DIR}/{_CLAIMS_SUBDIR}/{claim_name}"
    return f"{folder}/{request}/{driver}{_FILE_SUFFIX}"


def metadata_stream(
    *,
    driver: str,
    namespace: str,
    claim_name: str,
    claim_uid: str,
    pod_claim_name: str | None,
    request: MetadataRequest,
) -> bytes:
    """The file's content: the same `DeviceMetadata` once per version of
    `API_VERSIONS`, each followed by a newline, as the helper's encoder writes it
    (compact, where the helper indents: JSON readers take either)."""
    body: dict[str, Any] = {
        "metadata": {
            "name": claim_name,
            "namespace": namespace,
            "uid": claim_uid,
            # Written once per prepare; the helper counts rewrites from 1.
            "generation": 1,
        },
    }
    if pod_claim_name:
        body["podClaimName"] = pod_claim_name
    body["requests"] = [
        {
            "name": request.name,
            "devices": [
                {
                    "driver": driver,
                    "pool": d.pool,
                    "name": d.name,
                    **({"attributes": dict(d.attributes)} if d.attributes else {}),
                }
                for d in request.devices
            ],
        }
    ]
    return b"".join(
        jsonbytes.dumps({"kind": "DeviceMetadata", "apiVersion": version, **body}) + b"\n"
        for version in API_VERSIONS
    )


class DeviceMetadataStore:
    """The metadata files of prepared claims, `<claim uid>.<request>.json` under `root`,
    and the CDI devices that mount them."""

    def __init__(self, root: Path, *, driver: str | None) -> None:
        # `root` must be a host path this process sees at the same path: the container
        # runtime mounts the files from there (as the MPS folders beside it).
        self._root = root
        self._driver = driver

    @property
    def root(self) -> Path:
        return self._root

    @property
    def writes(self) -> bool:
        """Whether prepares write metadata (a driver name was given); without, the store
        still removes and sweeps the files an earlier run wrote."""
        return self._driver is not None

    def host_path(self, claim_uid: str, request: str) -> str:
        """The host file of a claim's base request. A checked UID and a name without '/'
        keep it a file of `root`, whatever a record says."""
        if "/" in request or request.startswith("."):
            raise MetadataError(f"request name {request!r} cannot name a file")
        return f"{self._root}/{validate_claim_uid(claim_uid)}.{request}{_HOST_SUFFIX}"

    def check(self, claim_name: str, pod_claim_name: str | None, requests: Iterable[str]) -> None:
        """Raise MetadataError where a file of the claim could not go where Kubernetes
        says (`container_path`): before a prepare changes anything. `requests` are the
        allocation's request names, subrequests and all."""
        for request in {base_request(r) for r in requests}:
            container_path(self._driver or "", claim_name, pod_claim_name, request)

    def write(
        self,
        *,
        namespace: str,
        claim_name: str,
        claim_uid: str,
        pod_claim_name: str | None,
        requests: Sequence[MetadataRequest],
    ) -> dict[str, CdiDevice]:
        """Write each request's file (replacing what a rolled-back try left) and return
        the CDI device that mounts it, by base request name. Every path is checked
        before the first file is written."""
        driver = self._driver
        if driver is None:
            raise MetadataError("this agent writes no device metadata")
        planned = [
            (
                request,
                container_path(driver, claim_name, pod_claim_name, request.base),
                self.host_path(claim_uid, request.base),
            )
            for request in requests
        ]
        out: dict[str, CdiDevice] = {}
        for request, inside, host in planned:
            data = metadata_stream(
                driver=driver,
                namespace=namespace,
                claim_name=claim_name,
                claim_uid=claim_uid,
                pod_claim_name=pod_claim_name,
                request=request,
            )
            # Not synced: after a reboot the kubelet prepares the claim again. The
            # folder is made by the first write only.
            atomic_write(host, data, mode=0o644, durable=False, folder_mode=0o755)
            out[request.base] = CdiDevice(
                name=f"{DEVICE_PREFIX}{request.base}",
                edits=ContainerEdits(mounts=(Mount(host, inside, _MOUNT_OPTIONS),)),
            )
        return out

    def remove(self, claim_uid: str, requests: Iterable[str]) -> None:
        """Remove the files of the claim's `requests` (base request names, as its
        checkpoint record keeps them); a file that is not there is nothing to do. One
        unlink per request, cheap enough for the event loop. What a crash left beside
        them (a temp file) goes with the start-up sweep (`remove_claim`)."""
        for request in set(requests):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.host_path(claim_uid, request))  # noqa: PTH108 - plain strings

    def remove_claim(self, claim_uid: str) -> None:
        """Remove everything of the claim here, whatever its requests: its files, the
        temp files a crash left, and a folder named for it (`remove_tree`)."""
        validate_claim_uid(claim_uid)
        try:
            with os.scandir(self._root) as entries:
                found = [e for e in entries if _claim_of(e.name) == claim_uid]
        except FileNotFoundError:
            return
        for entry in found:
            if entry.is_dir(follow_symlinks=False):
                remove_tree(Path(entry.path))
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)  # noqa: PTH108

    def claim_uids(self) -> list[str]:
        """The claims that have anything here (for the start-up sweep); a name that
        holds no claim UID is not the store's and is left alone."""
        if not self._root.is_dir():
            return []
        uids: set[str] = set()
        with os.scandir(self._root) as entries:
            for entry in entries:
                try:
                    uids.add(validate_claim_uid(_claim_of(entry.name)))
                except CdiError:
                    continue
        return sorted(uids)


def _claim_of(name: str) -> str:
    """The claim a name in the store's folder belongs to, by its UID: a file
    `<uid>.<request>.json`, the temp file `.<uid>.<request>.json.<random>.tmp` of one
    (`atomic_write`), or a folder `<uid>`. Not checked: a name that holds no UID is
    not the store's."""
    return name.removeprefix(".").split(".", 1)[0]


_MOUNT_MARK: Final = f"-{DEVICE_PREFIX}"


def mounted(device_ids: Iterable[str]) -> bool:
    """Whether a claim's recorded CDI IDs name a metadata mount: then its unprepare
    removes the files, whether or not the agent still writes them. No other ID holds
    the mark: a claim kind's driver name and a toolkit ID have no '_'."""
    return any(_MOUNT_MARK in i for i in device_ids)
