"""Reading a recipe: YAML, its platform overlay, command-line overrides, then the schema.

    load("recipes/gpt_tp2_pp2.yaml", platform="cpu", overrides=["parallelism.pp=4"])

Order of precedence, lowest first: schema defaults < the recipe's top-level sections (the
``cpu`` platform's sizes) < ``platforms.<name>`` (when another platform is chosen) < the
overrides. Overrides use Megatron-Bridge's (Hydra-style) syntax:

- ``section.key=value`` sets a field; the value is read as YAML (``4``, ``3e-4``, ``true``,
  ``null``, ``[a, b]``, ``E|tt|tt|L``);
- ``+section.key=value`` is accepted with the same meaning, for commands copied from Bridge;
- ``~section.key`` removes the field, so its default applies;
- keys containing dots or spaces are quoted: ``test.tolerances."lm loss".rtol=1e-3``.

Every unknown key and malformed override is reported with the dotted path and, when one is
close, the key that was probably meant.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_ext.launch.shell import redact_env, redact_override
from megatron_ext.mhc_flags import MHC_ALIASES
from megatron_ext.recipe_flags import DEFAULT_PLATFORM
from megatron_ext.recipes import schema
from megatron_ext.recipes.schema import Problem, Recipe, RecipeError
from megatron_ext.upstream_cases import model_config as upstream

MAX_ALIASES = 32
"""Anchors and aliases are fine for sharing a block; nested alias bombs (a 1.3 KB document
expanding to gigabytes when the recipe is merged and checked) are not."""
MAX_DEPTH = 32
"""Deeper than any recipe needs; Python's recursion limit is far away."""


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-3`` as a string (it wants ``1.0e-3``); recipes mean a number.
    Duplicate keys, alias bombs and absurd nesting are YAML errors, not silent surprises."""

    def __init__(self, stream: Any):
        super().__init__(stream)
        self._aliases = 0
        self._depth = 0
        self.duplicates: list[tuple[Any, Any]] = []
        """(key, its second occurrence's mark) of each key a mapping gives twice."""

    def compose_node(self, parent, index):  # noqa: D102 - PyYAML hook
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                event = self.peek_event()
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"more than {MAX_ALIASES} aliases (*name): refused as an alias bomb",
                    event.start_mark,
                )
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                event = self.peek_event()
                raise yaml.composer.ComposerError(
                    None, None, f"nested deeper than {MAX_DEPTH} levels", event.start_mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):  # noqa: D102 - PyYAML hook
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:
                    duplicate = False  # unhashable: construct_mapping reports it
                if duplicate:
                    self.duplicates.append((key, key_node.start_mark))
                if not isinstance(key, (list, dict)):
                    seen[key] = True
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def yaml_error_line(exc: yaml.YAMLError) -> str:
    """One line: what is wrong and where (PyYAML's own text spans several lines)."""
    what = getattr(exc, "problem", None) or getattr(exc, "context", None) or str(exc)
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return " ".join(f"{what}{where}".split())


# The largest shipped recipe is ~3 KiB and Megatron-LM's test cases ~10 KiB; a file far beyond
# that is not a recipe, and parsing tens of megabytes of YAML takes minutes.
MAX_RECIPE_BYTES = 1 << 20


def _read_recipe_text(path: Path) -> str:
    """The recipe's text, read with a bound on the bytes read (a device or a ``/proc`` file
    claims a size of 0): a FIFO, socket or device is refused unread (issue 40, item 15)."""
    from megatron_ext import files

    try:
        data = files.read_bounded(path, MAX_RECIPE_BYTES, "recipe")
    except files.InputTooLarge:
        raise RecipeError(
            str(path),
            [
                Problem(
                    "",
                    f"more than a recipe's limit of {MAX_RECIPE_BYTES} bytes (1 MiB): "
                    "is this the right file?",
                )
            ],
        ) from None
    except files.NotRegularFile as exc:
        problem = f"cannot read: it is {exc.kind}, not a regular file; give a recipe file"
        raise RecipeError(str(path), [Problem("", problem)]) from None
    return data.decode("utf-8")


def parse_document(text: str) -> tuple[Any, list[str]]:
    """The parsed document and, for a Megatron-LM test case, the keys it gives twice
    ("key (line N)"): upstream's loader keeps the last value, so the importer does too and
    notes it. In a recipe a duplicate key is an error (the first value would be silently
    replaced)."""
    loader = _Loader(text)
    try:
        data = loader.get_single_data()
    finally:
        loader.dispose()
    if loader.duplicates and not upstream.is_test_case(data):
        key, mark = loader.duplicates[0]
        raise yaml.constructor.ConstructorError(
            "while reading a mapping",
            None,
            f"duplicate key {key!r} (the first value would be silently replaced)",
            mark,
        )
    return data, [f"{key} (line {mark.line + 1})" for key, mark in loader.duplicates]


