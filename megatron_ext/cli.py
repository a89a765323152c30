"""The ``megatron-ext`` command.

- ``megatron-ext --version`` and ``megatron-ext doctor``: versions, devices, active patches;
- ``megatron-ext run RECIPE [KEY=VALUE ...]``: validate and train a recipe locally;
- ``megatron-ext validate RECIPE [KEY=VALUE ...]``: every check, no process started;
- ``megatron-ext compare RUN_DIR GOLDEN.json``: Megatron's golden-value rules (exit 1: a
  comparison failed, 2: an input cannot be read);
- ``megatron-ext import PATH/model_config.yaml [-o RECIPE.yaml]``: a Megatron-LM test case as
  a recipe (``run`` and ``validate`` also take such a file directly);
- ``megatron-ext submit RECIPE --slurm [...]``: the recipe as a Slurm job;
- ``megatron-ext convert-checkpoint IN OUT --model M --to T``: mHC keys upstream <-> megatron-ext.
- ``megatron-ext schedule --pp P [--vpp V] --microbatches M [...]`` or ``--recipe RECIPE``:
  megatron-core's pipeline schedule as a grid, its bubble, peak in-flight micro-batches and
  bytes per pipeline edge, without starting anything.

Recipes and their schema: recipes/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import platform
import sys
from importlib import metadata

from megatron_ext.launch.startup import torch_compile_deferred


def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def doctor_report() -> list[str]:
    """What megatron-ext runs on, and what it changed: one fact per line."""
    import torch

    import megatron_ext
    from megatron_ext import registry, runtime

    gpu = torch.cuda.is_available()
    if not gpu:
        # What a launcher would do on this machine: the CPU runtime, then the report.
        runtime.use_cpu()
    else:
        megatron_ext.install()
    lines = [
        f"megatron-ext      {megatron_ext.__version__}",
        f"megatron-core     {_package_version('megatron-core')} "
        f"(verified: {', '.join(registry.VERIFIED_MEGATRON_CORE)})",
        f"megatron-core code {registry.imported_megatron_core().describe()}",
        f"torch             {torch.__version__}",
        f"python            {platform.python_version()}",
        f"gpu               {torch.cuda.get_device_name(0) if gpu else 'none'}",
        f"backend           {'nccl' if gpu else 'gloo'}",
        f"transformer-engine {'present' if _importable('transformer_engine') else 'absent'}",
        f"apex              {'present' if _importable('apex') else 'absent'}",
        f"cpu runtime       {'active' if runtime.cpu_active() else 'off'}",
        "patch registry:",
    ]
    for patch in registry.patches():
        state = "active" if registry.is_applied(patch.target) else "inactive"
        verified = ", ".join(patch.verified)
        lines.append(f"  [{patch.group:4}] {state:8} {patch.target} (verified on {verified})")
        lines.append(f"         why: {patch.why}")
    lines.append("private seams (depended on, not replaced; checked by install()):")
    for seam in registry.seams():
        problem = registry.seam_problem(seam)
        state = "ok" if problem is None else "BROKEN"
        verified = f"{seam.package} {', '.join(seam.verified)}"
        lines.append(f"  [{seam.kind}] {state} {seam.target} (verified on {verified})")
        lines.append(f"         why: {seam.why}" if problem is None else f"         {problem}")
    if runtime.cpu_active():
        lines.append(
            "cpu runtime also pushes: CudaToCpuMode (device='cuda' -> cpu, Tensor.cuda(), Tensor.type())"
        )
    return lines


def _split_targets(tokens: list[str]) -> tuple[list[str], list[str]]:
    """Positional tokens: KEY=VALUE / ~KEY are overrides, the rest are recipe files."""
    overrides = [t for t in tokens if "=" in t or t.startswith("~")]
    return [t for t in tokens if t not in overrides], overrides


def _load(recipe: str, platform: str, overrides: list[str], device: str | None):
    """Load a recipe; ``--device`` becomes a launch.device override only when it changes it."""
    from megatron_ext.recipes import load

    loaded = load(recipe, platform, overrides)
    if device and device != loaded.recipe.launch.device:
        loaded = load(recipe, platform, [*overrides, f"launch.device={device}"])
    return loaded


def _add_recipe_args(parser: argparse.ArgumentParser, default_platform: str | None = "cpu") -> None:
    parser.add_argument(
        "targets",
        nargs="+",
        metavar="RECIPE [KEY=VALUE ...]",
        help="recipe YAML, then overrides such as parallelism.pp=4 training.iterations=20",
    )
    parser.add_argument(
        "--platform",
        default=default_platform,
        help="platform overlay of the recipe (default: %(default)s)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        help="override launch.device (cpu: gloo and the CPU runtime, GPUs hidden)",
    )


def _cmd_run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatron_ext.recipes import RecipeError, runner

    recipes, overrides = _split_targets(args.targets)
    if len(recipes) != 1:
        print(f"megatron-ext run: expected one recipe, got {recipes or 'none'}", file=sys.stderr)
        return runner.EXIT_INVALID
    try:
        loaded = _load(recipes[0], args.platform, overrides, args.device)
    except RecipeError as exc:
        print(exc, file=sys.stderr)
        return runner.EXIT_INVALID
    if args.dry_run:
        return runner.dry_run(
            loaded,
            run_dir=Path(args.run_dir) if args.run_dir else None,
            runs_root=Path(args.runs_root),
            megatron_checks=not args.skip_megatron_checks,
        ).exit_code
    outcome = runner.run(
        loaded,
        run_dir=Path(args.run_dir) if args.run_dir else None,
        runs_root=Path(args.runs_root),
        compare_golden=not args.no_compare,
        force_compare=args.compare,
        write_golden=args.write_golden,
        megatron_checks=not args.skip_megatron_checks,
        trace=args.trace,
    )
    return outcome.exit_code


def _cmd_validate(args: argparse.Namespace) -> int:
    from megatron_ext.recipes import RecipeError, plan
    from megatron_ext.recipes.loader import platforms_of
    from megatron_ext.recipes.validate import validate

    recipes, overrides = _split_targets(args.targets)
    if not recipes:
        print("megatron-ext validate: no recipe given", file=sys.stderr)
        return 2
    failed = False
    for recipe in recipes:
        platforms = [args.platform] if args.platform else platforms_of(recipe)
        for platform_name in platforms:
            label = f"{recipe} [{platform_name}]"
            try:
                loaded = _load(recipe, platform_name, overrides, args.device)
            except RecipeError as exc:
                failed = True
                for problem in exc.problems:
                    print(f"{label}: {problem}")
                continue
            result = validate(loaded, megatron_checks=not args.skip_megatron_checks)
            for problem in result.problems:
                print(f"{label}: {problem}")
            for note in [*loaded.notes, *result.notes]:
                print(f"{label}: note: {note}")
            if result.ok:
                print(f"{label}: OK ({plan.describe(loaded)})")
            failed = failed or not result.ok
    return 2 if failed else 0


class _BadInput(Exception):
    """An input `compare` cannot read: one line, exit status 2."""


def _read_metrics_file(path, what: str):
    import json

    from megatron_ext.recipes import metrics as met

    try:
        return met.read_golden(path)
    except FileNotFoundError:
        raise _BadInput(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise _BadInput(f"{what} {path} is a directory, not a JSON file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _BadInput(f"{what} {path} is not JSON: {exc}") from None
    except (ValueError, TypeError, AttributeError) as exc:
        raise _BadInput(
            f"{what} {path} is not golden-value JSON ({{metric: {{start_step, end_step, "
            f"step_interval, values}}}}): {exc}"
        ) from None
    except OSError as exc:
        raise _BadInput(f"{what} {path} cannot be read: {exc.strerror}") from None


def _run_metrics(source):
    from megatron_ext.recipes import metrics as met

    if not source.exists():
        raise _BadInput(f"{source} does not exist (give a run directory or a metrics JSON file)")
    if not source.is_dir():
        return _read_metrics_file(source, "metrics file")
    metrics_file = source / "metrics.json"
    if metrics_file.exists():
        return _read_metrics_file(metrics_file, "metrics file")
    return met.read_run_metrics(source)[0]


def _cmd_compare(args: argparse.Namespace) -> int:
    """Exit 0: every check passed; 1: a comparison failed; 2: an input cannot be read."""
    try:
        return _compare(args)
    except _BadInput as exc:
        print(f"megatron-ext compare: {exc}", file=sys.stderr)
        return 2


def _compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatron_ext.recipes import RecipeError
    from megatron_ext.recipes import compare as cmp

    source = Path(args.run)
    actual = _run_metrics(source)
    if not actual:
        raise _BadInput(
            f"no metrics in {source} (no metrics.json, TensorBoard files or iteration lines)"
        )
    golden = _read_metrics_file(Path(args.golden), "golden values")
    device, tolerances = args.device, {}
    recipe_file = source / "recipe.yaml" if source.is_dir() else None
    if recipe_file is not None and recipe_file.exists():
        from megatron_ext.recipes import load

        try:
            recipe = load(recipe_file).recipe
        except RecipeError as exc:
            raise _BadInput(
                f"the run's recipe {recipe_file} does not load: {exc.problems[0]}"
            ) from None
        device = device or recipe.launch.device
        tolerances = recipe.test.tolerances
        names = args.metrics or recipe.test.metrics
    else:
        names = args.metrics or [m for m in golden if m in actual]
    rules = cmp.rules_for(names, device or "gpu", tolerances)
    if args.rtol is not None:
        rules = {
            m: dataclasses.replace(r, rtol=args.rtol) if r.rtol is not None else r
            for m, r in rules.items()
        }
    report = cmp.compare(
        actual,
        golden,
        rules,
        title=f"{source} vs {args.golden}",
        approximate_only=args.approximate_only,
    )
    print(f"rules: {cmp.RULE_SOURCES['cpu' if device == 'cpu' else 'gpu']}")
    print("\n".join(report.lines()))
    return 0 if report.passed else 1


def _cmd_import(args: argparse.Namespace) -> int:
    """A Megatron-LM test case (model_config.yaml) as a megatron-ext recipe YAML."""
    import os
    from pathlib import Path

    import yaml

    from megatron_ext.recipes import upstream
    from megatron_ext.recipes.loader import parse_yaml

    source = Path(args.test_case)
    if source.is_dir():
        source = source / upstream.TEST_CASE_FILE
    try:
        raw = parse_yaml(source.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        print(f"megatron-ext import: cannot read {source}: {exc}", file=sys.stderr)
        return 2
    if not upstream.is_test_case(raw):
        print(
            f"megatron-ext import: {source} is not a Megatron-LM test case (no MODEL_ARGS)",
            file=sys.stderr,
        )
        return 2
    conversion = upstream.convert(raw, source.resolve().parent)
    for problem in conversion.problems:
        print(f"{source}: {problem}", file=sys.stderr)
    if conversion.problems:
        return 2
    recipe = conversion.recipe
    out = Path(args.output) if args.output else None
    if out is not None:  # golden files stay beside the test case
        base = os.path.relpath(source.resolve().parent, out.resolve().parent)
        recipe["test"]["golden_values"] = os.path.join(base, recipe["test"]["golden_values"])
        for overlay in recipe["platforms"].values():
            overlay["test"]["golden_values"] = os.path.join(base, overlay["test"]["golden_values"])
    notes = [*conversion.notes.get("mapping", []), *conversion.notes.get("cpu", [])]
    text = "\n".join([f"# Imported by megatron-ext from {source}", *[f"# {n}" for n in notes]])
    text += "\n" + yaml.safe_dump(recipe, sort_keys=False, width=100)
    if out is None:
        print(text, end="")
    else:
        out.write_text(text)
        print(f"wrote {out} ({len(notes)} note(s); `megatron-ext validate {out}`)")
    return 0


def _cmd_submit(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatron_ext.recipes import RecipeError
    from megatron_ext.recipes.loader import parse_yaml
    from megatron_ext.recipes.runner import EXIT_INVALID
    from megatron_ext.recipes.submit import SlurmOptions, submit

    if not args.slurm:
        print("megatron-ext submit: only --slurm is supported; pass it explicitly", file=sys.stderr)
        return EXIT_INVALID
    recipes, overrides = _split_targets(args.targets)
    if len(recipes) != 1:
        print(f"megatron-ext submit: expected one recipe, got {recipes or 'none'}", file=sys.stderr)
        return EXIT_INVALID
    platform = args.platform
    if platform is None:
        try:
            raw = parse_yaml(Path(recipes[0]).read_text()) or {}
        except Exception:
            raw = {}
        platform = "gpu-cluster" if "gpu-cluster" in (raw.get("platforms") or {}) else "cpu"
    try:
        loaded = _load(recipes[0], platform, overrides, args.device)
    except RecipeError as exc:
        print(exc, file=sys.stderr)
        return EXIT_INVALID
    options = SlurmOptions(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        partition=args.partition,
        account=args.account,
        time=args.time,
        container_image=args.container_image,
        container_mounts=args.container_mounts.split(",") if args.container_mounts else None,
        python=args.python,
    )
    outcome = submit(
        loaded,
        options,
        run_dir=Path(args.run_dir) if args.run_dir else None,
        runs_root=Path(args.runs_root),
        dry_run=args.dry_run,
        wait=not args.no_wait,
        compare_golden=not args.no_compare,
        force_compare=args.compare,
        megatron_checks=not args.skip_megatron_checks,
    )
    return outcome.exit_code


def _cmd_convert_checkpoint(args: argparse.Namespace) -> int:
    from megatron_ext.checkpoint.convert import ConversionError, convert_file

    try:
        notes = convert_file(args.input, args.output, args.model, args.to, args.source)
    except (ConversionError, OSError) as exc:
        print(f"megatron-ext convert-checkpoint: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}")
    print(f"wrote {args.output} ({args.model}, {args.to} layout)")
    return 0


def _cmd_schedule(args: argparse.Namespace) -> int:
    from megatron_ext.pipeline import report as rep
    from megatron_ext.pipeline.schedule import SchedulePlan

    overrides = list(getattr(args, "targets", None) or [])
    try:
        if args.recipe:
            plan, size = rep.plan_from_recipe(args.recipe, overrides, args.platform)
            if args.microbatches is not None:
                plan.microbatches = args.microbatches
        else:
            if args.pp is None or args.microbatches is None:
                print(
                    "megatron-ext schedule: give --pp and --microbatches (or --recipe RECIPE)",
                    file=sys.stderr,
                )
                return 2
            plan = SchedulePlan(
                pp=args.pp,
                vpp=args.vpp,
                microbatches=args.microbatches,
                microbatch_group_size=args.microbatch_group_size,
            )
            size = None
            if args.hidden is not None:
                if args.seq is None or args.micro_batch_size is None:
                    print(
                        "megatron-ext schedule: --hidden needs --seq and --micro-batch-size",
                        file=sys.stderr,
                    )
                    return 2
                size = rep.MessageSize(
                    args.hidden,
                    args.seq,
                    args.micro_batch_size,
                    args.mhc_streams or 1,
                    args.dtype_bytes,
                )
            elif args.mhc_streams:
                print(
                    "megatron-ext schedule: --mhc-streams needs --hidden, --seq and --micro-batch-size",
                    file=sys.stderr,
                )
                return 2
        lines, schedule = rep.report(plan, size, steps=args.steps)
    except ValueError as exc:
        print(f"megatron-ext schedule: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    if args.plot:
        from megatron_ext.pipeline.schedule import simulate
        from megatron_ext.pipeline.timeline import plot_timeline

        timeline = simulate(schedule)
        title = (
            f"{rep.kind_of(plan).split(' (')[0]}: {len(schedule.ranks)} ranks"
            + (f" x {plan.vpp} chunks" if plan.vpp else "")
            + f", {plan.microbatches} micro-batches"
        )
        plot_timeline(
            timeline,
            args.plot,
            title,
            schedule.chunks,
            unit="time (forward = 1, backward = 2)",
            note=f"bubble {timeline.bubble():.1%}",
        )
        print(f"timeline: {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    import megatron_ext

    parser = argparse.ArgumentParser(
        prog="megatron-ext",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"megatron-ext {megatron_ext.__version__}"
    )
    commands = parser.add_subparsers(dest="command")
    commands.add_parser(
        "doctor", help="report versions, devices, optional packages and active patches"
    )

    run = commands.add_parser("run", help="validate a recipe and train it on this machine")
    _add_recipe_args(run)
    run.add_argument(
        "--run-dir", help="the run directory (default: RUNS_ROOT/<name>-<platform>-<time>)"
    )
    run.add_argument(
        "--runs-root", default="runs", help="where run directories go (default: %(default)s)"
    )
    run.add_argument("--no-compare", action="store_true", help="do not compare with golden values")
    run.add_argument(
        "--compare",
        action="store_true",
        help="compare with golden values even when overrides change the recipe",
    )
    run.add_argument(
        "--write-golden",
        action="store_true",
        help="write this run's metrics as the recipe's golden values for the platform",
    )
    run.add_argument(
        "--skip-megatron-checks",
        action="store_true",
        help="validate the plan only (skip Megatron's argument checks and the guards)",
    )
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="validate, then print the plan and the exact commands; start no rank",
    )
    run.add_argument(
        "--trace",
        action="store_true",
        help="record every rank's pipeline schedule: trace.json, timeline.png and the "
        "measured vs theoretical bubble in the summary",
    )

    validate = commands.add_parser(
        "validate", help="check recipes: schema, plan, Megatron's checks, guards"
    )
    validate.add_argument(
        "targets",
        nargs="+",
        metavar="RECIPE [KEY=VALUE ...]",
        help="recipe YAML file(s), then overrides",
    )
    validate.add_argument(
        "--platform", default=None, help="check one platform (default: every platform)"
    )
    validate.add_argument("--device", choices=("cpu", "gpu"), help="override launch.device")
    validate.add_argument(
        "--skip-megatron-checks", action="store_true", help="schema and plan only"
    )

    compare = commands.add_parser(
        "compare", help="compare a run with golden values (Megatron's rules)"
    )
    compare.add_argument("run", help="a run directory (or a metrics JSON file)")
    compare.add_argument("golden", help="golden-value JSON")
    compare.add_argument(
        "--metrics", nargs="+", help="metrics to check (default: the run's test.metrics)"
    )
    compare.add_argument("--rtol", type=float, help="replace every approximate check's rtol")
    compare.add_argument("--approximate-only", action="store_true", help="skip the exact checks")
    compare.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        help="whose default rules apply (default: the run's recipe, else gpu = Megatron's)",
    )

    imp = commands.add_parser(
        "import", help="write a Megatron-LM test case (model_config.yaml) as a recipe"
    )
    imp.add_argument("test_case", help="PATH/model_config.yaml (or its directory)")
    imp.add_argument("-o", "--output", help="recipe file to write (default: print it)")

    submit = commands.add_parser("submit", help="run a recipe as a Slurm job, wait and compare")
    _add_recipe_args(submit, default_platform=None)
    submit.add_argument(
        "--slurm", action="store_true", help="submit with sbatch (the supported scheduler)"
    )
    submit.add_argument("--nodes", type=int)
    submit.add_argument("--gpus-per-node", type=int)
    submit.add_argument("--partition")
    submit.add_argument("--account")
    submit.add_argument("--time", help="job time limit, e.g. 00:30:00")
    submit.add_argument("--container-image", help="run the steps in this image (pyxis)")
    submit.add_argument("--container-mounts", help="comma-separated SRC:DST mounts")
    submit.add_argument(
        "--python", help="interpreter on the nodes (default: this one; 'python' in a container)"
    )
    submit.add_argument("--run-dir", help="run directory, on a file system the nodes share")
    submit.add_argument("--runs-root", default="runs")
    submit.add_argument("--dry-run", action="store_true", help="print the sbatch script and stop")
    submit.add_argument("--no-wait", action="store_true", help="return after sbatch")
    submit.add_argument("--no-compare", action="store_true")
    submit.add_argument("--compare", action="store_true")
    submit.add_argument("--skip-megatron-checks", action="store_true")

    convert = commands.add_parser(
        "convert-checkpoint",
        help="rename mHC checkpoint keys between upstream Megatron-LM (PR #6401/dev) and megatron-ext",
    )
    convert.add_argument("input", help="a torch.save'd model state dict or model_optim_rng.pt")
    convert.add_argument("output", help="where to write the converted file")
    convert.add_argument("--model", choices=("gpt", "hybrid"), required=True)
    convert.add_argument("--to", choices=("upstream", "megatron-ext"), required=True)
    convert.add_argument(
        "--source",
        choices=("main", "pr6401", "dev", "megatron-ext"),
        default="pr6401",
        help="where the input comes from: main's H_res orientation differs (a note "
        "says so); default: %(default)s",
    )
    schedule = commands.add_parser(
        "schedule",
        help="print megatron-core's pipeline schedule: grid, bubble, in-flight, bytes per edge",
    )
    schedule.add_argument("--pp", type=int, help="pipeline stages (--pipeline-model-parallel-size)")
    schedule.add_argument(
        "--vpp", type=int, help="chunks per rank (--num-virtual-stages-per-pipeline-rank)"
    )
    schedule.add_argument(
        "--microbatches", type=int, help="micro-batches per iteration and data-parallel rank"
    )
    schedule.add_argument(
        "--microbatch-group-size",
        type=int,
        help="--microbatch-group-size-per-virtual-pipeline-stage (default: pp)",
    )
    schedule.add_argument(
        "--mhc-streams", type=int, help="mHC residual streams n (edges carry n*h)"
    )
    schedule.add_argument("--hidden", type=int, help="hidden size h (for bytes per edge)")
    schedule.add_argument("--seq", type=int, help="sequence length (for bytes per edge)")
    schedule.add_argument(
        "--micro-batch-size", type=int, help="micro-batch size (for bytes per edge)"
    )
    schedule.add_argument(
        "--dtype-bytes", type=int, default=4, help="bytes per element (default: %(default)s)"
    )
    schedule.add_argument("--recipe", help="take the plan from a recipe (multi-module recipes too)")
    schedule.add_argument(
        "--platform", default="cpu", help="the recipe's platform overlay (default: %(default)s)"
    )
    schedule.add_argument(
        "--steps", action="store_true", help="also list every rank's steps with its P2P calls"
    )
    schedule.add_argument("--plot", metavar="FILE.png", help="draw the timeline with matplotlib")
    schedule.set_defaults(targets=[])

    # Overrides may follow options (`run R --platform cpu parallelism.pp=4`): argparse leaves
    # such late positionals unparsed, so they join the targets here.
    args, rest = parser.parse_known_args(argv)
    late = [token for token in rest if not token.startswith("-")]
    if len(late) != len(rest) or (late and not hasattr(args, "targets")):
        parser.error(
            f"unrecognized arguments: {' '.join(t for t in rest if t not in late) or ' '.join(rest)}"
        )
    if late:
        args.targets += late
    if args.command == "doctor":
        print("\n".join(doctor_report()))
        return 0
    handlers = {
        "run": _cmd_run,
        "validate": _cmd_validate,
        "compare": _cmd_compare,
        "submit": _cmd_submit,
        "import": _cmd_import,
        "schedule": _cmd_schedule,
        "convert-checkpoint": _cmd_convert_checkpoint,
    }
    if args.command in handlers:
        try:
            with torch_compile_deferred():  # the commands import megatron but never compile
                return handlers[args.command](args)
        except KeyboardInterrupt as exc:  # the launchers have stopped their ranks / left the job
            signum = getattr(exc, "signum", None)  # SIGTERM/SIGHUP (launch.local.Interrupted)
            print(f"megatron-ext: {exc or 'interrupted'}", file=sys.stderr)
            return 128 + signum if signum else 130
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
