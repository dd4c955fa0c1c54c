"""Would compiling the protocol core bring the simulator to 1,000x real time? Measured.

Copies `core/` into a scratch package, compiles it with mypyc (the same source, typed as it is;
mypyc ships with mypy, a dev dependency; needs a C compiler), and times the 1P1D, 8 QPS, 16k
points of `benchmarks/sim_speed.py` (recording off) with the interpreted core and with the
compiled one, in alternating child processes (least CPU of `--repeat` each), checking that both
give the same summary.

Two constructs of the core stop mypyc, and the scratch copy rewrites them (the repository's core
is unchanged; both rewrites are equivalent):
- `RunBlocks` subclasses `tuple` (`super().__new__`): made a non-native class calling
  `tuple.__new__`;
- `SessionTable` is a `@dataclass` subclassing `Machine`, whose generated constructor mypyc
  miscompiles (it calls the base `__init__` with the dataclass's arguments): a plain
  `__init__` instead.

Events of the compiled core are native classes that the store's encoders do not take
(recording on fails), so only recording off is timed.

    .venv/bin/python benchmarks/compiled_core.py [--minutes 2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import importlib.util, json, os, sys, time
scratch = sys.argv[1]
if scratch:
    sys.path.insert(0, scratch)
    core = os.path.join(scratch, "kvplane", "core")
    init = next(f for f in os.listdir(core) if f.startswith("__init__") and f.endswith(".so"))

    class CompiledCore:
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name != "kvplane.core":
                return None
            return importlib.util.spec_from_file_location(
                name, os.path.join(core, init), submodule_search_locations=[core])

    sys.meta_path.insert(0, CompiledCore)
sys.path.insert(0, os.path.join(sys.argv[2], "benchmarks"))
import sim_speed
from kvplane.sim.runner import simulate
import kvplane.core.plan
out = {"core": kvplane.core.plan.__file__}
for point in sim_speed.points(float(sys.argv[3])):
    cpu = time.process_time()
    _, s = simulate(point, None, drain=False)
    out[point.label.split("_")[0]] = {
        "cpu": time.process_time() - cpu,
        "summary": {k: s[k] for k in ("finished", "ttft_ms", "tpot_ms")}}
print(json.dumps(out))
"""


def patch(core: Path) -> None:
    blocks = core / "blocks.py"
    text = blocks.read_text()
    text = text.replace("from typing import Any, Self\n",
                        "from typing import Any, Self\n\nfrom mypy_extensions import mypyc_attr\n", 1)
    text = text.replace("class RunBlocks(tuple[int, ...]):",
                        "@mypyc_attr(native_class=False)\nclass RunBlocks(tuple[int, ...]):", 1)
    text = text.replace("self = super().__new__(cls, ids)", "self = tuple.__new__(cls, ids)")
    blocks.write_text(text)
    sessions = core / "sessions.py"
    text = sessions.read_text()
    start = text.index("@dataclass(slots=True)\nclass SessionTable(")
    end = text.index("    def decide(", start)
    text = text[:start] + '''class SessionTable(Machine[SessionCommand]):
    name = "sessions"

    def __init__(self, instance: str = "router", block_size: int = 16) -> None:
        Machine.__init__(self, instance)
        self.block_size = block_size
        self.handles: dict[SessionKey, RetainedHandle] = {}
        self.consumed: dict[str, float] = {}
        self._pruned_at = 0.0

''' + text[end:]
    sessions.write_text(text)


def build(scratch: Path) -> None:
    pkg = scratch / "kvplane"
    shutil.copytree(ROOT / "core", pkg / "core", ignore=shutil.ignore_patterns("__pycache__"))
    (pkg / "__init__.py").write_text("")
    patch(pkg / "core")
    mypyc = Path(sys.executable).with_name("mypyc")
    print("compiling core/ with mypyc (a minute or two) ...", flush=True)
    subprocess.run([str(mypyc), "--ignore-missing-imports", "kvplane/core"], cwd=scratch,
                   check=True, stdout=subprocess.DEVNULL)


def run(scratch: str, minutes: float) -> dict:
    got = subprocess.run([sys.executable, "-c", CHILD, scratch, str(ROOT), str(minutes)],
                         check=True, capture_output=True, text=True, env=os.environ)
    return json.loads(got.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp))
        best: dict[str, dict[str, float]] = {"interpreted": {}, "compiled": {}}
        summaries: dict[str, dict[str, object]] = {"interpreted": {}, "compiled": {}}
        for _ in range(args.repeat):
            for kind, scratch in (("interpreted", ""), ("compiled", tmp)):
                out = run(scratch, args.minutes)
                if kind == "compiled" and not out.pop("core").endswith(".so"):
                    sys.exit("the compiled core was not the one imported")
                out.pop("core", None)
                for mode, r in out.items():
                    best[kind][mode] = min(best[kind].get(mode, 1e9), r["cpu"])
                    summaries[kind][mode] = r["summary"]
    print(f"1P1D, 8 QPS, 16k in, {args.minutes:g} simulated minutes of arrivals, recording off; "
          f"least CPU of {args.repeat} alternating runs each")
    for mode in best["interpreted"]:
        a, b = best["interpreted"][mode], best["compiled"][mode]
        same = summaries["interpreted"][mode] == summaries["compiled"][mode]
        print(f"  {mode}: interpreted core {a:.3f} CPU s, compiled {b:.3f}: {a / b:.2f}x "
              f"({'same summary' if same else 'SUMMARIES DIFFER'})")


if __name__ == "__main__":
    main()
