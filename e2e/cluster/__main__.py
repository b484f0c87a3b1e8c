"""`python -m e2e.cluster up|down|env|status|heartbeat` (used by the Makefile)."""

from __future__ import annotations

import json
import sys

from e2e.cluster.harness import Cluster, ClusterError, default_layout, run_heartbeat


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "status"
    cluster = Cluster()
    try:
        if cmd == "up":
            cluster.up()
        elif cmd == "down":
            cluster.down()
        elif cmd == "env":
            sys.stdout.write(cluster.env())
        elif cmd == "status":
            print(json.dumps(cluster.status(), indent=2))
        elif cmd == "heartbeat":
            run_heartbeat(default_layout())
        else:
            print(f"unknown command {cmd!r}: use up, down, env or status", file=sys.stderr)
            return 2
    except ClusterError as e:
        print(f"cluster-{cmd}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
