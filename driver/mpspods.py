"""MPS control daemons in pods of their own: `sharing.DaemonPods` over the API server.

A daemon the agent starts itself is a process in the agent's container, and the
runtime stops every process of a container with it: replacing the agent pod (an
upgrade, a changed value, an eviction) would end the daemon of every MPS and
memory-slice claim while their pods keep running, their CUDA clients cut off. So, as
the upstream NVIDIA driver does, each claim's daemon runs in a pod of its own, bound
to this node by `spec.nodeName` (no scheduling: it must run here, and the kubelet
admits it even while the node's GPUs are all allocated). A bare pod, not a
Deployment: only the agent may start the daemon again, because only the agent sends
the claim's defaults after each start and records which pod is the claim's.

The pod is the chart's template (image, pull secrets, security context, tolerations,
what every daemon needs of the node: the driver root, or the stand-in one of emulated
GPUs, where the agent sees it), completed here with the name, the node, the command,
the environment and the claim's own folders: its pipe and log folders, each mounted
at the path the agent sees it at (so the paths in the environment mean the same in
both), and its /dev/shm. Nothing else of the agent's state folder: the claim's
containers talk to the daemon, which so reaches neither the checkpoint nor another
claim's folders. A template that still mounts the whole state folder (rendered by an
older chart) works as before, the claim's folders mounted again beneath it, and
shows the daemon what it did before. `DaemonPods` calls block: they are made from the
worker threads the sharing backend runs in, and go back to the event loop for the API
calls.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.from_thread
from gpudra.common.kube import ApiError, Kube
from gpudra.driver.sharing import DaemonPod, SharingError

__all__ = ["CLAIM_LABEL", "MpsDaemonPods", "PodTemplateError", "load_template"]

log = logging.getLogger(__name__)

# The claim a daemon pod serves (its UID), for `kubectl get pods -l`.
CLAIM_LABEL: Final = "gpudra.nvidia.com/mps-claim"
# The volumes added for a claim: its /dev/shm, and its folders (a number appended).
_SHM_VOLUME: Final = "claim-shm"
_FOLDER_VOLUME: Final = "claim-folder-"
# Waiting container reasons that do not pass on their own, or not soon.
_STUCK: Final = frozenset(
    {
        "CreateContainerConfigError",
        "CreateContainerError",
        "ErrImageNeverPull",
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "RunContainerError",
        "CrashLoopBackOff",
    }
)


class PodTemplateError(ValueError):
    """The daemon pod template cannot be used; the message names the field."""


def load_template(path: Path) -> dict[str, Any]:
    """The daemon pod template (JSON, as the chart renders it), checked for what this
    module fills in: a Pod with `metadata.name` (the prefix of every daemon pod's
    name) and one container."""
    try:
        template = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PodTemplateError(f"{path}: cannot read a JSON Pod: {exc}") from None
    if not isinstance(template, dict) or template.get("kind") != "Pod":
        raise PodTemplateError(f"{path}: must be a JSON object with kind: Pod")
    meta, spec = template.get("metadata"), template.get("spec")
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str) or not meta["name"]:
        raise PodTemplateError(f"{path}: metadata.name (the daemon pods' name prefix) is missing")
    containers = spec.get("containers") if isinstance(spec, dict) else None
    if not isinstance(spec, dict) or not isinstance(containers, list) or len(containers) != 1:
        raise PodTemplateError(f"{path}: spec.containers must hold exactly one container")
    if not isinstance(containers[0], dict) or not containers[0].get("image"):
        raise PodTemplateError(f"{path}: spec.containers[0].image is missing")
    for volume in spec.get("volumes") or []:
        name = volume.get("name", "") if isinstance(volume, dict) else ""
        if name == _SHM_VOLUME or str(name).startswith(_FOLDER_VOLUME):
            # Refused here, once, rather than by the API server at every MPS claim.
            raise PodTemplateError(
                f"{path}: volume {name!r}: {_SHM_VOLUME} and {_FOLDER_VOLUME}* are the names "
                "of the volumes added for each claim"
            )
    return template


class MpsDaemonPods:
    """`DaemonPods` for one node: pods named `<template name>-<daemon name>` in
    `namespace`, bound to `node_name`."""

    def __init__(
        self,
        kube: Kube,
        *,
        namespace: str,
        node_name: str,
        template: Mapping[str, Any],
        leftover_wait_s: float = 30.0,
    ) -> None:
        self._kube = kube
        self._namespace = namespace
        self._node = node_name
        self._template = template
        # How long a leftover pod under a daemon's name gets to end before it is
        # deleted at once.
        self._leftover_wait_s = leftover_wait_s

    def name(self, daemon: str) -> str:
        return f"{self._template['metadata']['name']}-{daemon}"

    def _path(self, name: str = "") -> str:
        base = f"/api/v1/namespaces/{self._namespace}/pods"
        return f"{base}/{name}" if name else base

    def manifest(
        self,
        daemon: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        shm_dir: Path | None,
        *,
        folders: Sequence[Path] = (),
    ) -> dict[str, Any]:
        """The pod for daemon `daemon`: the template completed, each of `folders`
        mounted at its own path (the agent's, which the chart mounts at the host's)."""
        pod: dict[str, Any] = copy.deepcopy(dict(self._template))
        meta = pod["metadata"]
        meta["name"] = self.name(daemon)
        meta["namespace"] = self._namespace
        meta["labels"] = {**(meta.get("labels") or {}), CLAIM_LABEL: daemon}
        spec = pod["spec"]
        spec["nodeName"] = self._node
        spec["restartPolicy"] = "Never"
        container = spec["containers"][0]
        container["command"] = list(argv)
        container.pop("args", None)
        given = [e for e in container.get("env") or [] if e.get("name") not in env]
        container["env"] = given + [{"name": k, "value": v} for k, v in sorted(env.items())]
        # (volume name, host folder, path in the pod); each folder exists: the agent
        # made it before asking for the pod, and a pod is no place to make it.
        mounts = [
            (f"{_FOLDER_VOLUME}{i}", str(folder), str(folder))
            for i, folder in enumerate(dict.fromkeys(folders), start=1)
        ]
        if shm_dir is not None:
            mounts.append((_SHM_VOLUME, str(shm_dir), "/dev/shm"))
        spec["volumes"] = [
            *(spec.get("volumes") or []),
            *({"name": n, "hostPath": {"path": h, "type": "Directory"}} for n, h, _ in mounts),
        ]
        container["volumeMounts"] = [
            *(container.get("volumeMounts") or []),
            *({"name": n, "mountPath": p} for n, _, p in mounts),
        ]
        return pod

    # --- DaemonPods, called from worker threads ---

    def run(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        shm_dir: Path | None,
        *,
        folders: Sequence[Path],
    ) -> DaemonPod:
        return anyio.from_thread.run(
            self._run, name, self.manifest(name, argv, env, shm_dir, folders=folders)
        )

    def problem(self, pod: DaemonPod) -> str | None:
        return anyio.from_thread.run(self._problem, pod)

    def remove(self, name: str, uid: str | None, timeout_s: float) -> None:
        anyio.from_thread.run(self._remove, name, uid, timeout_s)

    # --- the API calls ---

    async def _run(self, name: str, body: Mapping[str, Any]) -> DaemonPod:
        try:
            created = await self._create(body)
        except ApiError as exc:
            if exc.status != 409:
                raise
            # Left by an attempt that crashed before recording it: nothing uses it yet.
            await self._remove(name, None, self._leftover_wait_s)
            created = await self._create(body)
        meta = created["metadata"]
        log.info(
            "MPS daemon pod created",
            extra={"fields": {"pod": meta["name"], "uid": meta["uid"], "node": self._node}},
        )
        return DaemonPod(meta["name"], meta["uid"])

    async def _create(self, body: Mapping[str, Any]) -> dict[str, Any]:
        try:
            created: dict[str, Any] = await self._kube.request("POST", self._path(), body)
        except ApiError as exc:
            if exc.status == 409:
                raise
            raise SharingError(
                f"creating MPS daemon pod {body['metadata']['name']} in namespace "
                f"{self._namespace}: {exc}"
            ) from None
        return created

    async def _problem(self, pod: DaemonPod) -> str | None:
        try:
            found = await self._kube.request("GET", self._path(pod.name))
        except ApiError as exc:
            if exc.status == 404:
                return "is gone"
            return f"cannot be read: {exc}"
        return describe_problem(found, pod.uid)

    async def _remove(self, name: str, uid: str | None, timeout_s: float) -> None:
        pod = self.name(name)
        body: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        for force in (False, True):
            if force:
                body["gracePeriodSeconds"] = 0
            try:
                await self._kube.request("DELETE", self._path(pod), body)
            except ApiError as exc:
                if exc.status == 404:
                    return
                if exc.status == 409:  # another pod under that name: not ours to delete
                    return
                raise SharingError(f"deleting MPS daemon pod {pod}: {exc}") from None
            if await self._gone(pod, uid, timeout_s):
                log.info("MPS daemon pod deleted", extra={"fields": {"pod": pod}})
                return
        raise SharingError(
            f"MPS daemon pod {pod} in namespace {self._namespace} is still there after a "
            f"forced delete; check the kubelet on node {self._node}"
        )

    async def _gone(self, pod: str, uid: str | None, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                found = await self._kube.request("GET", self._path(pod))
            except ApiError as exc:
                if exc.status == 404:
                    return True
                raise SharingError(f"reading MPS daemon pod {pod}: {exc}") from None
            if uid is not None and found["metadata"].get("uid") != uid:
                return True
            if time.monotonic() >= deadline:
                return False
            await anyio.sleep(0.2)


def describe_problem(pod: Mapping[str, Any], uid: str) -> str | None:
    """Why `pod` (as read) is not, or no longer, the daemon's running pod `uid`."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("uid") != uid:
        return "was replaced by another pod of the same name"
    if meta.get("deletionTimestamp"):
        return "is being deleted"
    phase = status.get("phase")
    for container in status.get("containerStatuses") or []:
        state = container.get("state") or {}
        waiting, ended = state.get("waiting") or {}, state.get("terminated") or {}
        if waiting.get("reason") in _STUCK:
            return f"cannot start its container: {waiting['reason']}: {waiting.get('message', '')}"
        if ended:
            return (
                f"ended ({ended.get('reason', 'terminated')}, exit code "
                f"{ended.get('exitCode')}); see its log"
            )
    if phase in ("Succeeded", "Failed"):
        return f"ended ({phase}: {status.get('reason', '')} {status.get('message', '')})".strip()
    return None
