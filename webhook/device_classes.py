"""The DeviceClasses' configs, mirrored from the API server for claim validation, and
their stored extendedResourceName, which decides whether a native resource's pods are
left to the scheduler (`Admission`).

A claim's devices are prepared with their DeviceClass's opaque configs first (the
allocation copies them), so validation must see them to resolve a claim's sharing mode
as the node will: a claim on `gpu-shared.nvidia.com` is time-sliced (or MPS) by its
class's config, not by anything in the claim. DeviceClasses are few and change rarely,
so one list/watch keeps them in memory and a decision never waits on the API server.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

import anyio
import anyio.abc
from gpudra.common.backoff import Backoff
from gpudra.common.kube import Kube
from gpudra.common.watch import EventType, Reflector
from gpudra.webhook.validate import ClassConfigs, class_configs

__all__ = ["DEVICE_CLASSES_PATH", "DeviceClassCache"]

DEVICE_CLASSES_PATH: Final = "/apis/resource.k8s.io/v1/deviceclasses"


class DeviceClassCache:
    """DeviceClass name -> its configs for `driver`; `run` keeps it current."""

    def __init__(self, driver: str) -> None:
        self._driver = driver
        self._configs: dict[str, ClassConfigs] = {}
        self._listed = False

    @property
    def ready(self) -> bool:
        """Listed at least once: until then a claim's class configs are unknown."""
        return self._listed

    @property
    def configs(self) -> Mapping[str, ClassConfigs]:
        return self._configs

    def replace(self, items: Iterable[Mapping[str, Any]]) -> None:
        # In place: the admission holds this mapping (`configs`), not the cache.
        listed = {name: configs for name, configs in map(self._parse, items) if name}
        self._configs.clear()
        self._configs.update(listed)
        self._listed = True

    def event(self, event_type: EventType, obj: Mapping[str, Any]) -> None:
        name, configs = self._parse(obj)
        if not name:
            return
        if event_type == "DELETED":
            self._configs.pop(name, None)
        else:
            self._configs[name] = configs

    def _parse(self, obj: Mapping[str, Any]) -> tuple[str, ClassConfigs]:
        metadata = obj.get("metadata")
        name = metadata.get("name") if isinstance(metadata, Mapping) else None
        return (name if isinstance(name, str) else ""), class_configs(obj, self._driver)

    async def run(
        self, kube: Kube, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """List, then watch, DeviceClasses until cancelled; started after the first list."""
        reflector = Reflector(
            kube,
            DEVICE_CLASSES_PATH,
            on_list=self.replace,
            on_event=self.event,
            backoff=Backoff(max_s=30.0),
            fields={"kind": "deviceclasses"},
        )
        await reflector.run(task_status=task_status)
