"""`python -m e2e.node up [--gpus]|down|status [NAME]` (used by the Makefile): a real
kubelet + containerd node next to the local control plane, which must be up first. With
`--gpus`, gpudra's node agent (emulated GPUs) and webhook run for it as host processes.
NAME defaults to `real-1`; the control plane's `down` runs `down NAME` for each node."""

from __future__ import annotations

import json
import sys

from e2e.cluster.harness import Cluster, ClusterError
from e2e.node.gpus import GpuStack
from e2e.node.realnode import DEFAULT_NODE, NodeError, RealNode


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "status"
    names = [a for a in argv[1:] if not a.startswith("--")]
    node = RealNode(Cluster(), names[0] if names else DEFAULT_NODE)
    try:
        if cmd == "up":
            node.up()
            if "--gpus" in argv[1:]:
                GpuStack(node).up()
        elif cmd == "down":
            node.down()
        elif cmd == "status":
            print(json.dumps(node.status(), indent=2))
        else:
            print(f"unknown command {cmd!r}: use up, down or status", file=sys.stderr)
            return 2
    except (NodeError, ClusterError) as e:
        print(f"node-{cmd}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
