"""Recipes -> Megatron command lines, and the plan checks that need no process."""

import pytest

from megatron_ext.recipes import load
from megatron_ext.recipes.checks import plan_problems
from megatron_ext.recipes.command import megatron_args, run_environment, save_args
from megatron_ext.recipes.loader import parse_yaml
from megatron_ext.recipes.schema import layout_stages

from recipe_texts import MINIMAL, REPO_ROOT


def _flags(args: list[str]) -> dict[str, list[str]]:
    """--flag -> its values ([] for a bare flag)."""
    out, current = {}, None
    for a in args:
        if a.startswith("--"):
            current = a
            out[a] = []
        else:
            out[current].append(a)
    return out


def _problems(path, overrides=(), platform="cpu") -> list[str]:
    return [str(p) for p in plan_problems(load(path, platform, list(overrides)))]


def test_the_baseline_recipe_becomes_megatrons_flags():
    flags = _flags(megatron_args(load(REPO_ROOT / "recipes/gpt_tp2_pp2.yaml")))
    assert flags["--tensor-model-parallel-size"] == ["2"]
    assert flags["--pipeline-model-parallel-size"] == ["2"]
    assert flags["--num-layers"] == ["4"] and flags["--hidden-size"] == ["64"]
    assert flags["--train-iters"] == ["8"] and flags["--lr"] == ["0.001"]
    assert flags["--lr-decay-iters"] == ["8"], "the schedule spans the run unless the recipe says"
    assert flags["--mock-data"] == [] and flags["--tokenizer-type"] == ["NullTokenizer"]
    assert flags["--log-interval"] == ["1"], "golden values need every step"
    assert "--log-num-zeros-in-grad" in flags and flags["--distributed-backend"] == ["gloo"]
    assert flags["--eval-iters"] == ["0"], "no evaluation unless training.eval_interval is set"
    assert not any(f.startswith("--enable-mhc") or f.startswith("--mhc") for f in flags)


def test_mhc_fields_become_upstreams_flag_spellings():
    flags = _flags(megatron_args(load(REPO_ROOT / "recipes/gpt_mhc_tp2_pp2_sp.yaml")))
    assert flags["--enable-mhc-connections"] == [] and flags["--sequence-parallel"] == []
    assert flags["--mhc-num-residual-streams"] == ["4"]
    assert flags["--mhc-sinkhorn-iterations"] == ["20"]
    assert flags["--mhc-init-gating-factor"] == ["0.01"]
    assert flags["--recompute-granularity"] == ["selective"]
    assert flags["--recompute-modules"] == ["mhc"] and flags["--mhc-recompute-layer-num"] == ["1"]
    assert flags["--log-mhc-stats"] == [] and "--mhc-h-res-method" not in flags  # sinkhorn
    birkhoff = load(
        REPO_ROOT / "recipes/gpt_mhc_tp2_pp2_sp.yaml", "cpu", ["model.mhc.h_res_method=birkhoff"]
    )
    assert _flags(megatron_args(birkhoff))["--mhc-h-res-method"] == ["birkhoff"]
    assert "--mhc-variant" not in flags  # megatron, the default
    v4 = load(REPO_ROOT / "recipes/gpt_mhc_v4_moe_mla_pp2.yaml")
    assert _flags(megatron_args(v4))["--mhc-variant"] == ["deepseek-v4"]


def test_virtual_stages_come_from_vpp_the_layout_or_the_hybrid_pattern():
    vpp = load(REPO_ROOT / "recipes/gpt_mhc_pp4_vpp2.yaml")
    assert _flags(megatron_args(vpp))["--num-virtual-stages-per-pipeline-rank"] == ["2"]
    layout = load(REPO_ROOT / "recipes/gpt_mhc_pp2_standalone_embedding_loss.yaml")
    flags = _flags(megatron_args(layout))
    assert flags["--pipeline-model-parallel-layout"] == ["E|tt|tt|L"]
    assert "--num-virtual-stages-per-pipeline-rank" not in flags, "megatron rejects both together"
    assert layout.recipe.virtual_stages == 2
    hybrid = load(REPO_ROOT / "recipes/hybrid_mhc_tp1_pp2_vpp2_empty_mtp.yaml")
    flags = _flags(megatron_args(hybrid))
    assert flags["--hybrid-layer-pattern"] == ["*E|*-||/*-"]
    assert "--num-layers" not in flags and "--mtp-num-layers" not in flags, "the pattern says both"
    assert hybrid.recipe.virtual_stages == 2


def test_ckpt_resume_saves_at_half_and_exits_at_the_end():
    loaded = load(REPO_ROOT / "recipes/gpt_mhc_pp2_standalone_embedding_loss.yaml")
    flags = _flags(save_args(loaded, "/ck"))
    assert flags == {
        "--save": ["/ck"],
        "--save-interval": ["5"],
        "--ckpt-format": ["torch_dist"],
        "--exit-interval": ["10"],
    }


