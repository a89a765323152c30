"""The node layout of a multi-node Slurm job (megatron_ext.launch.nodes): ranks per node,
megatron's coordinates of each rank, the refusals before submitting, the lost-node lines."""

from __future__ import annotations

import subprocess
import sys

from megatron_ext.launch import nodes
from megatron_ext.recipes import load
from megatron_ext.recipes.prepare import node_grids, prepare
from megatron_ext.runs.submit import SlurmOptions, build_job

from recipe_texts import REPO_ROOT, shared_build_dir

TP2_PP2_SP = REPO_ROOT / "recipes/gpt_mhc_tp2_pp2_sp.yaml"


def _megatron_order(tp, cp, dp, pp):
    """The reference: megatron's RankGenerator order tp-cp-ep-dp-pp, written out as loops."""
    ranks = {}
    for p in range(pp):
        for d in range(dp):
            for c in range(cp):
                for t in range(tp):
                    ranks[len(ranks)] = {"tp": t, "cp": c, "dp": d, "pp": p}
    return ranks


def test_gpt_coordinates_follow_megatrons_rank_order():
    grid = nodes.Grid("model", 0, (("tp", 2), ("cp", 2), ("dp", 2), ("pp", 2)))
    expected = _megatron_order(2, 2, 2, 2)
    assert {r: grid.coordinates(r) for r in range(16)} == expected


def test_tp2_pp2_over_two_nodes_puts_a_tp_group_and_a_stage_on_each_node():
    recipe = load(TP2_PP2_SP).recipe
    layout = nodes.layout(node_grids(recipe), 2, 2)
    assert [list(layout.ranks_on(n)) for n in range(2)] == [[0, 1], [2, 3]]
    assert layout.tp_groups_across_nodes() == []
    assert layout.lines()[1:] == [
        "  node 0 (ranks 0-1):",
        "    rank 0: tp 0 cp 0 dp 0 pp 0",
        "    rank 1: tp 1 cp 0 dp 0 pp 0",
        "  node 1 (ranks 2-3):",
        "    rank 2: tp 0 cp 0 dp 0 pp 1",
        "    rank 3: tp 1 cp 0 dp 0 pp 1",
    ]
    crossing = nodes.layout(node_grids(recipe), 4, 1)
    assert crossing.tp_groups_across_nodes() == [("model", [0, 1]), ("model", [2, 3])]
    assert "spans nodes" in crossing.lines()[-1]


def test_multimodule_modules_land_on_their_own_nodes():
    recipe = load(REPO_ROOT / "recipes/multimodule_encoder_llm_mhc_pp2.yaml").recipe
    layout = nodes.layout(node_grids(recipe), 2, 2)
    assert [layout.describe_rank(r) for r in range(4)] == [
        "rank 0: vision_encoder tp 0 cp 0 pp 0 dp 0",
        "rank 1: vision_encoder tp 0 cp 0 pp 0 dp 1",
        "rank 2: llm tp 0 cp 0 pp 0 dp 0",
        "rank 3: llm tp 0 cp 0 pp 1 dp 0",
    ]


def test_refusals_name_the_field_and_the_fix(tmp_path):
    grid = (nodes.Grid("model", 0, (("tp", 4), ("cp", 1), ("dp", 1), ("pp", 2))),)
    assert nodes.layout_problems(8, 2, 4, grid, tp_within_node=True) == []
    (too_big,) = nodes.layout_problems(8, 4, None, grid, tp_within_node=True)
    assert too_big.startswith("launch.slurm.tp_within_node: model tp=4 is larger than a node's 2")
    assert "--nodes 2 or less" in too_big and "tp_within_node: false" in too_big
    assert nodes.layout_problems(8, 4, None, grid, tp_within_node=False) == []
    grid3 = (nodes.Grid("model", 0, (("tp", 3), ("cp", 1), ("dp", 1), ("pp", 4))),)
    (straddles,) = nodes.layout_problems(12, 3, None, grid3, tp_within_node=True)
    assert "does not divide a node's 4 ranks" in straddles
    (count,) = nodes.layout_problems(8, 2, 2, grid, tp_within_node=False)
    assert count.startswith("--nodes / launch.nodes: 2 node(s) x 2 task(s) per node = 4 tasks")
    # through submit, before anything is written: the recipe's own field, one line
    loaded = load(TP2_PP2_SP, overrides=["launch.slurm.tp_within_node=true"])
    job, problems = build_job(
        prepare(loaded, megatron_checks=False, check_pickles=False),
        shared_build_dir() / "x",
        SlurmOptions(nodes=4),
    )
    assert job is None and len(problems) == 1 and "tp_within_node" in problems[0], problems
    job, problems = build_job(
        prepare(loaded, megatron_checks=False, check_pickles=False),
        tmp_path / "run",
        SlurmOptions(nodes=2),
    )
    assert job is None and problems[0].startswith(f"run directory {tmp_path}/run is node-local")


