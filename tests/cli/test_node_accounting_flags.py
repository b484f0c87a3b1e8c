"""`gpudra node --accounting-zero-window`: how long a new accounting counter is served
at zero to every scrape; a bad value names the flag and what to give."""

from __future__ import annotations

import pytest
from gpudra.cli.main import build_parser
from gpudra.cli.node import _plugin_config
from gpudra.driver.accounting import DEFAULT_ZERO_WINDOW_S

NODE = ["node", "--node-name", "n1"]


def test_the_zero_window_reaches_the_plugin_config() -> None:
    parser = build_parser()
    assert _plugin_config(parser.parse_args(NODE)).zero_window_s == DEFAULT_ZERO_WINDOW_S
    assert DEFAULT_ZERO_WINDOW_S >= 2 * 60  # two scrapes at Prometheus's default 1m
    for raw, seconds in (("300", 300.0), ("0", 0.0), ("90.5", 90.5)):
        args = parser.parse_args([*NODE, "--accounting-zero-window", raw])
        assert _plugin_config(args).zero_window_s == seconds


@pytest.mark.parametrize("raw", ["-1", "2m", "nan", "inf", ""])
def test_a_bad_zero_window_names_the_flag_and_the_fix(
    raw: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*NODE, f"--accounting-zero-window={raw}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --accounting-zero-window: {raw!r}: give seconds, 0 or more" in err
    assert "longest scrape interval" in err
