"""`python -m e2e.kueue up|down|status` (used by the Makefile): Kueue's manager against
the local control plane, which must be up first."""

from __future__ import annotations

import json
import sys

from e2e.cluster.harness import Cluster, ClusterError
from e2e.kueue.manager import KueueError, KueueManager


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "status"
    kueue = KueueManager(Cluster())
    try:
        if cmd == "up":
            kueue.up()
        elif cmd == "down":
            kueue.down()
        elif cmd == "status":
            print(json.dumps(kueue.status(), indent=2))
        else:
            print(f"unknown command {cmd!r}: use up, down or status", file=sys.stderr)
            return 2
    except (KueueError, ClusterError) as e:
        print(f"kueue-{cmd}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
