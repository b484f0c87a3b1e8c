"""`gpudra node --conflict-wait`: how long a prepare waits for the claim that holds its
device; a bad value names the flag, the bounds and why."""

from __future__ import annotations

import pytest
from gpudra.cli.main import build_parser
from gpudra.cli.node import _plugin_config
from gpudra.driver.prepare import CONFLICT_WAIT_S

NODE = ["node", "--node-name", "n1"]


def test_the_conflict_wait_reaches_the_plugin_config() -> None:
    parser = build_parser()
    assert _plugin_config(parser.parse_args(NODE)).conflict_wait_s == CONFLICT_WAIT_S == 10.0
    for raw, seconds in (("0", 0.0), ("2.5", 2.5), ("30", 30.0)):
        args = parser.parse_args([*NODE, "--conflict-wait", raw])
        assert _plugin_config(args).conflict_wait_s == seconds


@pytest.mark.parametrize("raw", ["-1", "30.5", "45", "10s", "nan", "inf", ""])
def test_a_bad_conflict_wait_names_the_flag_the_bounds_and_why(
    raw: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*NODE, f"--conflict-wait={raw}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --conflict-wait: {raw!r}: give seconds, 0 to 30 (0: fail at once)" in err
    assert "the kubelet gives a prepare 45 s in all" in err
