"""CPU time of importing a training entry's megatron modules, with and without deferring
torch.compile (megatron_ext.launch.startup), side by side in alternating child processes.

    OMP_NUM_THREADS=1 .venv/bin/python bench/startup_imports.py [--repeats 5]

Each child imports what megatron_ext.pretrain_gpt imports from megatron (megatron.core and
megatron.training); the "deferred" child applies the start-up patch first, the "entry" child
also pauses the cyclic garbage collector meanwhile, as the entry points do. Figures are the
children's user+system CPU seconds (less sensitive to other load than wall time), medians over
the repeats, and whether torch's compiler got imported. Not a test. Text first; the LAST line is
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys

IMPORTS = "import megatron.core, megatron.training, megatron.training.arguments"
PROBE = "import sys; print('torch._dynamo' in sys.modules)"
CHILDREN = {
    "eager": f"{IMPORTS}; {PROBE}",
    "deferred": (  # torch.compile deferred only
        "from megatron_ext.launch import startup; startup.defer_torch_compile(); "
        f"{IMPORTS}; startup.restore_torch_compile(); {PROBE}"
    ),
    "entry": (  # what the entry points do: deferred, and the cyclic GC paused meanwhile
        "from megatron_ext.launch import startup; startup.begin_entry_imports(); "
        f"{IMPORTS}; startup.end_entry_imports(); {PROBE}"
    ),
}


def _child_cpu_seconds(code: str) -> tuple[float, bool]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], check=True, capture_output=True, text=True
    ).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, out.strip().splitlines()[-1] == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    seconds = {name: [] for name in CHILDREN}
    compiler_imported = {}
    for _ in range(args.repeats):
        for name, code in CHILDREN.items():  # alternate, so drift in load hits both alike
            cpu, dynamo = _child_cpu_seconds(code)
            seconds[name].append(cpu)
            compiler_imported[name] = dynamo
    median = {name: statistics.median(values) for name, values in seconds.items()}
    for name in CHILDREN:
        print(
            f"{name:9s} median {median[name]:.2f} CPU-s over {args.repeats} "
            f"(torch._dynamo imported: {compiler_imported[name]})"
        )
    ratio = median["deferred"] / median["eager"]
    entry_ratio = median["entry"] / median["eager"]
    print(f"deferred / eager: {ratio:.2f}   entry / eager: {entry_ratio:.2f}")
    print(
        json.dumps(
            {
                "bench": "startup_imports",
                "repeats": args.repeats,
                "median_cpu_s": median,
                "ratio_deferred_to_eager": round(ratio, 3),
                "ratio_entry_to_eager": round(entry_ratio, 3),
                "compiler_imported": compiler_imported,
            }
        )
    )


if __name__ == "__main__":
    main()
