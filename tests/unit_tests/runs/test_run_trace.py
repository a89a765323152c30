"""``run --trace``'s post-processing on rank dumps written here (no training): trace.json,
timeline.png, measured vs theoretical bubble, the order check and the failing step; and the
error note a traced pass adds."""

import json
from pathlib import Path

import pytest

from megatron_ext.recipes import load
from megatron_ext.recipes.prepare import prepare
from megatron_ext.runs import trace as run_trace
from megatron_ext.schedules.schedule import Compute, SchedulePlan, build_schedule
from megatron_ext.schedules.trace import Event, Tracer, _Message, traced_forward_step, tracing

RECIPE = Path(__file__).parents[3] / "recipes" / "gpt_tp2_pp2.yaml"


def write_dumps(trace_dir: Path, schedule, world_to_stage, swap_on=None, error_on=None):
    """Every world rank's events: the theory's steps of its stage, 1 ms per forward, 2 per
    backward (B), 1 per weight gradient (W), run back to back (no waiting), 2 iterations."""
    trace_dir.mkdir(parents=True)
    for world, stage in enumerate(world_to_stage):
        events, clock = [], 0
        for iteration in range(2):
            steps = list(schedule.ranks[stage])
            if swap_on == world and iteration == 1:
                steps[1], steps[2] = steps[2], steps[1]
            for index, step in enumerate(steps):
                length = {"F": 1_000_000, "B": 2_000_000, "W": 1_000_000}.get(
                    getattr(step, "kind", None), 1000
                )
                event = Event(iteration, index, clock + 1, clock + 1 + length)
                if isinstance(step, Compute):
                    event.kind, event.microbatch, event.chunk = (
                        step.kind,
                        step.microbatch,
                        step.chunk,
                    )
                else:
                    event.call = step.call
                    event.messages = [
                        _Message(m.direction, m.microbatch, m.chunk) for m in step.messages
                    ]
                if error_on == (world, iteration, index):
                    event.error = "RuntimeError: boom"
                events.append(event)
                clock += length
        (trace_dir / f"trace-rank-{world}.json").write_text(
            json.dumps(
                {
                    "rank": world,
                    "module": None,
                    "pipeline_rank": stage,
                    "events": [e.to_dict() for e in events],
                }
            )
        )


def _traced(loaded):
    """The run request of ``run --trace``: it carries the schedule plan the trace is held to."""
    return prepare(loaded, megatron_checks=False, check_pickles=False, trace=True)


def test_summary_files_and_bubbles(tmp_path):
    loaded = load(RECIPE, "cpu", [])  # TP2 x PP2, 4 micro-batches
    schedule = build_schedule(SchedulePlan(pp=2, microbatches=4))
    write_dumps(tmp_path / "trace", schedule, [0, 0, 1, 1])
    lines = []
    entry = run_trace.summarize(_traced(loaded), tmp_path, lines.append)
    assert entry["order_matches_theory"] and entry["bubble_theoretical"] == 0.2
    # In these times no rank ever waits: only the 1 us P2P calls are idle.
    assert 0 <= entry["bubble_measured"] < 0.001
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1, 2, 3}
    assert any(e["name"] == "B3" and e["dur"] == 2000 for e in events)
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert any("every rank ran megatron-core's order exactly" in line for line in lines)


def test_a_rank_off_the_theory_is_reported(tmp_path):
    loaded = load(RECIPE, "cpu", [])
    schedule = build_schedule(SchedulePlan(pp=2, microbatches=4))
    write_dumps(tmp_path / "trace", schedule, [0, 0, 1, 1], swap_on=3)
    entry = run_trace.summarize(_traced(loaded), tmp_path, lambda line: None)
    assert not entry["order_matches_theory"]
    assert entry["order_mismatches"] == [
        "world rank 3, iteration 2: rank 0, step 1: expected F0, got send_forward_recv_backward(-)"
    ]


