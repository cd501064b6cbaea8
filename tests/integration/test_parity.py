"""Every data-parallel layout reproduces the 1-process loss curve (fp32, CPU/gloo, ≤1e-5 relative)."""

from __future__ import annotations

import pytest

from tests.integration.flavors import COMMON, FLAVORS, REFERENCE, STEPS
from tests.integration.launch import run_train

pytestmark = pytest.mark.slow
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory, tt_cache_dir):
    out = tmp_path_factory.mktemp(REFERENCE.name)
    result = run_train(REFERENCE.nproc, [*COMMON, *REFERENCE.overrides], out, tt_cache_dir)
    assert result.returncode == 0, result.output[-4000:]
    losses = result.losses()
    assert len(losses) == STEPS
    return losses


def test_reference_learns(reference_losses):
    # a parity test against a run that does not train would prove nothing
    assert reference_losses[-1] < reference_losses[0] - 0.5, reference_losses


@pytest.mark.parametrize("flavor", FLAVORS, ids=lambda f: f.name)
def test_layout_matches_single_process(flavor, reference_losses, tmp_path, tt_cache_dir):
    result = run_train(flavor.nproc, [*COMMON, *flavor.overrides], tmp_path, tt_cache_dir)
    assert result.returncode == 0, result.output[-4000:]
    losses = result.losses()
    assert len(losses) == STEPS, result.output[-2000:]
    for step, (got, ref) in enumerate(zip(losses, reference_losses), start=1):
        assert abs(got - ref) <= REL_TOL * abs(ref), (
            f"{flavor.name} step {step}: loss {got!r} vs 1-process {ref!r} "
            f"(rel diff {abs(got - ref) / abs(ref):.2e})"
        )