def test_extra_args_and_precision(write_recipe):
    loaded = load(
        write_recipe(MINIMAL),
        overrides=[
            "training.dtype=bf16",
            "extra_args={--use-flash-attn: true, --no-x: false, --m: [a, b], --k: 2}",
        ],
    )
    flags = _flags(megatron_args(loaded))
    assert "--bf16" in flags and "--fp16" not in flags
    assert flags["--use-flash-attn"] == [] and "--no-x" not in flags
    assert flags["--m"] == ["a", "b"] and flags["--k"] == ["2"]


def test_cpu_runs_hide_gpus_and_use_one_thread_per_rank(write_recipe):
    env = run_environment(load(write_recipe(MINIMAL), overrides=["launch.env={A: 1, B: true}"]))
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["OMP_NUM_THREADS"] == "1"
    assert env["A"] == "1" and env["B"] == "1"


@pytest.mark.parametrize(
    "layout, stages",
    [
        ("E|tt|tt|L", ["E", "tt", "tt", "L"]),
        ("Et*3|(tt|)*2,m|L", ["Ettt", "tt", "tt", "m", "L"]),
        ("E|(tt|)*6,L", ["E"] + ["tt"] * 6 + ["L"]),
    ],
)
def test_layouts_unroll_like_megatron(layout, stages):
    assert layout_stages(layout) == stages


