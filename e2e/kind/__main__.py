"""`python -m e2e.kind up|down`: the kind cluster with the chart, for `make e2e-kind`."""

from __future__ import annotations

import sys

from e2e.kind.cluster import KindCluster, KindError


def main(argv: list[str]) -> int:
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
