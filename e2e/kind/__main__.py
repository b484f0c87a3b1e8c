"""`python -m e2e.kind up|down`: the kind cluster with the chart, for `make e2e-kind`;
`heartbeat` is the fake nodes' kubelet stand-in that `up` starts."""

from __future__ import annotations

import sys
from pathlib import Path

from e2e.cluster.harness import beat_forever, node_names
from e2e.kind.cluster import KindCluster, KindError


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "heartbeat":
        beat_forever(KindCluster(root=Path(argv[1])).kube(), node_names())
        return 0
    if argv not in (["up"], ["down"]):
        print("usage: python -m e2e.kind up|down", file=sys.stderr)
        return 2
    cluster = KindCluster()
    try:
        cluster.up() if argv == ["up"] else cluster.down()
    except KindError as e:
        print(f"e2e-kind: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