def parse_yaml(text: str) -> Any:
    return parse_document(text)[0]


@dataclass
class LoadedRecipe:
    """A recipe ready to run: the typed recipe plus where it came from."""

    recipe: Recipe
    source: Path | None
    platform: str
    overrides: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What reading the file changed or dropped (a Megatron-LM test case: the mapping and the
    cpu overlay), one line each; ``validate`` and ``run`` print them."""
    allowed_env: tuple[str, ...] = ()
    """What the command line granted: launch.env keys off the allow-list given with
    ``--allow-env KEY``, and ``--trust-remote-code`` when given (see
    :mod:`megatron_ext.launch.env_policy`); never read from a recipe file."""

    @property
    def name(self) -> str:
        return self.recipe.name or (self.source.stem if self.source else "recipe")

    @property
    def base_dir(self) -> Path:
        return self.source.parent if self.source else Path.cwd()

    @property
    def numerics_overridden(self) -> bool:
        """True when an override may change the loss curve (anything outside test/launch
        bookkeeping), so the recipe's golden values no longer describe this run."""
        harmless = (
            "test.",
            "launch.timeout_s",
            "launch.stall_timeout_s",
            "launch.startup_timeout_s",
            "launch.slurm.",
            "launch.nodes",
            "description",
            "name",
            "model.mhc.log_stats",  # observes the maps (no gradient, no RNG); changes nothing
            # ZB-H1 reorders the same steps (weight gradients later, in micro-batch order):
            # the losses are 1F1B's, so a recipe's golden values still judge the run
            "parallelism.schedule",
        )
        keys = [override_key(o) for o in self.overrides]
        return any(not k.startswith(harmless) for k in keys)

    def golden_path(self) -> Path | None:
        pattern = self.recipe.test.golden_values
        if not pattern:
            return None
        try:
            path = Path(pattern.format(name=self.name, platform=self.platform))
        except (KeyError, IndexError, ValueError, AttributeError):  # refused by validation
            path = Path(pattern)
        return path if path.is_absolute() else self.base_dir / path


def override_key(override: str) -> str:
    text = override.lstrip("+~")
    return text.split("=", 1)[0].strip()


def deep_merge(base: dict, overlay: dict) -> dict:
    """``overlay`` over ``base``: mappings merge key by key, anything else replaces."""
    merged = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _known_keys_at(path: list[str]) -> list[str]:
    tp = schema.field_type(".".join(f'"{p}"' if "." in p else p for p in path)) if path else Recipe
    tp = schema._strip_optional(tp)
    return [f.name for f in dataclasses.fields(tp)] if dataclasses.is_dataclass(tp) else []


def _check_key(parts: list[str]) -> str | None:
    """None when the dotted key names a schema field, else why not."""
    for depth in range(1, len(parts) + 1):
        prefix = parts[:depth]
        try:
            schema.field_type(".".join(f'"{p}"' if "." in p or " " in p else p for p in prefix))
        except KeyError:
            known = _known_keys_at(parts[: depth - 1])
            return f"unknown key {'.'.join(prefix)!r}" + (
                schema.suggestion(parts[depth - 1], known) if known else ""
            )
    return None


def _override_value(parts: list[str], text: str) -> Any:
    """A string field takes the text as written (hybrid patterns such as ``*-|*-`` are not
    YAML); other fields read it as YAML, and free-form ones fall back to the text."""
    declared = schema._strip_optional(schema.field_type(".".join(f'"{p}"' for p in parts)))
    if declared is str:
        return None if text in ("null", "~") else text
    if text == "":
        return ""
    try:
        return parse_yaml(text)
    except yaml.YAMLError:
        if declared is Any:
            return text
        raise


def apply_overrides(data: dict, overrides: list[str]) -> tuple[dict, list[Problem]]:
    """``data`` with the command-line overrides applied, and a problem per bad override."""
    data = copy.deepcopy(data)
    problems: list[Problem] = []
    for override in overrides:
        delete = override.startswith("~")
        text = override.lstrip("+~")
        if delete:
            key_text, value_text = text, None
        elif "=" not in text:
            problems.append(
                Problem(f"override {_shown(override)!r}", "expected KEY=VALUE, +KEY=VALUE or ~KEY")
            )
            continue
        else:
            key_text, value_text = (s.strip() for s in text.split("=", 1))
        try:
            parts = schema.split_path(key_text)
        except KeyError as exc:
            problems.append(Problem(f"override {_shown(override)!r}", str(exc.args[0])))
            continue
        if parts[0] == "platforms":
            problems.append(
                Problem(
                    f"override {_shown(override)!r}",
                    "platforms are chosen with --platform; override the fields directly",
                )
            )
            continue
        why = _check_key(parts)
        if why:
            problems.append(Problem(f"override {_shown(override)!r}", why))
            continue
        node = data
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        if delete:
            node.pop(parts[-1], None)
            continue
        assert value_text is not None  # None only for ~KEY, handled above
        try:
            value = _override_value(parts, value_text)
            # A mapping merges into the mapping already there, as Hydra's overrides do
            # (launch.env={A: 1} keeps the recipe's other variables); `~KEY KEY={...}` replaces.
            if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
                value = deep_merge(node[parts[-1]], value)
            node[parts[-1]] = value
        except yaml.YAMLError as exc:
            problems.append(Problem(f"override {_shown(override)!r}", _not_yaml(override, exc)))
        except (ValueError, RecursionError):  # a 5000-digit integer, a 100k-deep value
            problems.append(
                Problem(f"override {_shown(override)!r}", "value is too long or deep to read")
            )
    return data, problems


