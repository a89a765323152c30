"""A schedule's text form (megatron_ext.schedules.text): every shipped schedule round-trips
in both spellings, ours and torch.distributed.pipelining's (same steps, grid and bubble), the
torch-spelled text is one torch's own parser and validator accept, the P2P calls derived from
a one-chunk order are the built ones, a bad text is refused in one line naming rank and token,
and ``megatron-ext schedule --format text|torch-text`` / ``--from-text`` print and read it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_ext import cli
from megatron_ext.recipes.schedule import plan_from_recipe
from megatron_ext.schedules.report import Costs
from megatron_ext.schedules.schedule import (
    SchedulePlan,
    build_schedule,
    format_timeline,
)
from megatron_ext.schedules.text import (
    SPELLINGS,
    ScheduleTextError,
    derive_exchanges,
    format_text,
    schedule_from_text,
    schedule_of,
)

RECIPES = Path(__file__).parents[3] / "recipes"


def _cli_plans() -> list[SchedulePlan]:
    """The plans megatron-ext schedule draws from flags: 1F1B, ZB-H1 and interleaved (every
    valid group size), small and uneven sizes included."""
    plans = []
    for pp in range(1, 6):
        for m in range(1, 11):
            plans.append(SchedulePlan(pp=pp, microbatches=m))
            if pp > 1:
                plans.append(SchedulePlan(pp=pp, microbatches=m, schedule="zb-h1"))
            for vpp in (2, 3):
                for group in [None, *range(pp + 1, m + 1)]:
                    plan = SchedulePlan(pp=pp, vpp=vpp, microbatches=m, microbatch_group_size=group)
                    if not plan.problems():
                        plans.append(plan)
    return plans


def _recipe_plans() -> list[tuple[str, SchedulePlan]]:
    """Every shipped recipe's plan, and its zb-h1 variant where ZB-H1 runs."""
    plans = []
    for path in sorted(RECIPES.glob("*.yaml")):
        plan, _ = plan_from_recipe(str(path), [])
        plans.append((path.stem, plan))
        if plan.multimodule is None and plan.vpp is None and plan.pp > 1:
            plans.append((f"{path.stem} zb-h1", dataclasses.replace(plan, schedule="zb-h1")))
    return plans


def _assert_round_trip(plan: SchedulePlan, with_plan: bool, spelling: str = "megatron-ext") -> None:
    built = build_schedule(plan)
    text = format_text(built, "a comment line", spelling)
    back = schedule_from_text(text, plan if with_plan else None)
    ranks = range(len(built.ranks))
    assert [back.computes(r) for r in ranks] == [built.computes(r) for r in ranks]
    if plan.multimodule is None and plan.chunks == 1:
        assert back.ranks == built.ranks  # the derived P2P calls are the built ones
    for costs in (Costs(), Costs(1.0, 3.0, 1.0)):
        timeline, original = costs.simulate(back), costs.simulate(built)
        assert timeline.bubble() == original.bubble()
        assert format_timeline(timeline, back.chunks) == format_timeline(original, built.chunks)
    assert back.peak_in_flight() == built.peak_in_flight()
    assert format_text(back) == format_text(built)
    assert format_text(back, spelling=spelling) == format_text(built, spelling=spelling)


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_every_cli_schedule_round_trips(spelling):
    plans = _cli_plans()
    assert len(plans) > 200
    for plan in plans:
        _assert_round_trip(plan, with_plan=False, spelling=spelling)
        _assert_round_trip(plan, with_plan=True, spelling=spelling)


