"""recover() on generated checkpoints: it never raises for a file it can read; a record
it cannot undo is that record's error in the report, and the file stays loadable."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from gpudra.driver.cdi import CdiSpecStore
from gpudra.driver.checkpoint import CheckpointError, load
from gpudra.driver.devices import discover
from gpudra.driver.nvml import NvmlEmulator
from gpudra.driver.nvml.standin import FAKEBIN, TOOLS_LOG_ENV
from gpudra.driver.prepare import ClaimPreparer, RecoveryReport
from gpudra.driver.sharing import NvidiaSharing
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.strategies import JSON, mutated

FIXTURE = Path(__file__).parent.parent / "driver" / "fixtures" / "checkpoint-v1.json"
SEED: dict[str, Any] = json.loads(FIXTURE.read_text())
BOOT = SEED["bootId"]
OTHER_BOOT = "0c5e6b4e-5d6a-4c1e-9a53-000000000000"
_PATH_KEYS = ("pipeDir", "logDir")


@pytest.fixture(scope="module", autouse=True)
def _tools_log(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The stand-in nvidia-smi and MPS control record their calls here."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TOOLS_LOG_ENV, str(tmp_path_factory.mktemp("tools") / "calls.log"))
        yield


def _confined(doc: Any, root: Path) -> Any:
    """`doc` with every MPS folder moved under `root`: undo removes those folders, and
    a generated path must never name one of this machine's."""
    if isinstance(doc, list):
        return [_confined(v, root) for v in doc]
    if not isinstance(doc, dict):
        return doc
    out = {}
    for key, value in doc.items():
        if key in _PATH_KEYS and isinstance(value, str) and value:
            parts = [re.sub(r"[^A-Za-z0-9-]", "_", p) for p in value.split("/") if p][-2:]
            out[key] = str(root.joinpath(*parts)) if parts else ""
        else:
            out[key] = _confined(value, root)
    return out


def _preparer(case: Path, emu: NvmlEmulator) -> ClaimPreparer:
    for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
        (case / "host" / "dev").mkdir(parents=True, exist_ok=True)
        (case / "host" / "dev" / name).touch()
    (case / "proc").mkdir(exist_ok=True)
    return ClaimPreparer(
        node_name="worker-1",
        nvml=emu,
        inventory=lambda: discover(emu),
        cdi=CdiSpecStore(case / "cdi"),
        checkpoint_path=case / "plugin" / "checkpoint.json",
        sharing=NvidiaSharing(
            nvidia_smi=FAKEBIN / "nvidia-smi",
            mps_control=FAKEBIN / "nvidia-cuda-mps-control",
            ready_timeout_s=2.0,
        ),
        dev_root=case / "host",
        proc_root=case / "proc",
        boot_id_path=case / "boot_id",
    )


def _usable(doc: Any) -> bool:
    """What `Checkpoint.load` reads at all: a JSON object whose claims are an object."""
    return isinstance(doc, dict) and isinstance(doc.get("claims") or {}, dict)


MUTATED = mutated(SEED, max_mutations=4) | mutated(SEED, values=JSON, max_mutations=2)
ONE_CLAIM = st.sampled_from(sorted(SEED["claims"])).flatmap(
    lambda uid: mutated(SEED["claims"][uid], max_mutations=3).map(
        lambda claim: {**SEED, "claims": {**SEED["claims"], uid: claim}}
    )
)


@given(ONE_CLAIM | MUTATED, st.booleans(), st.booleans())
def test_recover_never_raises_and_reports_bad_records(
    state_root: Path, doc: Any, rebooted: bool, mig_mode: bool
) -> None:
    case = state_root / uuid.uuid4().hex
    (case / "plugin").mkdir(parents=True)
    (case / "boot_id").write_text((OTHER_BOOT if rebooted else BOOT) + "\n")
    doc = _confined(doc, case / "mps")
    path = case / "plugin" / "checkpoint.json"
    path.write_text(json.dumps(doc))
    emu = NvmlEmulator.from_builtin("h100-80gb-hbm3-x8")
    if mig_mode:
        emu.nvmlInit()
        emu.nvmlDeviceSetMigMode(emu.nvmlDeviceGetHandleByIndex(0), 1)
        emu.reset_gpu(0)
        emu.nvmlShutdown()
    preparer = _preparer(case, emu)

    try:
        report = anyio.run(preparer.recover)
    except CheckpointError:
        # Documented: a file that is not a checkpoint at all stops the start, because
        # starting empty would forget devices still in use.
        assert not _usable(doc)
        return
    assert _usable(doc)
    assert isinstance(report, RecoveryReport)
    assert all(isinstance(e, str) and e for e in report.errors)
    # Whatever recovery did, it left a file the next start reads.
    after = load(path, boot_id_path=case / "boot_id")
    left = {c.uid for c in after.claims()}
    assert not left & set(report.rolled_back)