def _shown(override: str) -> str:
    """An override as an error line may show it: a secret's value never (issue 34, item 7)."""
    return redact_override(override)


def _not_yaml(override: str, exc: yaml.YAMLError) -> str:
    """YAML's own message quotes the text around the error; not for an override with a
    secret in it."""
    if _shown(override) != override:
        return "value is not YAML"
    return f"value is not YAML: {exc}"


# extra_args keys that set model.mhc fields: upstream main's flags, upstream dev's flags
# (DeepSeek-V4 configs) and the TransformerConfig field names of both (the one alias table).
MHC_EXTRA_ARG_ALIASES = {alias.recipe_field: alias.spellings for alias in MHC_ALIASES}


def fold_mhc_flag_aliases(data: dict) -> tuple[dict, list[Problem]]:
    """Move mHC keys of ``extra_args`` (any spelling above) into ``model.mhc``, so that the
    plan checks and guards see them and the command line carries one spelling."""
    extra = data.get("extra_args")
    if not isinstance(extra, dict) or not any(
        k in extra for keys in MHC_EXTRA_ARG_ALIASES.values() for k in keys
    ):
        return data, []
    problems: list[Problem] = []
    extra = dict(extra)
    model = dict(data.get("model") or {}) if isinstance(data.get("model") or {}, dict) else {}
    mhc = dict(model.get("mhc") or {}) if isinstance(model.get("mhc") or {}, dict) else {}
    for field_name, spellings in MHC_EXTRA_ARG_ALIASES.items():
        given = {k: extra.pop(k) for k in spellings if k in extra}
        if not given:
            continue
        values = set(map(repr, given.values()))
        if len(values) > 1:
            problems.append(
                Problem(
                    "extra_args",
                    f"{', '.join(given)} disagree ({', '.join(values)}); "
                    f"set model.mhc.{field_name} once",
                )
            )
            continue
        value = next(iter(given.values()))
        if field_name in mhc and mhc[field_name] != value:
            problems.append(
                Problem(
                    f"extra_args.{next(iter(given))}",
                    f"{value!r} contradicts model.mhc.{field_name}: {mhc[field_name]!r}; "
                    "keep one of them",
                )
            )
            continue
        mhc[field_name] = value
    model["mhc"] = mhc
    return {**data, "model": model, "extra_args": extra}, problems


def resolve(
    raw: Any, platform: str = DEFAULT_PLATFORM, overrides: Sequence[str] = ()
) -> tuple[Recipe, list[Problem]]:
    """Platform overlay, overrides and schema over a parsed recipe mapping."""
    if not isinstance(raw, dict):
        return Recipe(), [Problem("", f"a recipe is a YAML mapping, got {type(raw).__name__}")]
    problems: list[Problem] = []
    version = raw.get("version")
    if version is None:
        problems.append(
            Problem("version", f"missing; this megatron-ext reads version: {schema.SCHEMA_VERSION}")
        )
    elif version != schema.SCHEMA_VERSION:
        problems.append(
            Problem(
                "version",
                f"{version!r} is not supported; this megatron-ext reads "
                f"version: {schema.SCHEMA_VERSION}",
            )
        )
    platforms = raw.get("platforms") or {}
    if not isinstance(platforms, dict):
        problems.append(Problem("platforms", "must be a mapping of platform name to overlay"))
        platforms = {}
    data = {k: v for k, v in raw.items() if k != "platforms"}
    if platform in platforms:
        overlay = platforms[platform]
        if not isinstance(overlay, dict):
            problems.append(Problem(f"platforms.{platform}", "must be a mapping"))
        else:
            if "platforms" in overlay or "version" in overlay:
                problems.append(
                    Problem(f"platforms.{platform}", "may not set version or platforms")
                )
            data = deep_merge(data, overlay)
    elif platform != DEFAULT_PLATFORM:
        known = [DEFAULT_PLATFORM, *platforms]
        problems.append(
            Problem(
                "",
                f"platform {platform!r} is not defined by this recipe "
                f"(its platforms: {', '.join(known)})",
            )
        )
    data, override_problems = apply_overrides(data, list(overrides))
    problems += override_problems
    data, alias_problems = fold_mhc_flag_aliases(data)
    problems += alias_problems
    recipe, schema_problems = schema.build(data)
    problems += schema_problems
    # Check each other platform's overlay as well, so `validate` sees them all at once.
    for name, overlay in platforms.items():
        if name != platform and isinstance(overlay, dict):
            _, overlay_problems = schema.build(
                deep_merge({k: v for k, v in raw.items() if k != "platforms"}, overlay)
            )
            problems += [
                Problem(f"platforms.{name}.{p.where}" if p.where else f"platforms.{name}", p.what)
                for p in overlay_problems
                if p not in schema_problems
            ]
    return recipe, problems


