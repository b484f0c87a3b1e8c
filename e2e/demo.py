"""`make demo`: bring-up already done by the Makefile; run the sample scenarios and
print pod -> claim -> device."""

from __future__ import annotations

import sys

from e2e import smoke
from e2e.cluster.harness import Cluster, ClusterError


def main() -> int:
    try:
        kube = Cluster().kube()
    except ClusterError as e:
        print(f"demo: {e}", file=sys.stderr)
        return 1
    print("== smoke: the real scheduler allocates a ResourceClaim from a template")
    res = smoke.run(kube, node="worker-1", log=lambda m: print(f"  {m}"))
    rows = [
        ("POD", "NODE", "CLAIM (owner)", "DRIVER/POOL/DEVICE"),
        (
            f"{res.namespace}/{res.pod}",
            res.node,
            f"{res.claim} ({res.claim_owner})",
            f"{smoke.DRIVER}/{res.pool}/{res.device}",
        ),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    smoke.teardown(kube, res)
    print("  deleted the pod: the controller-manager deleted its claim")
    print(
        "\nThe cluster stays up: `make cluster-env` prints how to reach it, "
        "`make cluster-down` stops it."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
