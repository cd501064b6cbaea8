"""Every data-parallel layout reproduces the 1-process loss curve (fp32, CPU/gloo, ≤1e-5 relative)."""

from __future__ import annotations

import pytest

from tests.integration.flavors import COMMON, FLAVORS, REFERENCES, STEPS
from tests.integration.launch import run_train

pytestmark = pytest.mark.slow
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory, tt_cache_dir):
    """1-process loss curves, run once per module and only when a test asks for them."""
    cache: dict[str, list[float]] = {}

    def get(name: str) -> list[float]:
        if name not in cache:
            ref = REFERENCES[name]
            result = run_train(ref.nproc, [*COMMON, *ref.overrides], tmp_path_factory.mktemp(name), tt_cache_dir)
            assert result.returncode == 0, result.output[-4000:]
            cache[name] = result.metrics()
            assert len(cache[name]) == STEPS
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(REFERENCES))
def test_reference_learns(name, reference_runs):
    # a parity test against a run that does not train would prove nothing
    losses = [m["loss"] for m in reference_runs(name)]
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("flavor", FLAVORS, ids=lambda f: f.name)
def test_layout_matches_single_process(flavor, reference_runs, tmp_path, tt_cache_dir):
    reference = reference_runs(flavor.reference)
    result = run_train(flavor.nproc, [*COMMON, *flavor.overrides], tmp_path, tt_cache_dir)
    assert result.returncode == 0, result.output[-4000:]
    records = result.metrics()
    assert len(records) == STEPS, result.output[-2000:]
    compared = 0
    for got, ref in zip(records, reference, strict=True):
        for key in ("loss", "val_loss"):
            if key not in ref:
                continue
            compared += key == "val_loss"
            assert abs(got[key] - ref[key]) <= REL_TOL * abs(ref[key]), (
                f"{flavor.name} step {ref['step']}: {key} {got[key]!r} vs 1-process {ref[key]!r} "
                f"(rel diff {abs(got[key] - ref[key]) / abs(ref[key]):.2e})"
            )
    assert compared == 2, "validation should have run at steps 5 and 10"