@pytest.mark.parametrize(
    "name,plan", _recipe_plans(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_shipped_recipe_schedule_round_trips(name, plan):
    # A multi-module text does not carry its modules' links: it is read back with its plan.
    for spelling in SPELLINGS:
        _assert_round_trip(plan, with_plan=True, spelling=spelling)
        if plan.multimodule is None:
            _assert_round_trip(plan, with_plan=False, spelling=spelling)


def test_the_text_is_the_grid_labels_one_line_per_rank():
    text = format_text(build_schedule(SchedulePlan(pp=2, microbatches=3, schedule="zb-h1")))
    assert text == "F0 F1 B0 W0 F2 B1 W1 B2 W2\nF0 B0 F1 B1 W0 F2 B2 W1 W2\n"
    interleaved = format_text(build_schedule(SchedulePlan(pp=2, vpp=2, microbatches=2)))
    assert interleaved.splitlines()[0].split()[:3] == ["F0c0", "F1c0", "F0c1"]


def test_a_different_one_chunk_order_gets_pairing_p2p_calls():
    """Rank 0 runs B2 before W1, rank 1 W0 before B1: the calls pair a send with the
    neighbour's receive, and the simulated bubble follows the new order."""
    plan = SchedulePlan(pp=2, microbatches=3, schedule="zb-h1")
    text = "F0 F1 B0 W0 F2 B1 B2 W1 W2\nF0 B0 F1 W0 B1 F2 B2 W1 W2\n"
    schedule = schedule_from_text(text, plan)
    calls = [s.call for s in schedule.ranks[1] if hasattr(s, "call")]
    assert calls == [
        "recv_forward",
        "send_forward_recv_backward",
        "send_backward_recv_forward",
        "send_forward",  # F1, then W0: the gradient of B1 comes in its own receive
        "recv_backward",
        "send_backward_recv_forward",
        "send_forward_recv_backward",
        "send_backward",
    ]
    assert format_text(schedule) == text
    timeline = Costs().simulate(schedule)
    assert format_timeline(timeline).splitlines()[0] == "rank 0 | F0 F1 .  B0 W0 F2 B1 .  B2 W1 W2"
    assert timeline.bubble() != Costs().simulate(build_schedule(plan)).bubble()


def test_derived_calls_equal_the_built_for_all_warmup_ranks():
    """m < pp - rank: every forward is warm-up (send_forward, then recv_backward)."""
    for pp in range(2, 7):
        for m in range(1, pp + 2):
            for schedule in ("1f1b", "zb-h1"):
                built = build_schedule(SchedulePlan(pp=pp, microbatches=m, schedule=schedule))
                for rank in range(pp):
                    derived = derive_exchanges(built.computes(rank), rank, pp, m)
                    assert derived == built.ranks[rank], (schedule, pp, m, rank)


ZB = SchedulePlan(pp=2, microbatches=3, schedule="zb-h1")
GOOD_RANK_1 = "F0 B0 F1 B1 W0 F2 B2 W1 W2"
BAD_TEXTS = {
    "unknown token": (f"F0 F1 X0 W0 F2 B1 W1 B2 W2\n{GOOD_RANK_1}", "rank 0, token 3 'X0'"),
    "torch's I beside a B": (
        f"F0 F1 I0 W0 F2 B1 W1 B2 W2\n{GOOD_RANK_1}",
        "rank 0, token 6 'B1': in torch's spelling (this text has rank 0, token 3 'I0') B is "
        "the whole backward",
    ),
    "the issue's example, a torch B with I": (
        f"F0 F1 B0 I1 W0 F2 I2 W1 W2\n{GOOD_RANK_1}",
        "rank 0, token 3 'B0': in torch's spelling",
    ),
    "a torch-form B followed by its W": (
        "0F0 0F1 0B0 0W0 0F2 0B1 0W1 0B2 0W2\n1F0 1B0 1F1 1B1 1W0 1F2 1B2 1W1 1W2",
        "rank 0, token 3 '0B0': in torch's spelling (this text has rank 0, token 4 '0W0')",
    ),
    "torch's W before its I": (
        "F0 F1 I0 W0 F2 W1 I1 I2 W2\nF0 I0 F1 I1 W0 F2 I2 W1 W2",
        "rank 0, token 6 'W1': comes before its I1; a backward follows its forward, a W its I",
    ),
    "torch's I missing": (
        "F0 F1 I0 W0 F2 I1 W1 W2\nF0 I0 F1 I1 W0 F2 I2 W1 W2",
        "rank 0, token 8 'W2': comes before its I2",
    ),
    "a stage on another rank": (
        "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2\n1F0 1I0 1F1 1I1 1W0 0F2 1I2 1W1 1W2",
        "rank 1, token 6 '0F2': stage 0 does not run on rank 1, which holds stages 1, 3, ...",
    ),
    "stage and chunk together": (f"0F0c0 F1 B0 W0 F2 B1 W1 B2 W2\n{GOOD_RANK_1}", "token 1"),
    "torch's communication action": (
        f"F0 F1 B0 W0 F2 B1 W1 B2 W2 1SEND_B2\n{GOOD_RANK_1}",
        "rank 0, token 10 '1SEND_B2': torch's communication action",
    ),
    "missing action": ("F0 F1 B0 W0 F2 B1 W1 B2 W2\nF0 B0 F1 B1 W0 F2 B2 W1", "rank 1: 'W2'"),
    "duplicate action": (f"F0 F1 B0 W0 F2 B1 W1 B2 W2 B2\n{GOOD_RANK_1}", "rank 0, token 10"),
    "micro-batch out of range": (f"F0 F1 B0 W0 F2 B1 W1 B2 W2 F3\n{GOOD_RANK_1}", "token 10 'F3'"),
    "backward before forward": (f"B0 F0 F1 W0 F2 B1 W1 B2 W2\n{GOOD_RANK_1}", "token 1 'B0'"),
    "out of micro-batch order": (f"F1 F0 B0 W0 F2 B1 W1 B2 W2\n{GOOD_RANK_1}", "token 1 'F1'"),
    "W in a 1F1B text": (f"F0 F1 B0 W0 F2 B1 W1 B2 W2\n{GOOD_RANK_1}", "rank 0, token 4 'W0'"),
    "dependency cycle": (
        "F0 B0 W0 F1 B1 W1 F2 B2 W2\nF0 F1 B0 W0 B1 W1 F2 B2 W2",
        "rank 0, token 2 'B0': waits for B0 on rank 1",
    ),
    "peak over the limit": (f"F0 F1 F2 B0 W0 B1 W1 B2 W2\n{GOOD_RANK_1}", "token 3 'F2': 3"),
    "too few rank lines": ("F0 F1 B0 W0 F2 B1 W1 B2 W2", "1 rank line(s) for a plan of 2"),
}


@pytest.mark.parametrize("case", sorted(BAD_TEXTS))
def test_bad_text_is_refused_in_one_line_naming_rank_and_token(case):
    text, where = BAD_TEXTS[case]
    plan = dataclasses.replace(ZB, schedule="1f1b") if "1F1B" in case else ZB
    with pytest.raises(ScheduleTextError) as raised:
        schedule_from_text(text, plan)
    message = str(raised.value)
    assert where in message and "\n" not in message, message


def test_an_unknown_token_names_itself_its_rank_line_and_the_letters():
    with pytest.raises(ScheduleTextError) as raised:
        schedule_from_text(f"{GOOD_RANK_1}\nF0 F1 X0 W0", ZB)
    message = str(raised.value)
    assert message.startswith("rank 1, token 3 'X0': not an action; write F (forward), B ")
    assert "I (input gradient), W, B (whole backward)" in message and "\n" not in message


# ---- torch's spelling -----------------------------------------------------------------------
def _torch_actions(text: str):
    from torch.distributed.pipelining.schedules import _Action

    lines = [line for line in text.splitlines() if not line.startswith("#")]
    return {rank: [_Action.from_str(t) for t in line.split()] for rank, line in enumerate(lines)}


@pytest.mark.parametrize(
    "plan",
    [
        SchedulePlan(pp=4, microbatches=8, schedule="zb-h1"),
        SchedulePlan(pp=3, microbatches=5),
        SchedulePlan(pp=2, vpp=3, microbatches=6, microbatch_group_size=3),
        SchedulePlan(pp=4, vpp=2, microbatches=4),
    ],
    ids=lambda p: f"pp{p.pp}-vpp{p.vpp}-m{p.microbatches}-{p.schedule}",
)
def test_torch_parses_and_validates_our_torch_spelled_text(plan):
    """torch's own _Action.from_str reads every token as the same step (stage, kind,
    micro-batch) and its _validate_schedule accepts the order (F before I before W, I and W
    counts equal, every stage on one rank)."""
    from torch.distributed.pipelining.schedules import _ComputationType, _validate_schedule

    built = build_schedule(plan)
    actions = _torch_actions(format_text(built, spelling="torch"))
    split = plan.schedule == "zb-h1"
    kinds = {
        "F": "FORWARD",
        "B": "BACKWARD_INPUT" if split else "FULL_BACKWARD",
        "W": "BACKWARD_WEIGHT",
    }
    for rank, steps in actions.items():
        expected = [
            (step.chunk * plan.pp + rank, _ComputationType[kinds[step.kind]], step.microbatch)
            for step in built.computes(rank)
        ]
        assert [(a.stage_index, a.computation_type, a.microbatch_index) for a in steps] == expected
    stage_ranks = _validate_schedule(actions, plan.pp, plan.pp * plan.chunks, plan.microbatches)
    assert stage_ranks == {s: s % plan.pp for s in range(plan.pp * plan.chunks)}


def test_torch_spelling_reads_as_the_same_schedule():
    ours = "F0 F1 B0 W0 F2 B1 W1 B2 W2\nF0 B0 F1 B1 W0 F2 B2 W1 W2\n"
    torch_letters = ours.replace("B", "I")  # torch's I is our ZB-H1 B
    torch_actions = "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2\n1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2\n"
    torch_csv = torch_actions.replace(" ", ",").replace("0W0,", "0W0,,")  # empty cell: idle
    expected = schedule_from_text(ours)
    for text in (torch_letters, torch_actions, torch_csv):
        assert schedule_from_text(text) == expected
        assert schedule_from_text(text, ZB) == expected
    assert format_text(expected, spelling="torch") == torch_actions
    one_f_one_b = "0F0 0F1 0B0 0F2 0B1 0B2\n1F0 1B0 1F1 1B1 1F2 1B2\n"  # torch's B: whole
    assert schedule_from_text(one_f_one_b) == build_schedule(SchedulePlan(pp=2, microbatches=3))


def test_zb_h1_runs_a_torch_spelled_order_file(tmp_path):
    """The runtime's reader (schedule_of: parallelism.schedule_file, pipeline_schedule_file)
    takes torch's spelling and gives the schedule, P2P calls included, that ours gives."""
    plan = SchedulePlan(pp=4, microbatches=6, schedule="zb-h1")
    built = build_schedule(plan)
    path = tmp_path / "order.csv"
    path.write_text(format_text(built, spelling="torch").replace(" ", ","))
    assert schedule_of(dataclasses.replace(plan, order_file=str(path))) == built


def test_a_torch_split_text_for_a_1f1b_plan_says_to_write_whole_backwards():
    plan = SchedulePlan(pp=2, microbatches=3)
    with pytest.raises(ScheduleTextError, match=r"token 4 'W0': W steps belong .* \(write B0, not"):
        schedule_from_text("F0 F1 I0 W0 F2 I1 W1 I2 W2\nF0 I0 F1 I1 W0 F2 I2 W1 W2", plan)


def test_p2p_calls_that_cannot_pair_are_refused():
    """Each order passes the compute dependencies, but under blocking exchanges rank 0's
    send_forward of F1 waits for rank 1's receive, which comes after rank 1's send_backward
    of B0, which waits for rank 0's receive behind that send_forward."""
    plan = SchedulePlan(pp=4, microbatches=2, schedule="zb-h1")
    text = "F0 F1 B0 W0 B1 W1\n" + "F0 B0 W0 F1 B1 W1\n" * 3
    with pytest.raises(ScheduleTextError, match=r"rank 0, token 2 'F1': the P2P call send_forward"):
        schedule_from_text(text, plan)


def test_interleaved_text_must_be_megatrons_order():
    plan = SchedulePlan(pp=2, vpp=2, microbatches=4)
    lines = format_text(build_schedule(plan)).splitlines()
    tokens = lines[1].split()
    tokens[0], tokens[1] = tokens[1], tokens[0]  # F1c0 before F0c0 on rank 1
    with pytest.raises(ScheduleTextError, match="rank 1, token 1"):
        schedule_from_text("\n".join([lines[0], " ".join(tokens)]), plan)
    swapped = lines[0].split()
    i = swapped.index("W0") if "W0" in swapped else swapped.index("F0c1")
    swapped[i - 1], swapped[i] = swapped[i], swapped[i - 1]  # chunk 1 earlier: still complete
    with pytest.raises(ScheduleTextError, match="megatron-core's interleaved schedule runs"):
        schedule_from_text("\n".join([" ".join(swapped), lines[1]]), plan)


# ---- the command ----------------------------------------------------------------------------
def _report_without_order_line(out: str) -> list[str]:
    return [line for line in out.splitlines() if not line.startswith("order: ")]


@pytest.mark.parametrize(
    "flags",
    [
        ["--pp", "4", "--microbatches", "8", "--schedule", "zb-h1"],
        ["--pp", "2", "--vpp", "2", "--microbatches", "6", "--microbatch-group-size", "3"],
        ["--pp", "3", "--microbatches", "5"],
    ],
)
def test_cli_prints_text_and_reads_it_back(capsys, tmp_path, flags):
    assert cli.main(["schedule", *flags, "--format", "text"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# ")
    path = tmp_path / "order.txt"
    path.write_text(text)
    assert cli.main(["schedule", *flags]) == 0
    original = capsys.readouterr().out
    assert cli.main(["schedule", "--from-text", str(path)]) == 0
    read_back = capsys.readouterr().out
    assert f"order: from {path}, the built schedule's exactly" in read_back
    assert _report_without_order_line(read_back) == original.splitlines()
    assert cli.main(["schedule", "--from-text", str(path), "--format", "text"]) == 0
    assert capsys.readouterr().out == text


@pytest.mark.parametrize(
    "flags",
    [
        ["--pp", "4", "--microbatches", "8", "--schedule", "zb-h1"],
        ["--pp", "2", "--vpp", "2", "--microbatches", "6", "--microbatch-group-size", "3"],
    ],
)
def test_cli_reads_torch_text_as_the_same_grid_and_bubble(capsys, tmp_path, flags):
    assert cli.main(["schedule", *flags, "--format", "torch-text"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[1].split()[0] == "0F0"
    path = tmp_path / "torch_order.txt"
    path.write_text(text)
    assert cli.main(["schedule", *flags]) == 0
    original = capsys.readouterr().out
    assert cli.main(["schedule", "--from-text", str(path)]) == 0
    read_back = capsys.readouterr().out
    assert f"order: from {path}, the built schedule's exactly" in read_back
    assert _report_without_order_line(read_back) == original.splitlines()
    assert cli.main(["schedule", "--from-text", str(path), "--format", "text"]) == 0
    from_torch = capsys.readouterr().out
    assert cli.main(["schedule", *flags, "--format", "text"]) == 0
    assert from_torch == capsys.readouterr().out  # torch's spelling in, ours out


def test_cli_reports_a_different_order_and_where_it_differs(capsys, tmp_path):
    path = tmp_path / "late_w.txt"
    path.write_text("F0 F1 B0 W0 F2 B1 B2 W1 W2\nF0 B0 F1 W0 B1 F2 B2 W1 W2\n")
    assert cli.main(["schedule", "--from-text", str(path)]) == 0
    out = capsys.readouterr().out
    assert "differs from the built schedule first at rank 0, token 7: B2 (built: W1)" in out
    assert "rank 0 | F0 F1 .  B0 W0 F2 B1 .  B2 W1 W2" in out


def test_cli_refuses_a_bad_text_in_one_line(capsys, tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text("F0 F1 B0 W0 F2 B1 W1 B2 W2\nF0 B0 F1 B1 W0 F2 B2 W1\n")
    assert cli.main(["schedule", "--from-text", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--from-text {path}: rank 1: 'W2' is missing" in err
    # checked against the flags' plan: 3 micro-batches named, 4 asked for
    assert cli.main(["schedule", "--from-text", str(path), "--pp", "2", "--microbatches", "4"]) == 2
    assert cli.main(["schedule", "--from-text", str(tmp_path / "none.txt")]) == 2
    assert "none.txt: no such file" in capsys.readouterr().err