def load(
    path: str | Path, platform: str = DEFAULT_PLATFORM, overrides: Sequence[str] = ()
) -> LoadedRecipe:
    """Read, overlay, override and type-check a recipe file; RecipeError lists every problem."""
    path = Path(path)
    try:
        raw, duplicates = parse_document(_read_recipe_text(path))
    except OSError as exc:
        raise RecipeError(str(path), [Problem("", f"cannot read: {exc.strerror}")]) from None
    except UnicodeDecodeError as exc:
        raise RecipeError(
            str(path),
            [
                Problem(
                    "", f"not UTF-8 text: byte 0x{exc.object[exc.start]:02x} at offset {exc.start}"
                )
            ],
        ) from None
    except yaml.YAMLError as exc:
        raise RecipeError(
            str(path), [Problem("", f"not valid YAML: {yaml_error_line(exc)}")]
        ) from None
    except RecursionError:
        raise RecipeError(str(path), [Problem("", "not valid YAML: nested too deeply")]) from None
    except ValueError as exc:  # Python's 4300-digit limit on integers
        raise RecipeError(str(path), [Problem("", f"not readable: {exc}"[:200])]) from None
    notes: list[str] = []
    problems: list[Problem] = []
    if upstream.is_test_case(raw):  # Megatron-LM's model_config.yaml
        conversion = upstream.convert(
            raw, path.resolve().parent, duplicates=tuple(duplicates), defaults=Recipe().to_dict()
        )
        if conversion.refused:  # not a case megatron-ext trains: its one line, nothing more
            raise RecipeError(str(path), conversion.problems)
        raw = conversion.recipe
        problems += conversion.problems + upstream.platform_problems(conversion, platform)
        notes = upstream.notes_for(conversion, platform)
    recipe, recipe_problems = resolve(raw, platform, overrides)
    problems += recipe_problems + upstream.async_save_problems(recipe.extra_args)
    if problems:
        raise RecipeError(str(path), problems)
    return LoadedRecipe(
        recipe=recipe, source=path, platform=platform, overrides=list(overrides), notes=notes
    )


def platforms_of(path: str | Path) -> list[str]:
    """The platforms a recipe file defines, cpu first ([cpu] when it cannot be read)."""
    path = Path(path)
    try:  # bounded, regular files only: loading it again then names what is wrong in one line
        raw = parse_yaml(_read_recipe_text(path)) or {}
    except (RecipeError, OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError):
        return [DEFAULT_PLATFORM]
    if upstream.is_test_case(raw):
        return [
            DEFAULT_PLATFORM,
            *upstream.convert(
                raw, path.resolve().parent, defaults=Recipe().to_dict()
            ).gpu_platforms,
        ]
    platforms = raw.get("platforms") if isinstance(raw, dict) else None
    return [
        DEFAULT_PLATFORM,
        *[p for p in (platforms if isinstance(platforms, dict) else {}) if p != DEFAULT_PLATFORM],
    ]


def dump(loaded: LoadedRecipe) -> str:
    """The resolved recipe as YAML: every field with its value, platforms applied; loading it
    again (platform cpu, no overrides) gives the same run."""
    data = loaded.recipe.to_dict()
    data["name"] = loaded.name
    data.pop("platforms", None)
    data["launch"]["env"] = redact_env(data["launch"]["env"])  # secrets travel in the environment
    golden = loaded.golden_path()
    data["test"]["golden_values"] = str(golden.resolve()) if golden else None
    header = [
        "# Resolved by megatron-ext: every field, with the platform overlay and overrides applied.",
        f"# source: {loaded.source}",
        f"# platform: {loaded.platform}",
        f"# overrides: {' '.join(map(redact_override, loaded.overrides)) if loaded.overrides else '(none)'}",
    ]
    return "\n".join(header) + "\n" + yaml.safe_dump(data, sort_keys=False, width=100)