def test_submit_dry_run_prints_the_node_layout():
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext.cli", "submit", str(TP2_PP2_SP), "--slurm"]
        + ["--platform", "cpu", "--nodes", "2", "--dry-run", "--skip-megatron-checks"]
        + ["--run-dir", str(shared_build_dir() / "dry")],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "node 1 (ranks 2-3):\n    rank 2: tp 0 cp 0 dp 0 pp 1" in proc.stderr
    assert proc.stdout.startswith("#!/bin/bash") and "#SBATCH --nodes=2" in proc.stdout
    assert "node layout:" in proc.stdout  # the job prints its real layout too


def test_lost_nodes_are_named_with_their_ranks(tmp_path):
    out = tmp_path / "slurm-7.out"
    out.write_text(
        f"{nodes.LAYOUT_PREFIX} node1=0-1 node2=2-3 (batch script on node1, MASTER_ADDR node1)\n"
        "srun: error: Node failure on node2\n"
        "slurmstepd-node1: error: *** JOB 7 ON node1 CANCELLED AT 2026-12-03T10:58:45 DUE TO "
        "NODE FAILURE, SEE SLURMCTLD LOG FOR DETAILS ***\n"
    )
    assert nodes.lost_nodes(out) == [
        "node node2 lost (ranks 2-3): Slurm declared it failed (its slurmd stopped answering)"
    ]
    out.write_text(f"{nodes.LAYOUT_PREFIX} node1=0-1 node2=2-3\nall fine\n")
    assert nodes.lost_nodes(out) == []
    assert nodes.lost_nodes(tmp_path / "missing.out") == []


def test_placement_lines_round_trip(monkeypatch, capsys):
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    nodes.report_placement({"tp": 1, "pp": 1}, module="llm")
    (place,) = nodes.parse_placements(capsys.readouterr().out)
    assert place["rank"] == "3" and place["node"] == "1" and place["module"] == "llm"
    assert (place["tp"], place["pp"], place["local_rank"]) == ("1", "1", "1")
    monkeypatch.delenv("SLURM_STEP_ID")
    nodes.report_placement({"tp": 0})
    assert capsys.readouterr().out == ""  # outside Slurm: silent


def test_megatron_placement_lines_carry_the_expert_parallel_coordinate(monkeypatch, capsys):
    """Issue 41, item 10: the placement lines showed tp/cp/dp/pp but no ep."""
    from megatron.core import parallel_state as ps

    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("RANK", "5")
    coordinates = {
        "get_tensor_model_parallel_rank": 1,
        "get_context_parallel_rank": 0,
        "get_data_parallel_rank": 2,
        "get_pipeline_model_parallel_rank": 1,
        "get_expert_model_parallel_rank": 3,
    }
    for getter, value in coordinates.items():
        monkeypatch.setattr(ps, getter, lambda value=value: value)
    nodes.report_megatron_placement()
    (place,) = nodes.parse_placements(capsys.readouterr().out)
    assert (place["tp"], place["cp"], place["dp"], place["pp"], place["ep"]) == (
        "1",
        "0",
        "2",
        "1",
        "3",
    )
