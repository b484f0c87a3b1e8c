"""What others wrote reaches the admin's terminal as text: label values an agent
endpoint serves, the reason phrase of its answer, claim configs a tenant wrote and
pod names in a file are shown with visible escapes, never as control sequences or as
table rows of their own; JSON output is left to the encoder, which escapes them."""

from __future__ import annotations

import json
import unicodedata
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import yaml
from gpudra.cli.devices import Device, Holder, render
from gpudra.cli.main import main
from gpudra.cli.terminal import printable

from tests.cli.stubs import gpudra, http_server, send, serving

ESC = "\x1b"
HIDDEN = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"}
CLIPBOARD = "H100\x1b]52;c;ZWNobyBwd25lZA==\x07\x1b[2K"  # OSC 52: writes the clipboard
# An agent's answer: a model that writes the clipboard, a namespace whose newline
# forges a report row, one that hides the text after it.
HOSTILE = (
    "# TYPE gpudra_gpu_utilization_percent gauge\n"
    'gpudra_gpu_utilization_percent{device="gpu-0",uuid="GPU-1",gpu_uuid="GPU-1",mig_uuid="",'
    f'model="{CLIPBOARD}",utilization_scope="device",namespace="team-b\\u202e",pod="p",'
    'container="",claim="c",request="r",tenant="",sharing="Exclusive"} 3\n'
    "# TYPE gpudra_allocated_device_seconds counter\n"
    'gpudra_allocated_device_seconds_total{namespace="team-b\\n'
    'team-a            999.00           999.00      0.00",tenant="",'
    'device_class="",sharing="Exclusive"} 36\n'
    f'gpudra_allocated_device_seconds_total{{namespace="x{ESC}[8m",tenant="",device_class="",'
    'sharing="Exclusive"} 36\n'
).encode()


def shown(text: str) -> bool:
    """Whether every character of `text` but the line breaks shows as itself."""
    return all(unicodedata.category(c) not in HIDDEN for c in text.replace("\n", ""))


@pytest.mark.parametrize(
    ("char", "escape"),
    [
        ("\x1b", "\\x1b"),  # ESC
        ("\x07", "\\x07"),  # BEL
        ("\r", "\\x0d"),
        ("\n", "\\x0a"),
        ("\t", "\\x09"),
        ("\x7f", "\\x7f"),  # DEL
        ("\x9b", "\\x9b"),  # C1 CSI
        ("\x85", "\\x85"),  # C1 next line
        ("\u2028", "\\u2028"),  # line separator
        ("\u2029", "\\u2029"),  # paragraph separator
        ("\u202e", "\\u202e"),  # right-to-left override
        ("\u200b", "\\u200b"),  # zero width space
        ("\udcff", "\\udcff"),  # an undecodable byte, as surrogateescape keeps it
        ("\ue000", "\\ue000"),  # private use
        ("\U000e0041", "\\U000e0041"),  # tag character
        ("\u0378", "\\u0378"),  # unassigned
    ],
)
def test_every_character_a_terminal_acts_on_is_a_visible_escape(char: str, escape: str) -> None:
    assert printable(f"a{char}b") == f"a{escape}b"


def test_text_that_shows_as_itself_is_left_as_it_is() -> None:
    for text in ("team-a/trainer", "NVIDIA H100 80GB HBM3", "équipe-ü 名前", "a\\x1b", ""):
        assert printable(text) == text
    assert printable("one\ntwo\r", newlines=True) == "one\ntwo\\x0d"


def test_top_shows_an_agents_label_values_as_text() -> None:
    with http_server(serving(HOSTILE)) as port:
        url = f"node-a=http://127.0.0.1:{port}/metrics"
        done = gpudra("top", "--no-api", "--metrics", url)
        as_json = gpudra("top", "--no-api", "--metrics", url, "-o", "json")

    assert done.returncode == 0, done.stderr
    assert shown(done.stdout), repr(done.stdout)
    assert "H100\\x1b]52;c;ZWNobyBwd25lZA==\\x07\\x1b[2K" in done.stdout
    assert "held by team-b\\u202e/p" in done.stdout
    [row] = json.loads(as_json.stdout)  # JSON keeps the value, escaped by the encoder
    assert row["model"] == CLIPBOARD


def test_report_shows_one_row_per_namespace_whatever_its_name_holds() -> None:
    with http_server(serving(HOSTILE)) as port:
        done = gpudra("report", "--metrics", f"node-a=http://127.0.0.1:{port}/metrics")

    assert done.returncode == 0, done.stderr
    assert shown(done.stdout), repr(done.stdout)
    lines = done.stdout.splitlines()
    assert len(lines) == 4  # the span, the header, two namespaces
    assert not any(line.startswith("team-a") for line in lines), lines
    assert any(line.startswith("team-b\\x0ateam-a") for line in lines), lines
    assert any(line.startswith("x\\x1b[8m") for line in lines), lines


def test_a_reason_phrase_reaches_the_warning_as_text() -> None:
    def status(h: BaseHTTPRequestHandler) -> None:
        h.wfile.write(b"HTTP/1.0 500 \x1b]0;owned\x07\x1b[2J\r\nContent-Length: 0\r\n\r\n")

    with http_server(status) as port:
        done = gpudra("top", "--no-api", "--metrics", f"node-a=http://127.0.0.1:{port}/metrics")

    assert done.returncode == 1
    assert shown(done.stderr), repr(done.stderr)
    assert done.stderr.count("\n") == 1


def test_an_error_that_quotes_prometheus_ends_the_command_as_text() -> None:
    body = json.dumps({"status": "error", "error": "bad query\x1b]0;owned\x07\nforged line"})

    with http_server(lambda h: send(h, body.encode(), "application/json")) as port:
        done = gpudra("report", "--prometheus", f"http://127.0.0.1:{port}")

    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert line.startswith("gpudra report: http://127.0.0.1:")
    assert line.endswith("bad query\\x1b]0;owned\\x07\\x0aforged line")


def test_devices_shows_a_tenants_sharing_strategy_as_text() -> None:
    tenant = Holder(claim="team-a/c", pods=("p",), sharing="TimeSlicing\x1b[2J\nnode-x  gpu-9")
    found = [Device("n1", "n1", "gpu-0", "gpu", model="H100\x1b]0;x\x07", holders=[tenant])]

    text = render(found)

    assert shown(text), repr(text)
    assert "TimeSlicing\\x1b[2J\\x0anode-x  gpu-9" in text
    assert not any(line.startswith("node-x") for line in text.splitlines())


def test_migrate_shows_pod_names_from_a_file_as_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.yaml").write_text(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 4\n"
    )
    pod = {
        "metadata": {"name": "trainer\x1b]0;owned\x07", "namespace": "ml\u202e"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": 2}}}]},
    }
    (tmp_path / "pods.yaml").write_text(yaml.safe_dump({"kind": "List", "items": [pod]}))

    args = ["migrate", f"--config={tmp_path}/config.yaml", f"--pods={tmp_path}/pods.yaml"]
    assert main(args) == 0

    out = capsys.readouterr().out
    assert shown(out), repr(out)
    assert "#   ml\\u202e/trainer\\x1b]0;owned\\x07: asks for 2 shared GPUs" in out
