"""Liveness for the kubelet plugin: one real call to each of its gRPC services.

GetInfo on the registration socket and an empty NodePrepareResources on the DRA socket
prove that both servers accept connections and answer, which a process check cannot.
Only grpc is needed: empty protobuf messages serialize to no bytes.
Usage: probe.py <kubelet root> <driver name> [<pod uid>]; exit 0 when both answer.
The pod UID defaults to $POD_UID: the kubelet does not expand `$(VAR)` in an exec
probe's command, but runs it with the container's environment.
"""

import hashlib
import os
import sys
from pathlib import Path

import grpc

# Each socket's call, in each API version the plugin may serve: the plugin serves the
# versions its `--dra-api` names (v1 and v1beta1 by default), so a method it does not
# serve (UNIMPLEMENTED) is asked in the next version.
CALLS = (
    ("plugins_registry/{driver}{suffix}-reg.sock", ("/pluginregistration.Registration/GetInfo",)),
    (
        "plugins/{driver}/dra{suffix}.sock",
        (
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
            "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources",
        ),
    ),
)


def socket_path(root: Path, pattern: str, driver: str, pod_uid: str) -> Path:
    """The per-pod socket (rolling updates) when it exists, else the plain one. The
    plugin names it after the pod UID, or after 12 hex digits of the UID's SHA-256
    where the full UID would not fit the unix socket path limit."""
    if pod_uid:
        digest = hashlib.sha256(pod_uid.encode()).hexdigest()[:12]
        for suffix in (f"-{pod_uid}", f"-{digest}"):
            path = root / pattern.format(driver=driver, suffix=suffix)
            if path.exists():
                return path
    return root / pattern.format(driver=driver, suffix="")


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print("usage: probe.py <kubelet root> <driver name> [<pod uid>]", file=sys.stderr)
        return 2
    root, driver = Path(argv[0]), argv[1]
    pod_uid = argv[2] if len(argv) == 3 else os.environ.get("POD_UID", "")
    for pattern, methods in CALLS:
        path = socket_path(root, pattern, driver, pod_uid)
        if not answers(path, methods):
            return 1
    return 0


def answers(path: Path, methods: tuple[str, ...]) -> bool:
    """Whether the server on `path` answers the first of `methods` it serves."""
    with grpc.insecure_channel(f"unix://{path}") as channel:
        for method in methods:
            call = channel.unary_unary(
                method,
                request_serializer=lambda _: b"",
                response_deserializer=lambda data: data,
            )
            try:
                call(None, timeout=5)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED and method != methods[-1]:
                    continue
                print(f"{method} on {path} failed: {e.code().name} {e.details()}", file=sys.stderr)
                return False
            return True
    return False


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
