"""``megatron-ext compare RUN_DIR GOLDEN.json``: Megatron's golden-value rules (exit 1: a
comparison failed, 2: an input cannot be read). ``compare RUN_A RUN_B [RUN_C ...] [--plot FILE.png]``:
two or more run directories, their difference table and overlaid curves
(:mod:`megatron_ext.runs.side_by_side`; exit 2: an input is not a run or they differ in kind)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from megatron_ext.errors import MegatronExtError

NAME = "compare"
HELP = "compare a run with golden values (Megatron's rules)"


class _BadInput(MegatronExtError):
    """An input `compare` cannot read: one line, exit status 2."""


def _tolerance(text: str) -> float:
    """--rtol: a finite number >= 0 (argparse turns the ValueError into a one-line usage error)."""
    import math

    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise ValueError(text)
    return value


_tolerance.__name__ = "tolerance (a finite number >= 0)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="a run directory (or a metrics JSON file)")
    parser.add_argument("golden", help="golden-value JSON, or a second run directory")
    parser.add_argument(
        "more_runs", nargs="*", metavar="RUN", help="more run directories, compared with the first"
    )
    parser.add_argument("--plot", metavar="FILE.png", help="runs: overlay their curves in this PNG")
    parser.add_argument(
        "--metrics", nargs="+", help="metrics to check (default: the run's test.metrics)"
    )
    parser.add_argument("--rtol", type=_tolerance, help="replace every approximate check's rtol")
    parser.add_argument("--approximate-only", action="store_true", help="skip the exact checks")
    parser.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        help="whose default rules apply (default: the run's recipe, else gpu = Megatron's)",
    )


def _read_metrics_file(path, what: str):
    import json

    from megatron_ext.runs import metrics as met

    try:
        return met.read_golden(path)
    except FileNotFoundError:
        raise _BadInput(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise _BadInput(f"{what} {path} is a directory, not a JSON file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _BadInput(f"{what} {path} is not JSON: {exc}") from None
    except RecursionError:
        raise _BadInput(f"{what} {path} nests too deeply to be golden-value JSON") from None
    except (ValueError, TypeError, AttributeError, OverflowError) as exc:
        raise _BadInput(
            f"{what} {path} is not golden-value JSON ({{metric: {{start_step, end_step, "
            f"step_interval, values}}}}): {exc}"
        ) from None
    except OSError as exc:
        raise _BadInput(f"{what} {path} cannot be read: {exc.strerror}") from None


def _run_metrics(source):
    from megatron_ext.runs import metrics as met

    if not source.exists():
        raise _BadInput(f"{source} does not exist (give a run directory or a metrics JSON file)")
    if not source.is_dir():
        return _read_metrics_file(source, "metrics file")
    metrics_file = source / "metrics.json"
    if metrics_file.exists():
        return _read_metrics_file(metrics_file, "metrics file")
    try:
        return met.read_run_metrics(source)[0]
    except (OSError, ValueError, RecursionError) as exc:
        raise _BadInput(f"the metrics of {source} cannot be read: {exc}") from None


def main(args: argparse.Namespace) -> int:
    """Exit 0: every check passed; 1: a comparison failed; 2: an input cannot be read."""
    from pathlib import Path

    from megatron_ext.runs import side_by_side as run_compare

    try:
        from megatron_ext.runs.listing import is_run_dir

        if is_run_dir(
            Path(args.golden)
        ):  # another directory stays "golden values ... is a directory"
            return _compare_runs(args)
        if args.more_runs:
            raise _BadInput(
                f"{args.golden} is not a run directory: more than two inputs compare runs "
                "(compare RUN_A RUN_B RUN_C ...)"
            )
        if args.plot:
            raise _BadInput("--plot needs two run directories (compare RUN_A RUN_B --plot F.png)")
        return _compare(args)
    except run_compare.CompareError as exc:
        print(f"megatron-ext compare: {exc}", file=sys.stderr)
        return 2
    except _BadInput as exc:
        print(f"megatron-ext compare: {exc}", file=sys.stderr)
        return 2


def _compare_runs(args: argparse.Namespace) -> int:
    """Two or more runs: the difference table (and the plot); exit 0 (it judges nothing)."""
    from pathlib import Path

    from megatron_ext.runs import side_by_side as run_compare

    if args.plot and not args.plot.lower().endswith(".png"):
        raise _BadInput(f"--plot {args.plot}: give a .png file name")
    curves = [run_compare.read(Path(p)) for p in [args.run, args.golden, *args.more_runs]]
    sets = run_compare.metric_sets(*curves)
    names = sets.common
    if args.metrics:
        unknown = [m for m in args.metrics if m not in names]
        if unknown:
            every, all_ = ("both runs", "both") if len(curves) == 2 else ("every run", "all")
            raise _BadInput(f"--metrics {unknown}: not logged by {every} ({all_} log {names})")
        names = list(args.metrics)
    lines = run_compare.table(curves, run_compare.differences(curves, names))
    print("\n".join(lines + run_compare.only_in_one_run(curves, sets)))
    if args.plot:
        from megatron_ext import files

        drawn, flat = run_compare.plotted(curves, names)
        if flat:
            print("\n".join(run_compare.wrapped("constant in every run (not plotted):", flat)))
        try:
            written = run_compare.plot(Path(args.plot), curves, drawn)
        except OSError as exc:  # a full or read-only disk: one line, nothing left behind
            raise _BadInput(f"--plot {files.cannot_write(args.plot, exc)}") from None
        print(f"plot: {written}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatron_ext.recipes import RecipeError
    from megatron_ext.runs import golden as cmp

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
        names = args.metrics or list(golden)  # one the run lacks is missing: it fails
    unknown = [m for m in names if m not in actual and m not in golden]
    if unknown:
        raise _BadInput(
            f"metric {unknown[0]!r} is neither in the run nor in the golden values; the run "
            f"logs: {', '.join(sorted(actual)[:12]) or 'nothing'}"
        )
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
    if not report.results:
        print(
            f"megatron-ext compare: nothing was compared: no rule checks {', '.join(names) or 'any'}"
            " metric (give --metrics with a metric the golden values hold, e.g. lm loss)",
            file=sys.stderr,
        )
        return 1
    print(f"rules: {cmp.RULE_SOURCES['cpu' if device == 'cpu' else 'gpu']}")
    print("\n".join(report.lines()))
    return 0 if report.passed else 1
