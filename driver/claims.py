"""The claim reference the kubelet sends, shared by the protocol and device layers.

One type, so the order (namespace, uid, name) cannot differ between the gRPC layer
and the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A ResourceClaim as the kubelet names it: its owner must fetch and check it."""

    namespace: str
    uid: str
    name: str
