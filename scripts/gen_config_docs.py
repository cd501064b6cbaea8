"""Write docs/configuration.md from the config dataclasses (their docstrings are the reference text).

    python scripts/gen_config_docs.py           # rewrite the page
    python scripts/gen_config_docs.py --check   # exit 1 if the page is out of date (a unit test runs this)
"""

from __future__ import annotations

import dataclasses
import json
import sys
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from project_python import use_project_python  # noqa: E402

use_project_python()  # the system Python re-runs this under the project's (scripts/project_python.py)

from torchtitan.config.manager import ALIASES, _type_name, field_docs, section_classes  # noqa: E402
from torchtitan.tools import startup_gc  # noqa: E402

PAGE = REPO / "docs" / "configuration.md"

INTRO = """# Configuration reference

Generated from `torchtitan/config/job_config.py` by `python scripts/gen_config_docs.py`; do not edit by hand.

A run's configuration is the dataclass defaults, overridden by a TOML file (`--job.config_file`, which
`run_train.sh` sets from `CONFIG_FILE` unless the command line has its own), overridden by `--section.key value`
command-line arguments. A key given twice on the command line takes the last value.
`./run_train.sh --help` prints the same list, with the values `CONFIG_FILE` and the overrides set, the launcher's
environment variables and the registered models and flavors. An unknown section or key, a value of the wrong type, an
invalid value or degrees that do not multiply to the world size stop the run with one line naming the key and
file (`config error: ...`, exit code 2): `run_train.sh` checks the config once, for NGPU x nodes processes,
before torch is imported and torchrun starts any rank, in well under 3 s (about 0.3 s; 2.5 s when a local
dataset is opened). Degrees against the world size are checked there when it is known without torch (`NGPU`
set, or no GPU driver on the machine), else once torch has counted the GPUs; an elastic node range leaves them
to the ranks, which check everything again before any process group is created.
The resolved configuration is saved as `job_config.json` in `job.dump_folder` (and printed at start with
`--job.print_config true`; the start-up log states the applied layout in a few lines instead): every
value left to be derived (-1: `data_parallel_shard_degree`, `global_batch_size`, the validation batch and
sequence length) appears as the number the run used (`torchtitan/config/resolve.py` derives them, once).

Key names follow torchtitan v0.2.2's TOML schema where the concept is the same. Differences:
- `training.dataset` defaults to `python_stdlib` (the embedded corpus), not `c4_test`.
- The tokenizer is `model.tokenizer_path` (a `tokenizer.json` file or a folder with one); v0.2.2's
  `model.hf_assets_path` is accepted as an alias.
- `seed` and `deterministic` live in `[debug]` as in v0.2.2; `training.seed` / `training.deterministic`
  are accepted as aliases. An alias is the same key: the command line wins over the TOML whichever spelling
  each uses, and two spellings in one source (both in the TOML, or both on the command line) must agree.
- Options marked "not available yet" are parsed (so existing files load) but enabling them is an error.
"""


def render() -> str:
    lines = [INTRO]
    if ALIASES:
        lines.append("Aliases: " + ", ".join(f"`{a}.{b}` -> `{c}.{d}`" for (a, b), (c, d) in ALIASES.items()) + "\n")
    for section, cls in section_classes().items():
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        defaults = cls()
        lines.append(f"## [{section}]\n")
        lines.append("| key | type | default | meaning |")
        lines.append("|---|---|---|---|")
        for f in dataclasses.fields(cls):
            default = json.dumps(getattr(defaults, f.name))
            meaning = docs.get(f.name, "")
            aliases = [f"`{a}.{b}`" for (a, b), target in ALIASES.items() if target == (section, f.name)]
            if aliases:
                meaning += f" (also accepted as {', '.join(aliases)})"
            lines.append(f"| `{f.name}` | `{_type_name(hints[f.name])}` | `{default}` | {meaning} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    text = render()
    if "--check" in sys.argv:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE} is out of date: run python scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    startup_gc.freeze_and_resume()  # the imports above ran with collection paused (scripts/project_python.py)
    sys.exit(main())