def test_the_shipped_recipes_have_no_plan_problems(example_data):
    for path in sorted((REPO_ROOT / "recipes").glob("*.yaml")):
        for platform in ("cpu", *(parse_yaml(path.read_text()).get("platforms") or {})):
            assert _problems(path, platform=platform) == [], (path.name, platform)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["parallelism.sp=true", "parallelism.tp=1"],
            "parallelism.sp: sequence parallelism needs tp > 1",
        ),
        (
            ["parallelism.sp=true", "model.seq_length=33", "model.max_position_embeddings=64"],
            "model.seq_length: 33 is not divisible by tp=2",
        ),
        (
            ["parallelism.pp=3"],
            "model.num_layers: 4 layers do not split over pp(3) * vpp(1) = 3 model chunks",
        ),
        (
            ["parallelism.vpp=4"],
            "model.num_layers: 4 layers do not split over pp(2) * vpp(4) = 8 model chunks",
        ),
        (
            ["model.num_attention_heads=3"],
            "model.num_attention_heads: 3 heads do not split over tp=2",
        ),
        (  # issue 25 item 19: found ~80 s into start-up before
            ["model.ffn_hidden_size=255"],
            "model.ffn_hidden_size: 255 does not split over tp=2 (the MLP's columns are "
            "divided between the tensor-parallel ranks)",
        ),
        (
            ["training.global_batch_size=6", "parallelism.dp=2"],
            "training.global_batch_size: 6 is not a multiple of micro_batch_size(2) * dp(2)",
        ),
        (["launch.nproc=8"], "launch.nproc: 8 ranks, but tp(2) * pp(2) * cp(1) * dp(1) = 4"),
        (
            ["parallelism.cp=2", "model.seq_length=34", "model.max_position_embeddings=64"],
            "model.seq_length: 34 is not divisible by 2 * cp = 4 (context parallelism's load-balanced split)",
        ),
        (
            [
                "parallelism.cp=2",
                "parallelism.sp=true",
                "model.seq_length=36",
                "model.max_position_embeddings=64",
            ],
            "model.seq_length: 36 is not divisible by 2 * cp * tp = 8",
        ),
        (
            ["parallelism.cp=2", "extra_args={--reset-attention-mask: true}"],
            "extra_args.--reset-attention-mask: per-document attention masks with cp=2: megatron-ext's "
            "local context-parallel attention supports causal masks only",
        ),
        (
            ["parallelism.cp=2", "extra_args={--window-size: [8, 0]}"],
            "extra_args.--window-size: sliding-window attention with cp=2",
        ),
        (
            ["model.pipeline_layout=E|tt|t|L"],
            "model.pipeline_layout: places 3 transformer layers ('t'), but num_layers is 4",
        ),
        (
            ["model.pipeline_layout=E|tt|tt|L", "parallelism.vpp=3"],
            "parallelism.vpp: 3 disagrees with the layout",
        ),
        (["model.pipeline_layout=E|tx|tt|L"], "model.pipeline_layout: unknown symbol(s) 'x'"),
        (
            ["model.mtp_num_layers=1"],
            "model.position_embedding: multi-token prediction needs rope or none",
        ),
        (["parallelism.ep=2"], "parallelism.ep: ep=2 needs model.num_experts"),
        (
            ["model.mhc.recompute=true"],
            "model.mhc.recompute: mHC recompute needs model.mhc.enabled: true",
        ),
        (
            ["test.type=ckpt-resume", "training.iterations=7"],
            "training.iterations: ckpt-resume saves at iterations/2",
        ),
        (["data.type=indexed"], "data.paths: indexed data needs at least one PREFIX"),
        (
            ["data.type=indexed", "data.paths=[/nowhere/corpus]"],
            "data.paths[0]: /nowhere/corpus.bin and /nowhere/corpus.idx not found",
        ),
        (["test.metrics=[lm loss, loss]"], "test.metrics: unknown metric 'loss'"),
        (
            ["test.metrics=[lm loss, mtp_1 loss]"],
            "test.metrics: 'mtp_1 loss' is not logged: the model has 0 MTP depth(s)",
        ),
        (
            ['test.tolerances."lm loss".rtl=1'],
            "test.tolerances.lm loss.rtl: unknown key (did you mean 'rtol'?)",
        ),
        (
            ["extra_args={use-flash-attn: true}"],
            "extra_args.use-flash-attn: keys are Megatron flags spelled with their dashes",
        ),
        (
            ["model.hybrid_layer_pattern=*-|*-"],
            "model.hybrid_layer_pattern: is for model.type: hybrid",
        ),
        # accepted before, then wrong only after the ranks started (or after training)
        (["model.hidden_dropout=1.5"], "model.hidden_dropout: is a probability in [0, 1), got 1.5"),
        (
            ["model.attention_dropout=-0.1"],
            "model.attention_dropout: is a probability in [0, 1), got -0.1",
        ),
        (
            ['test.tolerances."lm loss".rtol=abc'],
            "test.tolerances.lm loss.rtol: is a finite number >= 0, got 'abc'",
        ),
        (
            ['test.tolerances."lm loss".atol=-1'],
            "test.tolerances.lm loss.atol: is a finite number >= 0, got -1",
        ),
        (
            ['test.tolerances."lm loss".max_failing_steps=1.5'],
            "test.tolerances.lm loss.max_failing_steps: is a whole number of steps >= 0, got 1.5",
        ),
        (
            ['test.tolerances."lm loss".deterministic=maybe'],
            "test.tolerances.lm loss.deterministic: is true or false",
        ),
        (
            ["test.golden_values=golden/{foo}.json"],
            "test.golden_values: 'golden/{foo}.json': unknown placeholder {foo}; only {name} and {platform} are filled in",
        ),
        (
            ["test.golden_values=golden/{name.json"],
            "test.golden_values: 'golden/{name.json': expected '}'",
        ),
    ],
)
def test_plan_problems_name_the_fields_values_and_fix(write_recipe, overrides, message):
    problems = _problems(write_recipe(MINIMAL), overrides)
    assert any(message in p for p in problems), problems


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.hybrid_layer_pattern=*-|*-|*-"], "3 pipeline segments do not split over pp=2"),
        (
            ["parallelism.vpp=2"],
            "parallelism.vpp: 2 disagrees with the pattern: 2 segments over pp=2 give vpp=1",
        ),
        (["model.hybrid_layer_pattern=M-|M-"], "Mamba layers ('M') need mamba_ssm's CUDA kernels"),
        (["model.hybrid_layer_pattern=*-|*x"], "unknown symbol(s) 'x'"),
        (["model.hybrid_layer_pattern=*-|*-/*-/*"], "every MTP depth must repeat the same pattern"),
        (["model.mtp_num_layers=1"], "leave mtp_num_layers null"),
        (["model.pipeline_layout=E|tt|tt|L"], "model.pipeline_layout: is for GPT"),
        (
            ["model.position_embedding=learned_absolute"],
            "multi-token prediction needs rope or none",
        ),
    ],
)
def test_hybrid_pattern_checks(write_recipe, overrides, message):
    hybrid = MINIMAL.replace(
        "model: {type: gpt, num_layers: 4,",
        "model: {type: hybrid, hybrid_layer_pattern: '*-|*-/*-', position_embedding: rope,",
    )
    problems = _problems(write_recipe(hybrid), overrides)
    assert any(message in p for p in problems), problems


def test_a_multimodule_recipe_names_its_entry_and_ranks(write_recipe):
    text = """
version: 1
model: {type: multimodule, modules: {encoder: {tp: 1}, llm: {pp: 2}}, topology: {encoder: [llm]}}
training: {iterations: 4}
"""
    problems = _problems(write_recipe(text))
    assert any(
        p.startswith("model.entry: a multimodule recipe names its training module")
        for p in problems
    )
    assert any(
        p.startswith("launch.nproc: a multimodule recipe states its number of ranks")
        for p in problems
    )
    loaded = load(write_recipe(text), overrides=["model.entry=my.train", "launch.nproc=3"])
    assert _problems(loaded.source, ["model.entry=my.train", "launch.nproc=3"]) == []
    flags = _flags(megatron_args(loaded))
    assert flags["--recipe"] == ["@RECIPE@"], "the run dir's recipe.yaml replaces it at launch"
    assert "--tensor-model-parallel-size" not in flags and flags["--train-iters"] == ["4"]
    assert loaded.recipe.world_size == 3 and loaded.recipe.entry == "my.train"
