"""`gpudra node --kubelet-root`: a root under which the plugin's sockets could not be
served, or whose DRA socket the kubelet could not dial, is refused before anything
starts, naming the flag, the socket and why."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpudra.cli.main import build_parser
from gpudra.cli.node import _plugin_config

NODE = ["node", "--node-name", "n1"]


@pytest.mark.parametrize("root", ["/var/lib/kubelet", "/var/lib/kubelet/", "//var/lib/kubelet"])
def test_a_plain_kubelet_root_reaches_the_plugin_config(root: str) -> None:
    """A leading `//` is the same folder on Linux; the plugin advertises it with one
    slash (`tests/driver/test_plugin.py`)."""
    args = build_parser().parse_args([*NODE, "--kubelet-root", root])
    assert _plugin_config(args).kubelet_root == Path(root)


@pytest.mark.parametrize(
    ("root", "why"),
    [
        ("/var/lib/kube%2elet", "the endpoint the kubelet dials, holds '%'"),
        ("/var/lib/kubelet#1", "the endpoint the kubelet dials, holds '#'"),
        ("/" + "k" * 80, "needs 1"),
    ],
)
def test_a_kubelet_root_the_plugin_could_not_serve_under_names_the_flag_and_why(
    root: str, why: str
) -> None:
    args = build_parser().parse_args([*NODE, "--kubelet-root", root])
    with pytest.raises(SystemExit) as exc:
        _plugin_config(args)
    message = str(exc.value.code)
    assert message.startswith(f"gpudra node: --kubelet-root {root!r}: the "), message
    assert why in message
    assert "give the kubelet's root folder (its --root-dir) as a plain absolute path" in message


def test_a_long_driver_name_counts_too() -> None:
    """The sockets' names carry the driver name: a root that fits with the default
    may not fit with a long one, and the message says which socket."""
    root = "/" + "k" * 50
    args = build_parser().parse_args([*NODE, "--kubelet-root", root])
    assert _plugin_config(args).kubelet_root == Path(root)
    long_name = "gpu." + "x" * 24 + ".example.com"  # a valid driver name of 40 characters
    args = build_parser().parse_args([*NODE, "--kubelet-root", root, "--driver-name", long_name])
    with pytest.raises(SystemExit, match=r"the registration socket .* over 107, the unix socket"):
        _plugin_config(args)
