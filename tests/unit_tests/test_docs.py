"""README.md and the guide in docs/ point at things that exist: every relative link resolves
(the file, and its ``#anchor`` when it has one), and every ``megatron-ext ...`` command line they
quote parses with the real command's argparse and names recipes and repository files that
exist. Nothing is executed.

The rule for command lines (also in docs/development.md, "Writing the docs"):

- a command line is a line of a code block, or an inline code span, that starts with the
  program's name and a space (after an optional ``$ ``); a trailing backslash joins the next
  line and `` # ...`` starts a comment; a span of the name and one sub-command only
  (``megatron-ext validate`` in prose) checks that the sub-command exists;
- ``[...]`` marks an optional part, checked as if given;
- a word holding an upper-case placeholder (``DIR``, ``RUN_DIR``, ``PATH/model_config.yaml``,
  ``FILE.png``, ``IN.pt``), ``<...>`` or ``...`` stands for the reader's own value: it is not
  looked up (and ``...`` alone is dropped);
- any other word that is a path under one of the repository's own top-level directories must
  exist (a glob must match something); other paths are the reader's files;
- the recipe of ``run``, ``validate``, ``submit`` and ``schedule --recipe`` is loaded with its
  ``KEY=VALUE`` overrides and ``--platform``, so a mistyped field fails too.

The README's example on your own data is also followed end to end (its run as a validate).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(\s*)```")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
PLACEHOLDER = re.compile(r"(?<![a-z])[A-Z][A-Z0-9_]*(?![a-z])|<[^>]*>|\.\.\.|\$\{")
RECIPE_COMMANDS = {"run", "validate", "submit"}


# ---- links ---------------------------------------------------------------------------------


def github_anchor(heading: str) -> str:
    """The id GitHub gives a Markdown heading: lower case, punctuation other than ``-`` and
    ``_`` dropped, spaces turned into hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def outside_code(text: str, keep_inline: bool = False) -> str:
    """The text without fenced code blocks, and without inline code unless ``keep_inline``
    (links there are not links; headings keep theirs)."""
    kept, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(line if keep_inline else INLINE_CODE.sub("", line))
    return "\n".join(kept)


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for line in outside_code(page.read_text(), keep_inline=True).splitlines():
        if line.startswith("#"):
            base = github_anchor(line.lstrip("#"))
            anchor, n = base, 1
            while anchor in found:  # GitHub numbers repeated headings: name, name-1, ...
                anchor, n = f"{base}-{n}", n + 1
            found.add(anchor)
    return found


