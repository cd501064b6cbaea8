"""Print, for every layout of the parity suite, its largest relative difference from its reference per quantity,
beside the noise floor (each 1-process reference with its batch summed in another order) and the tolerances; and,
per tensor, the largest difference of its gradient norm, of its values and of its optimizer moments over all layouts
beside its own floor.

    python -m tests.integration.noise_floor                 # about 3 minutes on 2 CPU cores
    python -m tests.integration.noise_floor -k moe --json differences.json
    python -m tests.integration.noise_floor -k float8 --write   # rewrites the tolerances of the references measured
    python -m tests.integration.noise_floor -k single_process_lora --write   # one reference and all its layouts

docs/testing.md records the output the tolerances in tests/integration/parity.py were derived from.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path

from tests.integration.conftest import train_parity
from tests.integration.layouts import ALL_LAYOUTS, REFERENCES, dp
from tests.integration.parity import (
    FLOAT8_TENSOR_CEILING,
    MOMENTS,
    REFERENCE_TOLERANCE,
    TENSOR_TOLERANCE_FILE,
    TENSOR_TOLERANCE_MIN,
    TOLERANCE,
    max_relative_differences,
    tensor_differences,
)
from tests.integration.pool import Pools


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default="", help="only the layouts whose name contains this, or of this reference")
    parser.add_argument("--json", help="also write every per-tensor difference to this file")
    parser.add_argument("--write", action="store_true",
                        help=f"derive the per-tensor tolerances and write them to {TENSOR_TOLERANCE_FILE.name}")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="noise_floor_"))
    env = {"TORCHTITAN_CACHE_DIR": str(tmp / "cache"), "TORCHINDUCTOR_CACHE_DIR": str(tmp / "cache" / "inductor"),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    os.environ.update(env)
    # a reference's name selects all of its layouts (a substring of layout names may catch another reference's)
    layouts = [layout for layout in ALL_LAYOUTS if args.k in layout.name or args.k == layout.reference]
    pools = Pools(tmp / "logs", env)
    rows, per_tensor = [], {}
    try:
        for name in sorted({layout.reference for layout in layouts}):
            ref = train_parity(pools, 1, REFERENCES[name].overrides, tmp / name)
            per_tensor[name] = {"floor": {}, "layouts": {}}
            # The same run as 4 micro-batches of 2: mathematically equal, summed in another order. Not for the
            # global-batch balance loss, whose scope with accumulation is each micro-batch (docs/models.md), nor for
            # float8, whose scales come from each forward's rows (tests/integration/layouts.py).
            if "global_batch" not in REFERENCES[name].overrides and "float8" not in name:
                reordered = train_parity(pools, 1, (*REFERENCES[name].overrides, *dp(2, 1)), tmp / f"{name}_reordered")
                rows.append((f"{name} reordered (noise floor)", max_relative_differences(reordered, ref)))
                per_tensor[name]["floor"] = tensor_differences(reordered, ref)
            for layout in (layout for layout in layouts if layout.reference == name):
                run = train_parity(pools, layout.nproc, layout.overrides, tmp / layout.name)
                rows.append((f"{layout.name} ({layout.nproc} ranks)", max_relative_differences(run, ref)))
                per_tensor[name]["layouts"][layout.name] = tensor_differences(run, ref)
    finally:
        pools.close()
    keys = list(TOLERANCE)
    print(f"| layout | {' | '.join(keys)} |\n|---|{'---|' * len(keys)}")
    for name, worst in rows:
        print(f"| {name} | " + " | ".join(f"{worst[k]:.1e}" for k in keys) + " |")
    print("| tolerance | " + " | ".join(f"{TOLERANCE[k]:.0e}" for k in keys) + " |")
    kinds = ("grad", "param", *MOMENTS)
    print("\n| reference | tensor | " + " | ".join(f"{of} floor | {of} worst (layout)" for of in kinds) + " |")
    print("|---|---|" + "---|---|" * len(kinds))
    for name, found in per_tensor.items():
        for tensor in sorted({t for d in (found["floor"], *found["layouts"].values()) for _, t in d}):
            cells = []
            for of in kinds:
                worst = max(((d.get((of, tensor), 0.0), layout) for layout, d in found["layouts"].items()),
                            default=(0.0, "-"))
                cells += [f"{found['floor'].get((of, tensor), 0.0):.1e}", f"{worst[0]:.1e} ({worst[1]})"]
            print(f"| {name} | {tensor} | " + " | ".join(cells) + " |")
    if args.write:  # the references measured replace theirs; the others' stay (measure all of a reference's layouts)
        tolerances = {**json.loads(TENSOR_TOLERANCE_FILE.read_text()), **derive_tensor_tolerances(per_tensor)}
        TENSOR_TOLERANCE_FILE.write_text(json.dumps(tolerances, indent=1, sort_keys=True) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {name: {"floor": {f"{of}:{t}": v for (of, t), v in found["floor"].items()},
                    "layouts": {layout: {f"{of}:{t}": v for (of, t), v in d.items()}
                                for layout, d in found["layouts"].items()}}
             for name, found in per_tensor.items()}, indent=1))


def derive_tensor_tolerances(per_tensor: dict) -> dict:
    """reference -> kind -> tensor -> 10x its largest difference (floor or any layout), rounded up to 1, 2 or 5 times
    a power of ten, at least TENSOR_TOLERANCE_MIN and at most the kind's TOLERANCE (never looser than before), or
    for a float8 reference FLOAT8_TENSOR_CEILING x that."""
    out: dict = {}
    for name, found in per_tensor.items():
        worst: dict = dict(found["floor"])
        for differences in found["layouts"].values():
            for key, value in differences.items():
                worst[key] = max(worst.get(key, 0.0), value)
        for (of, tensor), value in worst.items():
            limit = max(10 * value, TENSOR_TOLERANCE_MIN)
            exponent = math.floor(math.log10(limit))
            step = next(m for m in (1, 2, 5, 10) if m * 10 ** exponent >= limit * (1 - 1e-12))
            ceiling = REFERENCE_TOLERANCE.get(name, TOLERANCE)[of] * (FLOAT8_TENSOR_CEILING if "float8" in name else 1)
            out.setdefault(name, {}).setdefault(of, {})[tensor] = min(float(f"{step}e{exponent}"), ceiling)
    return out


if __name__ == "__main__":
    main()
