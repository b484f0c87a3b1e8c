"""Owner references of the objects the webhook reads: who controls a claim.

A ResourceClaim's controlling owner says who made it and whose it is: the pod the
resourceclaim controller made it for, the pod the scheduler made it for (extended
resources), or a PodGroup. Kubernetes lets an object have at most one controller.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["api_group", "controller_of"]


def controller_of(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """`obj`'s controlling owner reference (``controller: true``), or None."""
    metadata = obj.get("metadata")
    owners = metadata.get("ownerReferences") if isinstance(metadata, Mapping) else None
    for owner in owners if isinstance(owners, list) else ():
        if isinstance(owner, Mapping) and owner.get("controller") is True:
            return owner
    return None


def api_group(reference: Mapping[str, Any]) -> str:
    """The API group of an owner reference's ``apiVersion`` ("" for the core group)."""
    version = reference.get("apiVersion")
    return version.rpartition("/")[0] if isinstance(version, str) else ""