def broken_links(page: Path) -> list[str]:
    problems = []
    for target in LINK.findall(outside_code(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            problems.append(f"{target}: no such file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{target}: {resolved.name} has no heading #{anchor}")
    return problems


# ---- command lines -------------------------------------------------------------------------


def command_lines(text: str) -> list[str]:
    """Every ``megatron-ext ...`` line of the code blocks and inline code spans, continuations
    joined and comments dropped."""
    found, fenced, pending = [], False, ""
    for line in text.splitlines():
        if FENCE.match(line):
            fenced, pending = not fenced, ""
            continue
        if fenced:
            stripped = line.strip().removeprefix("$ ")
            if pending:
                stripped = pending + " " + stripped
            elif not stripped.startswith("megatron-ext "):
                continue
            pending = ""
            stripped = re.split(r"\s+#\s", stripped, maxsplit=1)[0].strip()
            if stripped.endswith("\\"):
                pending = stripped[:-1].strip()
                continue
            found.append(stripped)
        else:
            for _, code in INLINE_CODE.findall(line):
                if code.startswith("megatron-ext "):
                    found.append(code.strip())
    return found


def words_of(line: str) -> list[str]:
    """The command's words, optional ``[...]`` parts taken as given, ``...`` dropped."""
    without_brackets = re.sub(r"(^|\s)\[([^\[\]]*)\]", r"\1\2", line)
    words = shlex.split(without_brackets)
    return [word for word in words if word != "..."]


def is_placeholder(word: str) -> bool:
    return bool(PLACEHOLDER.search(word))


def repo_path_problem(word: str) -> str | None:
    """A word that names a file of this repository must name one that exists."""
    value = word.split("=", 1)[1] if word.startswith("--") and "=" in word else word
    top = value.split("/", 1)[0]
    if "/" not in value or is_placeholder(value) or not (REPO / top).is_dir() or top == "runs":
        return None
    if any(char in value for char in "*?["):
        return None if list(REPO.glob(value)) else f"{value}: matches nothing in the repository"
    return None if (REPO / value).exists() else f"{value}: no such file in the repository"


def parse(words: list[str]) -> argparse.Namespace:
    """``megatron_ext.cli.main``'s parsing, without running the command: late positionals join
    the targets, and anything else left over is an error."""
    from megatron_ext import cli

    parser = cli.build_parser()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        args, rest = parser.parse_known_args(words)
    late = [word for word in rest if not word.startswith("-")]
    if len(late) != len(rest) or (late and not hasattr(args, "targets")):
        raise SystemExit(f"unrecognized arguments: {' '.join(rest)}")
    if late:
        args.targets += late
    return args


def recipe_problem(args: argparse.Namespace) -> str | None:
    """Load the recipe a command names, with its overrides, when it is one of ours."""
    from megatron_ext.recipes import RecipeError, load

    if args.command == "schedule" and args.recipe:
        recipe, overrides = args.recipe, list(getattr(args, "targets", []) or [])
    elif args.command in RECIPE_COMMANDS and getattr(args, "targets", None):
        recipe, overrides = args.targets[0], args.targets[1:]
    else:
        return None
    overrides = [word for word in overrides if "=" in word and not is_placeholder(word)]
    paths = sorted(REPO.glob(recipe)) if "*" in recipe else [REPO / recipe]
    if is_placeholder(recipe) or not str(recipe).startswith("recipes/"):
        return None
    platform = getattr(args, "platform", None) or "cpu"
    for path in paths:
        try:
            load(path, platform, overrides)
        except RecipeError as error:
            return f"{path.relative_to(REPO)} {' '.join(overrides)}: {error}"
    return None


def command_problems(line: str) -> list[str]:
    words = words_of(line)[1:]
    if words in (["--version"], ["--help"]):
        return []
    if len(words) == 1 and not words[0].startswith("-"):  # a sub-command named in prose
        known = {command.NAME for command in __import__("megatron_ext.cli").cli.COMMANDS}
        return [] if words[0] in known else [f"{line}: no sub-command {words[0]!r}"]
    try:
        args = parse(words)
    except SystemExit as exit_:
        if exit_.code == 0:  # --help of a sub-command
            return []
        return [f"{line}: does not parse ({exit_.code or 'argparse error'})"]
    if getattr(args, "command", None) is None:
        return [f"{line}: no sub-command"]
    problems = [f"{line}: {p}" for p in map(repo_path_problem, words) if p]
    if args.command == "recipes" and args.copy and not is_placeholder(args.copy[0]):
        if not (REPO / "recipes" / f"{args.copy[0]}.yaml").is_file():
            problems.append(f"{line}: no shipped recipe {args.copy[0]}")
    if not problems:
        problem = recipe_problem(args)
        if problem:
            problems.append(f"{line}: {problem}")
    return problems


# ---- the tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    assert not broken_links(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_quoted_command_parses_and_names_files_that_exist(page):
    lines = command_lines(page.read_text())
    problems = [problem for line in lines for problem in command_problems(line)]
    assert not problems, "\n".join(problems)


def test_the_guide_quotes_commands_and_links():
    """The checks above see what they should: commands in blocks (with continuations) and in
    inline code, links in prose but not in code."""
    lines = [line for page in PAGES for line in command_lines(page.read_text())]
    assert len(lines) > 50
    assert any(
        line.startswith("megatron-ext prepare-data --input corpus.jsonl") and "--append-eod" in line
        for line in lines
    ), "a continued line is joined"
    assert "megatron-ext run recipes/gpt_tp2_pp2.yaml --dry-run" in lines
    readme = (REPO / "README.md").read_text()
    assert "docs/getting-started.md" in LINK.findall(outside_code(readme))


def test_the_checks_fail_on_broken_links_and_commands(tmp_path):
    """Each rule catches what it is for (so the tests above can fail)."""
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    page.write_text(
        "[gone](missing.md) [ok](other.md#a-section) [bad anchor](other.md#no-such)\n"
        "`[not a link](nowhere.md)` [web](https://example.com/x)\n"
    )
    problems = broken_links(page)
    assert len(problems) == 2, problems
    assert "missing.md" in problems[0] and "#no-such" in problems[1]

    def fails(line):
        return command_problems(line)

    assert fails("megatron-ext frobnicate recipes/gpt_tp2_pp2.yaml")  # no such sub-command
    assert fails("megatron-ext run recipes/gpt_tp2_pp2.yaml --no-such-option")
    assert fails("megatron-ext run recipes/no_such_recipe.yaml")  # a file that is not there
    assert fails("megatron-ext validate recipes/*.yml")  # a glob matching nothing
    assert fails("megatron-ext run recipes/gpt_tp2_pp2.yaml parallelism.ppp=4")  # bad field
    assert fails("megatron-ext recipes --copy no_such_recipe DIR")
    assert fails("megatron-ext valdate")  # a sub-command named in prose
    assert fails("megatron-ext schedule --pp 2 --microbatch 4 --mhc 4")
    # ... and leaves the reader's own values alone.
    assert not fails("megatron-ext run --resume RUN_DIR")
    assert not fails("megatron-ext compare runs/<dir> recipes/golden/<name>/golden_values_cpu.json")
    assert not fails("megatron-ext run recipes/gpt_tp2_pp2.yaml parallelism.pp=4 [--dry-run]")
    assert not fails(
        "megatron-ext prepare-data --input corpus.jsonl --output-prefix data/x "
        "--tokenizer-type NullTokenizer --vocab-size 128"
    )


def test_the_readme_example_on_your_own_data_validates(tmp_path, monkeypatch):
    """The README's "Train on your own data" as a user follows it: its commands
    (train-tokenizer and prepare-data on a small corpus, recipes --copy), its YAML edit, then
    its validate, and its run as a validate (same recipe and overrides; nothing is trained).
    tests/functional_tests/test_own_data.py trains it."""
    import yaml

    from megatron_ext import cli
    from megatron_ext.data import corpus

    readme = (REPO / "README.md").read_text()
    section = readme.split("## Train on your own data", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w*)\n(.*?)```", section, re.S)
    commands = [command_lines(f"```\n{body}```") for lang, body in blocks if lang == "bash"]
    edit = next(yaml.safe_load(body) for lang, body in blocks if lang == "yaml")
    assert [len(c) for c in commands] == [3, 2], commands

    monkeypatch.chdir(tmp_path)
    # Enough documents (about 100) for the README's 98,1,1 split to give valid and test one
    # each: validate refuses an empty split (Megatron's epoch loop would never end on it).
    records = corpus.build(max_chars=36000)
    corpus.write_jsonl(records, tmp_path / "corpus.jsonl")

    def follow(line: str) -> None:
        words = words_of(line)[1:]
        if "--workers" in words:  # one process is enough for a few kB
            words[words.index("--workers") + 1] = "1"
        if "--vocab-size" in words:  # a few kB of text: a small vocabulary trains in a second
            words[words.index("--vocab-size") + 1] = "320"
        if words[0] == "run":
            words[0] = "validate"
        assert cli.main(words) == 0, line

    for line in commands[0]:
        follow(line)
    recipe = tmp_path / edit_target(section)
    document = yaml.safe_load(recipe.read_text())
    document["data"] = edit["data"]
    document["test"] = {**document["test"], **edit["test"]}
    recipe.write_text(yaml.safe_dump(document))
    for line in commands[1]:
        follow(line)


def edit_target(section: str) -> str:
    """The recipe file the README says to edit (``Edit `my_run/....yaml```)."""
    match = re.search(r"Edit `([^`]+\.yaml)`", section)
    assert match, "the README names the file to edit"
    return match.group(1)
