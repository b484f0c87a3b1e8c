"""An endpoint `gpudra top` and `gpudra report` read is not trusted to behave: the
deadline is for the whole answer, the answer is read up to a cap, a redirect is not
followed, and an answer that is not UTF-8, not Prometheus text or not finite where a
number is needed costs that node one warning line, while the other nodes' rows still
print and the exit status is 1."""

from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler

import pytest
from gpudra.cli.scrape import MAX_BODY, Unanswered, get, metric_samples

from tests.cli.stubs import gpudra, http_server, send, serving


def trickle(h: BaseHTTPRequestHandler) -> None:
    """Ten seconds of a byte every 0.1 s: each read is quick, the answer is not."""
    h.send_response(200)
    h.end_headers()
    try:
        for _ in range(100):
            h.wfile.write(b"#")
            h.wfile.flush()
            time.sleep(0.1)
    except OSError:
        pass  # the client gave up


def endless(h: BaseHTTPRequestHandler) -> None:
    """An answer with no length that does not end."""
    h.send_response(200)
    h.end_headers()
    try:
        while True:
            h.wfile.write(b"#" * 2**16)
    except OSError:
        pass


def test_the_timeout_is_for_the_whole_answer() -> None:
    with (
        http_server(trickle) as port,
        pytest.raises(Unanswered, match=r"did not answer within 1 s \(give a longer"),
    ):
        get(f"http://127.0.0.1:{port}/metrics", 1)


def test_a_trickling_agent_costs_top_one_line() -> None:
    with http_server(trickle) as port:
        done = gpudra(
            "top", "--no-api", "--timeout", "1", "--metrics", f"node-a=http://127.0.0.1:{port}/m"
        )
    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert "node node-a: http://127.0.0.1:" in line
    assert "did not answer within 1 s" in line


def test_an_answer_is_read_up_to_the_cap() -> None:
    def announced(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(MAX_BODY + 1))
        h.end_headers()

    with (
        http_server(announced) as port,
        pytest.raises(Unanswered, match="answered more than 16 MiB"),
    ):
        get(f"http://127.0.0.1:{port}/metrics", 10)
    with http_server(endless) as port:
        with pytest.raises(Unanswered, match="answered more than 16 MiB"):
            get(f"http://127.0.0.1:{port}/metrics", 10)
        with pytest.raises(Unanswered, match="answered more than 1024 bytes"):
            get(f"http://127.0.0.1:{port}/metrics", 10, limit=1024)
    with http_server(serving(b"#" * 1024)) as port:
        assert get(f"http://127.0.0.1:{port}/metrics", 10, limit=1024) == "#" * 1024


def test_a_redirect_is_not_followed() -> None:
    asked: list[str] = []

    def elsewhere(h: BaseHTTPRequestHandler) -> None:
        asked.append(h.path)
        send(h, b"")

    with http_server(elsewhere) as other:
        target = f"http://127.0.0.1:{other}/latest/meta-data/iam"

        def redirect(h: BaseHTTPRequestHandler) -> None:
            h.send_response(302)
            h.send_header("Location", target)
            h.send_header("Content-Length", "0")
            h.end_headers()

        with http_server(redirect) as port:
            with pytest.raises(Unanswered, match="HTTP 302 Found, a redirect to") as caught:
                get(f"http://127.0.0.1:{port}/metrics", 10)
            done = gpudra("top", "--no-api", "--metrics", f"node-a=http://127.0.0.1:{port}/m")

    assert asked == []
    assert target in str(caught.value)
    assert "not followed" in str(caught.value)
    assert done.returncode == 1
    assert "HTTP 302" in done.stderr


def test_samples_are_prometheus_text_with_finite_values() -> None:
    text = (
        "# TYPE gpudra_device_idle_seconds gauge\n"
        'gpudra_device_idle_seconds{device="gpu-0",uuid="GPU-x"} 12\n'
        "# TYPE other gauge\nother NaN\n"
    )
    [sample] = metric_samples("U", text, lambda name: name.startswith("gpudra_"))
    assert sample.value == 12  # a series not read may hold anything
    for bad, why in [
        ("<html>gateway</html>\n", "U answered what is not Prometheus text: invalid metric name"),
        ("gpudra_x +Inf\n", "U answered gpudra_x inf, where a finite number belongs"),
        ("gpudra_x NaN\n", "U answered gpudra_x nan, where a finite number belongs"),
        ("gpudra_x -1e999\n", "U answered gpudra_x -inf, where a finite number belongs"),
    ]:
        with pytest.raises(Unanswered) as caught:
            metric_samples("U", bad, lambda name: name.startswith("gpudra_"))
        assert str(caught.value).startswith(why)


def test_a_long_complaint_is_cut_short() -> None:
    with pytest.raises(Unanswered) as caught:
        metric_samples("U", "<" + "x" * 100_000 + "\n", lambda _name: True)
    assert len(str(caught.value)) < 300


BAD_ANSWERS = {
    "not-utf8": b"\xff\xfe not utf-8\n",
    "not-metrics": b"<html>gateway</html>\n",
    "infinite-idle": b"# TYPE gpudra_device_idle_seconds gauge\n"
    b'gpudra_device_idle_seconds{device="gpu-0",uuid="GPU-x"} +Inf\n',
    "nan-utilization": b"# TYPE gpudra_gpu_utilization_percent gauge\n"
    b'gpudra_gpu_utilization_percent{device="gpu-0",uuid="GPU-x",utilization_scope="device"}'
    b" NaN\n",
}


@pytest.mark.parametrize("body", BAD_ANSWERS.values(), ids=BAD_ANSWERS.keys())
def test_top_shows_the_other_nodes_when_one_answers_badly(endpoint: str, body: bytes) -> None:
    with http_server(serving(body)) as bad:
        done = gpudra(
            "top", "--no-api", "-o", "json",
            "--metrics", endpoint, "--metrics", f"node-b=http://127.0.0.1:{bad}/metrics",
        )  # fmt: skip

    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert line.startswith("gpudra top: node node-b: http://127.0.0.1:")
    assert "its devices show no measurements" in line
    assert {r["node"] for r in json.loads(done.stdout)} == {"node-a"}


def test_report_leaves_out_an_agent_whose_counter_is_not_finite(endpoint: str) -> None:
    body = (
        b"# TYPE gpudra_allocated_device_seconds counter\n"
        b'gpudra_allocated_device_seconds_total{namespace="team-b",tenant=""} +Inf\n'
    )
    with http_server(serving(body)) as bad:
        done = gpudra(
            "report", "-o", "json",
            "--metrics", endpoint, "--metrics", f"node-b=http://127.0.0.1:{bad}/metrics",
        )  # fmt: skip

    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert line.startswith("gpudra report: node node-b: ")
    assert "gpudra_allocated_device_seconds_total inf, where a finite number belongs" in line
    assert [u["namespace"] for u in json.loads(done.stdout)["usage"]] == ["team-a"]


@pytest.mark.parametrize(
    ("command", "raw"),
    [("top", "0"), ("top", "-1"), ("top", "inf"), ("top", "nan"), ("report", "0")],
)
def test_a_timeout_that_would_be_no_deadline_names_the_flag(command: str, raw: str) -> None:
    done = gpudra(command, "--metrics", "node-a=http://127.0.0.1:9/metrics", "--timeout", raw)
    assert done.returncode == 2
    assert f"argument --timeout: '{raw}': give seconds, more than 0" in done.stderr
