"""Print, for every layout of the parity suite, its largest relative difference from its reference per quantity,
beside the noise floor (the 1-process run with its batch summed in another order) and the tolerances.

    python -m tests.integration.noise_floor        # about 2 minutes on 2 CPU cores

docs/testing.md records the output the tolerances in tests/integration/parity.py were derived from.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tests.integration.conftest import train_layout
from tests.integration.layouts import ALL_LAYOUTS, REFERENCES, dp
from tests.integration.parity import TOLERANCE, max_relative_differences
from tests.integration.pool import Pools


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="noise_floor_"))
    env = {"TORCHTITAN_CACHE_DIR": str(tmp / "cache"), "TORCHINDUCTOR_CACHE_DIR": str(tmp / "cache" / "inductor"),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    os.environ.update(env)
    pools = Pools(tmp / "logs", env)
    try:
        refs = {name: train_layout(pools, 1, ref.overrides, tmp / name) for name, ref in REFERENCES.items()}
        rows = [("reordered 1-process (noise floor)", max_relative_differences(
            train_layout(pools, 1, dp(2, 1), tmp / "reordered"), refs["single_process"]))]
        for layout in ALL_LAYOUTS:
            run = train_layout(pools, layout.nproc, layout.overrides, tmp / layout.name)
            worst = max_relative_differences(run, refs[layout.reference])
            rows.append((f"{layout.name} ({layout.nproc} ranks)", worst))
    finally:
        pools.close()
    keys = list(TOLERANCE)
    print(f"| layout | {' | '.join(keys)} |\n|---|{'---|' * len(keys)}")
    for name, worst in rows:
        print(f"| {name} | " + " | ".join(f"{worst[k]:.1e}" for k in keys) + " |")
    print("| tolerance | " + " | ".join(f"{TOLERANCE[k]:.0e}" for k in keys) + " |")


if __name__ == "__main__":
    main()
