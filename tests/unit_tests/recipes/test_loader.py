"""Recipes: YAML, schema, platform overlays and Megatron-Bridge-style overrides."""

import pytest

from megatron_ext.recipes import RecipeError, load
from megatron_ext.recipes.loader import dump, parse_yaml, resolve
from megatron_ext.recipes.schema import documented_fields

from recipe_texts import MINIMAL, RECIPES


def _problems(exc: RecipeError) -> list[str]:
    return [str(p) for p in exc.problems]


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_shipped_recipe_loads_on_each_of_its_platforms(path):
    raw = parse_yaml(path.read_text())
    assert raw["version"] == 1
    for platform in ["cpu", *raw.get("platforms", {})]:
        loaded = load(path, platform)
        assert loaded.name == path.stem, "a recipe's name is its file name"
        assert loaded.recipe.launch.device == ("cpu" if platform == "cpu" else "gpu")


def test_defaults_fill_what_a_recipe_leaves_out(write_recipe):
    recipe = load(write_recipe(MINIMAL)).recipe
    assert recipe.training.seed == 1234 and recipe.training.dtype == "fp32"
    assert recipe.data.type == "mock" and recipe.data.tokenizer.type == "NullTokenizer"
    assert recipe.test.metrics == ["lm loss", "num-zeros"]  # Megatron-LM's default METRICS
    assert recipe.model.mhc.enabled is False
    assert recipe.world_size == 4 and recipe.entry == "megatron_ext.pretrain_gpt"


def test_platform_overlay_merges_over_the_top_level_sections(write_recipe):
    loaded = load(write_recipe(MINIMAL), platform="big")
    r = loaded.recipe
    assert (r.model.num_layers, r.model.hidden_size) == (12, 64), (
        "overlay keys replace, others stay"
    )
    assert (r.parallelism.tp, r.parallelism.dp, r.world_size) == (2, 2, 8)
    assert loaded.golden_path().name == "golden_values_big.json"


def test_unknown_platform_is_reported_with_the_known_ones(write_recipe):
    with pytest.raises(RecipeError) as exc:
        load(write_recipe(MINIMAL), platform="bigg")
    assert "platform 'bigg' is not defined by this recipe (its platforms: cpu, big)" in str(
        exc.value
    )


def test_every_schema_problem_is_reported_at_once_with_its_path(write_recipe):
    text = MINIMAL.replace("parallelism: {tp: 2, pp: 2}", "parallelism: {tp: two, ppp: 2, sp: 1}")
    text = text.replace("training: {", "training: {dtype: fp8, ")
    with pytest.raises(RecipeError) as exc:
        load(write_recipe(text))
    problems = _problems(exc.value)
    assert "parallelism.tp: must be an integer, got 'two'" in problems
    assert "parallelism.ppp: unknown key (did you mean 'pp'?)" in problems
    assert "parallelism.sp: must be true or false, got 1" in problems
    assert "training.dtype: must be one of 'fp32', 'bf16', 'fp16', got 'fp8'" in problems


def test_problems_inside_a_platform_overlay_are_reported_too(write_recipe):
    text = MINIMAL.replace("launch: {device: gpu}", "launch: {device: tpu}")
    with pytest.raises(RecipeError) as exc:
        load(write_recipe(text))
    assert "platforms.big.launch.device: must be one of 'cpu', 'gpu', got 'tpu'" in _problems(
        exc.value
    )


@pytest.mark.parametrize(
    "version, message",
    [
        (None, "version: missing; this megatron-ext reads version: 1"),
        (2, "version: 2 is not supported; this megatron-ext reads version: 1"),
    ],
)
def test_the_schema_version_is_required_and_checked(write_recipe, version, message):
    text = MINIMAL.replace("version: 1", "" if version is None else f"version: {version}")
    with pytest.raises(RecipeError) as exc:
        load(write_recipe(text))
    assert message in _problems(exc.value)


def test_overrides_set_fields_with_yaml_typed_values(write_recipe):
    loaded = load(
        write_recipe(MINIMAL),
        overrides=[
            "parallelism.pp=4",
            "training.iterations=20",
            "training.lr=3e-4",
            "model.mhc.enabled=true",
            "model.pipeline_layout=E|tt|tt|L",
            "+training.seed=7",
            'test.tolerances."lm loss".rtol=1e-3',
            "extra_args.--use-flash-attn=true",
            "test.metrics=[lm loss]",
        ],
    )
    r = loaded.recipe
    assert r.parallelism.pp == 4 and r.training.iterations == 20 and r.training.seed == 7
    assert r.training.lr == 3e-4 and isinstance(r.training.lr, float), "1e-3 style is a number"
    assert r.model.mhc.enabled is True and r.model.pipeline_layout == "E|tt|tt|L"
    assert r.test.tolerances == {"lm loss": {"rtol": 1e-3}}
    assert r.extra_args == {"--use-flash-attn": True} and r.test.metrics == ["lm loss"]


