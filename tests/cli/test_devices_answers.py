"""`gpudra devices` over answers the API server really sends: another driver's claim
whose opaque parameters hold what the API server keeps unchecked (an unpaired
surrogate escape, invalid UTF-8, deep nesting) leaves the cluster's devices readable,
and an answer even Go could not read fails as one line naming the request."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path

from gpudra.api import jsonbytes

from tests.cli.stubs import gpudra, kube_api, send
from tests.cli.test_devices import DRIVER, claim, slices


def other_drivers_claim(parameters: bytes) -> bytes:
    """A claim for another driver's class with `parameters` as its raw opaque
    parameters, as the API server serves them back."""
    return (
        b'{"metadata":{"namespace":"team-b","name":"odd"},"spec":{"devices":{"requests":'
        b'[{"name":"r","exactly":{"deviceClassName":"other.example.com"}}],"config":'
        b'[{"opaque":{"driver":"other.example.com","parameters":' + parameters + b"}}]}}}"
    )


@contextmanager
def cluster(claims: list[bytes], folder: Path) -> Iterator[Path]:
    """An API server listing one node's slices and `claims` (raw); its kubeconfig."""
    published = jsonbytes.dumps(
        {"items": slices("emulated:h100-80gb-hbm3-x8", driver=DRIVER), "metadata": {}}
    )
    listed = b'{"kind":"ResourceClaimList","metadata":{},"items":[' + b",".join(claims) + b"]}"

    def answer(h: BaseHTTPRequestHandler) -> None:
        path = h.path.split("?")[0]
        send(h, listed if path.endswith("/resourceclaims") else published, "application/json")

    with kube_api(answer, folder) as kubeconfig:
        yield kubeconfig


def test_another_drivers_claim_with_what_go_reads_leaves_the_devices_listed(
    tmp_path: Path,
) -> None:
    depth = 5000  # as deep as 10 KiB of parameters nest; orjson stops at 1024
    claims = [
        jsonbytes.dumps(claim("held", ("gpu-2", {}))),
        other_drivers_claim(b'{"x":"\\ud800"}'),
        other_drivers_claim(b'{"x":"a\xffb"}'),
        other_drivers_claim(b'{"x":' + b"[" * depth + b"]" * depth + b"}"),
    ]
    with cluster(claims, tmp_path) as kubeconfig:
        done = gpudra("devices", "--kubeconfig", str(kubeconfig))
    assert done.returncode == 0, done.stderr
    held = [line for line in done.stdout.splitlines() if " gpu-2 " in f" {line} "]
    assert held and held[0].endswith("team-a/held (pod pod-held, Exclusive)")


def test_an_answer_go_cannot_read_either_fails_as_one_line_naming_the_request(
    tmp_path: Path,
) -> None:
    too_deep = jsonbytes.GO_MAX_DEPTH  # the list's own two levels take it past Go's limit
    claims = [other_drivers_claim(b'{"x":' + b"[" * too_deep + b"]" * too_deep + b"}")]
    with cluster(claims, tmp_path) as kubeconfig:
        done = gpudra("devices", "--kubeconfig", str(kubeconfig))
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(
        "gpudra devices: reading the cluster failed: GET /apis/resource.k8s.io/v1/resourceclaims:"
        " HTTP 200: the answer is not JSON that Go's decoder reads either: exceeded max depth:"
        f" nesting deeper than {jsonbytes.GO_MAX_DEPTH} levels, the most Go's encoding/json"
        " reads: line 1 column "
    )
