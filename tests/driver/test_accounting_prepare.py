"""The preparer tells accounting when each claim starts and stops holding its devices,
so a claim is billed for the time it held them, not whole sampling intervals."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from gpudra.driver.accounting import Accounting
from gpudra.driver.cdi import CdiSpecStore
from gpudra.driver.checkpoint import ClaimRecord
from gpudra.driver.devices import discover
from gpudra.driver.prepare import ClaimPreparer
from gpudra.driver.sampling import Sampler

from tests.driver.test_device_metrics import Clock
from tests.driver.test_prepare import (
    NODE,
    Node,
    _fixture_claim,
    fake_sharing,
    h100_mig,
    node,  # noqa: F401  (the fixture)
)

pytestmark = pytest.mark.anyio


async def test_the_preparer_tells_accounting_when_a_claim_held_its_gpu(
    node: Node,  # noqa: F811  (test_prepare's fixture: this test's node folders)
) -> None:
    """Through the preparer: a whole GPU prepared 5 s after a sample and unprepared
    20 s later is billed 20 GPU-seconds at the next sample; prepared again 10 s into
    the next interval, 20 more at the end of it."""
    nvml = h100_mig()
    inventory = discover(nvml)
    clock = Clock()
    accounting = Accounting()
    preparer: ClaimPreparer | None = None

    def claims() -> Sequence[ClaimRecord]:
        cp = preparer.checkpoint_now() if preparer is not None else None
        return cp.claims() if cp is not None else ()

    sampler = Sampler(
        nvml,
        pool=NODE,
        inventory=lambda: inventory,
        prepared=claims,
        on_sample=(accounting.observe,),
        clock=clock,
        interval_s=30,
    )
    preparer = ClaimPreparer(
        node_name=NODE,
        nvml=nvml,
        inventory=inventory,
        cdi=CdiSpecStore(node.cdi_dir),
        checkpoint_path=node.checkpoint,
        sharing=fake_sharing(),
        dev_root=node.dev_root,
        proc_root=node.proc,
        boot_id_path=node.boot_id,
        holdings=sampler.holdings,
    )
    whole = _fixture_claim(0)  # gpu-1, a whole GPU
    await sampler.sample_once()
    clock.now += 5
    assert (await preparer.prepare([whole]))[whole.uid].error is None
    clock.now += 20
    assert await preparer.unprepare([whole.ref]) == {whole.uid: None}
    clock.now += 5
    await sampler.sample_once()
    assert {(k.namespace, k.sharing): v for k, v in accounting.allocated().items()} == {
        ("team-a", "Exclusive"): pytest.approx(20)
    }
    clock.now += 10  # prepared again, held on past the sample: billed from its prepare
    assert (await preparer.prepare([whole]))[whole.uid].error is None
    clock.now += 20
    await sampler.sample_once()
    assert list(accounting.allocated().values()) == [pytest.approx(40)]