def test_zb_h1_run_order_bubble_and_w_events(tmp_path):
    """parallelism.schedule: zb-h1 (TP2 x PP2, 4 micro-batches): the ranks' W steps are in
    the order check, count as busy in the measured bubble, and have their own category in
    trace.json; the textbook figure is ZB-H1's (p-1)/(3m+p-1) = 1/13. Ranks that ran 1F1B's
    order instead are reported."""
    loaded = load(RECIPE, "cpu", [])
    loaded.recipe.parallelism.schedule = "zb-h1"  # (the field zb-plumbing adds to the schema)
    schedule = build_schedule(SchedulePlan(pp=2, microbatches=4, schedule="zb-h1"))
    write_dumps(tmp_path / "trace", schedule, [0, 0, 1, 1])
    lines = []
    entry = run_trace.summarize(_traced(loaded), tmp_path, lines.append)
    assert entry["order_matches_theory"] and entry["schedule"] == "zb-h1"
    assert entry["bubble_textbook"] == entry["bubble_theoretical"] == round(1 / 13, 4)
    assert 0 <= entry["bubble_measured"] < 0.001  # back to back: W is busy time, not idle
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["name"] for e in events if e.get("cat") == "weight"} == {f"W{i}" for i in range(4)}
    assert any("every rank ran megatron-ext's ZB-H1 order exactly" in line for line in lines)
    assert any("W steps count as busy" in line for line in lines)

    one_f_one_b = build_schedule(SchedulePlan(pp=2, microbatches=4))
    write_dumps(tmp_path / "other" / "trace", one_f_one_b, [0, 0, 1, 1])
    entry = run_trace.summarize(_traced(loaded), tmp_path / "other", lambda line: None)
    assert not entry["order_matches_theory"]
    assert entry["order_mismatches"][0] == (
        "world rank 0, iteration 1: rank 0, step 7: expected send_backward(-), got "
        "send_backward_recv_forward(-)"
    )


def test_failing_step_is_found(tmp_path):
    schedule = build_schedule(SchedulePlan(pp=2, microbatches=4))
    write_dumps(tmp_path / "trace", schedule, [0, 1], error_on=(1, 1, 5))
    assert run_trace.failing_step(tmp_path / "trace") == (
        "rank 1, step 5: F1 (iteration 2): RuntimeError: boom"
    )


def test_a_traced_pass_that_raises_names_rank_chunk_and_step():
    """The error keeps its type and message and gains a note with the step and the rank's
    theoretical order, the failing step marked."""
    schedule = build_schedule(SchedulePlan(pp=4, vpp=2, microbatches=4))

    def failing(*args, **kwargs):
        raise ValueError("shape mismatch")

    forward = traced_forward_step(failing)
    tracer = Tracer(rank=2, schedule=schedule)
    with tracing(tracer):
        tracer.begin_iteration()
        tracer._index = 7  # as if seven steps had run
        with pytest.raises(ValueError, match="shape mismatch") as raised:
            forward(None, None, None, 4, None, current_microbatch=3, vp_stage=1)
    note = "\n".join(raised.value.__notes__)
    assert "pipeline step: rank 2, chunk 1, step 7: F3 (iteration 0)" in note
    assert "<-- HERE" in note and "rank 2's schedule" in note


def test_tracing_off_leaves_megatrons_functions_untouched():
    """Outside tracing() every traced target is megatron-core's own function (no wrapper, so
    no cost); inside it each is wrapped; afterwards the originals are back."""
    from megatron_ext import registry

    targets = [p.target for p in registry.patches("trace")]
    assert len(targets) == 7  # megatron's five; ZB-H1's schedule function and W step
    originals = {t: registry.current(t) for t in targets}
    assert not any(registry.is_applied(t) for t in targets)
    with tracing():
        assert all(registry.current(t) is not originals[t] for t in targets)
    assert all(registry.current(t) is originals[t] for t in targets)
