"""recipes/README.md documents the schema megatron-ext reads, field by field."""

from megatron_ext.recipes.schema import SCHEMA_VERSION, markdown_table

from recipe_texts import RECIPES, REPO_ROOT


def test_readme_field_table_is_the_schema():
    readme = (REPO_ROOT / "recipes" / "README.md").read_text()
    assert markdown_table() in readme, (
        "recipes/README.md's field table is out of date; paste "
        "`python -c 'from megatron_ext.recipes.schema import markdown_table; print(markdown_table())'`"
    )
    assert f"## Schema (version {SCHEMA_VERSION})" in readme


def test_readme_lists_every_shipped_recipe():
    readme = (REPO_ROOT / "recipes" / "README.md").read_text()
    # Multimodule recipes are documented with their feature (they arrive with it).
    missing = [
        p.stem
        for p in RECIPES
        if f"| `{p.stem}` |" not in readme and "type: multimodule" not in p.read_text()
    ]
    assert not missing, f"recipes/README.md does not list {missing}"