def test_a_tilde_override_restores_the_default(write_recipe):
    r = load(write_recipe(MINIMAL), overrides=["~parallelism.tp"]).recipe
    assert r.parallelism.tp == 1


@pytest.mark.parametrize(
    "override, message",
    [
        ("parallelism.ppp=4", "unknown key 'parallelism.ppp' (did you mean 'pp'?)"),
        ("modle.num_layers=4", "unknown key 'modle' (did you mean 'model'?)"),
        ("training.iterations", "expected KEY=VALUE, +KEY=VALUE or ~KEY"),
        ("platforms.big.model.num_layers=2", "platforms are chosen with --platform"),
        ("training.iterations=ten", "training.iterations: must be an integer, got 'ten'"),
    ],
)
def test_bad_overrides_are_reported(write_recipe, override, message):
    with pytest.raises(RecipeError) as exc:
        load(write_recipe(MINIMAL), overrides=[override])
    assert any(message in p for p in _problems(exc.value)), _problems(exc.value)


def test_overrides_apply_after_the_platform_overlay(write_recipe):
    r = load(write_recipe(MINIMAL), platform="big", overrides=["model.num_layers=6"]).recipe
    assert r.model.num_layers == 6


@pytest.mark.parametrize(
    "overrides, changes_numerics",
    [
        ([], False),
        (["test.type=ckpt-resume", "launch.timeout_s=10", "launch.slurm.partition=batch"], False),
        (["training.iterations=20"], True),
        (["parallelism.pp=4"], True),
        (["launch.env.FOO=1"], True),
    ],
)
def test_overrides_that_change_numerics_are_recognised(write_recipe, overrides, changes_numerics):
    assert load(write_recipe(MINIMAL), overrides=overrides).numerics_overridden is changes_numerics


def test_the_resolved_dump_loads_back_to_the_same_recipe(write_recipe, tmp_path):
    loaded = load(write_recipe(MINIMAL), platform="big", overrides=["training.iterations=6"])
    text = dump(loaded)
    assert "# platform: big" in text and "# overrides: training.iterations=6" in text
    again = resolve(parse_yaml(text))[0]
    assert again.training == loaded.recipe.training and again.model == loaded.recipe.model
    assert again.platforms == {} and again.name == "r"


def test_the_schema_documents_every_leaf_field():
    rows = documented_fields()
    paths = {row[0] for row in rows}
    assert {
        "model.mhc.enabled",
        "parallelism.vpp",
        "training.lr_schedule",
        "test.type",
        "launch.slurm.container_image",
        "data.tokenizer.vocab_size",
    } <= paths
    assert all(doc for _, _, _, doc in rows), [row for row in rows if not row[3]]


HOSTILE_DOCUMENTS = {
    "duplicate key": (
        MINIMAL + "description: one\ndescription: two\n",
        "not valid YAML: duplicate key 'description' (the first value would be silently replaced) (line",
    ),
    "alias bomb": (
        "a: &a [x, x, x, x, x, x, x, x, x]\n"
        + "".join(
            f"{n}: &{n} [{', '.join(['*' + p] * 9)}]\n"
            for p, n in zip("abcdefgh", "bcdefghi", strict=True)
        ),
        "refused as an alias bomb",
    ),
    "deep nesting": ("a: " + "[" * 3000 + "]" * 3000 + "\n", "nested deeper than 32 levels"),
    "infinite float": (
        MINIMAL.replace("training: {", "training: {lr: .inf, "),
        "training.lr: must be a finite number, got inf",
    ),
    "nan float": (
        MINIMAL.replace("training: {", "training: {lr: .nan, "),
        "training.lr: must be a finite number, got nan",
    ),
}


@pytest.mark.parametrize("case", HOSTILE_DOCUMENTS)
def test_hostile_documents_give_one_line_errors(write_recipe, case):
    text, message = HOSTILE_DOCUMENTS[case]
    with pytest.raises(RecipeError) as error:
        load(write_recipe(text))
    lines = [str(p) for p in error.value.problems]
    assert any(message in line for line in lines), lines
    assert all("\n" not in line for line in lines)


def test_non_utf8_bytes_are_a_recipe_error(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_bytes(MINIMAL.encode() + b"description: \xff\xfe\n")
    with pytest.raises(RecipeError, match=r"not UTF-8 text: byte 0xff at offset \d+"):
        load(path)


def test_non_finite_override_is_a_recipe_error(write_recipe):
    with pytest.raises(RecipeError, match="training.lr: must be a finite number"):
        load(write_recipe(MINIMAL), overrides=["training.lr=.inf"])
