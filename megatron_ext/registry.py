"""The one registry of replaced megatron-core (and torch) attributes: its machinery.

Everything megatron-ext swaps out at runtime is declared as a :class:`Patch` (and every private
megatron/torch symbol it depends on as a :class:`Seam`) in :mod:`megatron_ext.declarations`,
which this module loads when first asked; this module imports nothing of the product but the
root error class (:mod:`megatron_ext.errors`, itself importing nothing). A patch names
the target (``module:attribute``), its replacement as ``module:function`` (called with the
original unless ``wraps`` is off), the megatron-core versions it was verified against, and why it is needed. Nothing
else in the package assigns attributes on foreign modules.

Patches come in groups. ``"core"`` patches are what :func:`megatron_ext.install`
applies on any machine; ``"cpu"`` patches are the CPU runtime's redirections and are
applied only by :func:`megatron_ext.runtime.use_cpu`; ``"trace"``, ``"startup"``,
``"fault"`` and ``"config"`` patches only while tracing, importing megatron, injecting a
checkpoint-save fault (``MEGATRON_EXT_FAULT``), or building an mHC MLA config from the flags. Applying is idempotent and
every original is kept so that it can be restored exactly.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import Any

# The one product import: the root error class (megatron_ext.errors imports nothing).
from megatron_ext.errors import MegatronExtError

VERIFIED_MEGATRON_CORE = ("0.19.2", "0.20.0")
ALLOW_UNVERIFIED_ENV = "MEGATRON_EXT_ALLOW_UNVERIFIED"


class UnverifiedMegatronCoreError(MegatronExtError, RuntimeError):
    """The installed megatron-core is not one megatron-ext's patches were verified on."""


class DeclarationError(MegatronExtError, ValueError):
    """A patch or seam declared wrongly (twice, or a target that is not ``module:name``), or a
    patch asked for that is not applied: a mistake in megatron-ext's or a plugin's own
    declarations, found when they are imported."""


@dataclass(frozen=True)
class Patch:
    """One replaced attribute.

    ``replacement`` is ``module:function``, imported only when the patch is applied. With
    ``wraps`` (the default) it receives the original attribute and returns what replaces it,
    so a patch can wrap the original instead of re-implementing it; otherwise it is the
    replacement itself.
    """

    target: str
    replacement: str
    why: str
    group: str = "core"
    verified: tuple[str, ...] = VERIFIED_MEGATRON_CORE
    wraps: bool = True
    # The megatron-core versions whose code needs this patch (a fix for a bug only they have);
    # None: every version. Elsewhere the patch is neither applied nor checked.
    applies_on: tuple[str, ...] | None = None

    def make(self, original: Any) -> Any:
        """What replaces ``original`` (imports the replacement's module)."""
        replacement = _resolve(self.replacement)
        return replacement(original) if self.wraps else replacement

    @property
    def module_name(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def attribute(self) -> str:
        return self.target.split(":", 1)[1]


_PATCHES: list[Patch] = []
# target -> (original, replacement) of every patch currently applied.
_applied: dict[str, tuple[Any, Any]] = {}


def register(patch: Patch) -> Patch:
    """Add a patch to the registry; a target may be registered only once."""
    if any(p.target == patch.target for p in _PATCHES):
        raise DeclarationError(f"patch target {patch.target!r} is registered twice")
    if ":" not in patch.target:
        raise DeclarationError(f"patch target {patch.target!r} must look like 'module:attribute'")
    if ":" not in patch.replacement:
        raise DeclarationError(
            f"patch {patch.target!r}: replacement {patch.replacement!r} must look like "
            "'module:function'"
        )
    _PATCHES.append(patch)
    return patch


# The module that declares every Patch and Seam; loaded at the first question about them, so
# that this module needs nothing of the product and any product module may import it.
DECLARATIONS = "megatron_ext.declarations"


def _declared() -> None:
    importlib.import_module(DECLARATIONS)


def patches(group: str | None = None, *, every: bool = False) -> list[Patch]:
    """The registered patches that apply to the imported megatron-core (``every``: also the
    version-scoped ones that do not), optionally only those of one group."""
    _declared()
    chosen = [p for p in _PATCHES if group is None or p.group == group]
    return chosen if every else [p for p in chosen if applies(p)]


def applies(patch: Patch) -> bool:
    """Whether ``patch`` is for the imported megatron-core (version-scoped fixes only ask)."""
    return patch.applies_on is None or megatron_core_version() in patch.applies_on


def is_applied(target: str) -> bool:
    return target in _applied


def applied_targets() -> list[str]:
    return list(_applied)


@dataclass(frozen=True)
class MegatronCoreCode:
    """The megatron-core that ``import megatron.core`` gives, and what pip's metadata says.

    They differ when a Megatron-LM checkout is on the path (PYTHONPATH, ``pip install -e``, or
    the working directory) beside or instead of an installed wheel: the code that runs is the
    checkout's, whatever version the metadata names.
    """

    version: str  # from megatron.core.package_info (the code), without the git suffix
    path: str  # the directory of the imported megatron/core
    distribution_version: str | None  # pip's metadata for "megatron-core", None if not installed
    distribution_path: str | None  # where that distribution's megatron/core would be

    @property
    def from_distribution(self) -> bool:
        """The imported code is the installed distribution's own files."""
        return self.distribution_path is not None and os.path.realpath(
            self.path
        ) == os.path.realpath(self.distribution_path)

    def describe(self) -> str:
        where = f"megatron-core {self.version} (code at {self.path}"
        if self.distribution_version is None:
            return (
                where + "; no megatron-core distribution is installed, so a checkout on the path)"
            )
        if self.from_distribution and self.distribution_version == self.version:
            return where + ")"
        return where + (
            f"; a checkout or other copy, not the installed megatron-core {self.distribution_version} "
            f"distribution at {self.distribution_path})"
        )


def imported_megatron_core() -> MegatronCoreCode:
    """Read the version of the megatron-core code that is actually imported.

    ``megatron.core.package_info`` carries MAJOR/MINOR/PATCH/PRE_RELEASE in the source itself.
    Its ``__version__`` appends the ``git rev-parse`` of whatever repository the files sit in
    (even a virtualenv inside an unrelated project), so the version is rebuilt from the parts.
    """
    package_info = importlib.import_module("megatron.core.package_info")
    version = ".".join(str(part) for part in package_info.VERSION[:3]) + str(
        package_info.VERSION[3]
    )
    path = os.path.dirname(os.path.abspath(str(package_info.__file__)))
    try:
        distribution = metadata.distribution("megatron-core")
    except metadata.PackageNotFoundError:
        return MegatronCoreCode(version, path, None, None)
    return MegatronCoreCode(
        version, path, distribution.version, str(distribution.locate_file("megatron/core"))
    )


def megatron_core_version() -> str:
    """The version of the imported megatron-core code (not pip's metadata)."""
    return imported_megatron_core().version


def check_megatron_core_version(group_patches: list[Patch]) -> None:
    """Refuse to patch megatron-core code the patches were not verified on."""
    version = megatron_core_version()
    unverified = [p.target for p in group_patches if version not in p.verified]
    if not unverified:
        return
    code = f"megatron-core {version}"
    try:
        imported = imported_megatron_core()
        if imported.version == version:  # (a test may stand in for megatron_core_version alone)
            code = imported.describe()
    except Exception:
        pass
    message = (
        f"megatron-ext's patches are verified on megatron-core {', '.join(VERIFIED_MEGATRON_CORE)}, "
        f"but the imported code is {code} (unverified targets: {', '.join(unverified)}). "
        f"Install megatron-core=={VERIFIED_MEGATRON_CORE[0]} (or check out Megatron-LM core_r0.19.0 at "
        f"that release) or a megatron-core {VERIFIED_MEGATRON_CORE[-1]}, or set "
        f"{ALLOW_UNVERIFIED_ENV}=1 to apply them anyway at your own risk."
    )
    if os.environ.get(ALLOW_UNVERIFIED_ENV) == "1":
        warnings.warn(message, stacklevel=3)
        return
    raise UnverifiedMegatronCoreError(message)


def _owner_and_name(target: str) -> tuple[Any, str]:
    module_name, attribute = target.split(":", 1)
    owner: Any = importlib.import_module(module_name)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def apply(group: str) -> None:
    """Apply every patch of ``group``; patches already applied are left alone."""
    group_patches = patches(group)
    if any(p.module_name.split(".")[0] == "megatron" for p in group_patches):
        check_megatron_core_version(group_patches)  # (a torch-only group need not import megatron)
    for patch in group_patches:
        owner, name = _owner_and_name(patch.target)
        if patch.target in _applied and getattr(owner, name) is _applied[patch.target][1]:
            continue
        # Not applied, or replaced behind our back since (e.g. a test's monkeypatch being
        # undone): patch whatever is there now.
        original = getattr(owner, name)
        replacement = patch.make(original)
        setattr(owner, name, replacement)
        _applied[patch.target] = (original, replacement)


def undo(group: str) -> None:
    """Restore the original of every applied patch of ``group`` (in reverse order)."""
    for patch in reversed(patches(group)):
        if patch.target not in _applied:
            continue
        original, _ = _applied.pop(patch.target)
        owner, name = _owner_and_name(patch.target)
        setattr(owner, name, original)


@contextlib.contextmanager
def applied_for(group: str) -> Iterator[None]:
    """Run a block with ``group`` applied; undone afterwards unless the whole group was applied
    already when the block began (then whoever applied it undoes it)."""
    already = all(is_applied(p.target) for p in patches(group))
    if not already:
        apply(group)
    try:
        yield
    finally:
        if not already:
            undo(group)


@contextlib.contextmanager
def suspended(target: str) -> Iterator[None]:
    """Run with one applied patch's original in place (tests that show why a patch exists);
    install() leaves it alone meanwhile, and the patch is back afterwards."""
    if target not in _applied:
        raise DeclarationError(f"{target!r} is not applied")
    original, replacement = _applied[target]
    owner, name = _owner_and_name(target)
    setattr(owner, name, original)
    _applied[target] = (original, original)
    try:
        yield
    finally:
        setattr(owner, name, replacement)
        _applied[target] = (original, replacement)


@contextlib.contextmanager
def applied(target: str) -> Iterator[None]:
    """Run with one registered patch applied (whatever its group), then restore what was there.
    A patch already applied stays applied."""
    patch = next((p for p in patches() if p.target == target), None)
    if patch is None:
        raise KeyError(f"{target!r} is not a registered patch")
    if target in _applied:
        yield
        return
    owner, name = _owner_and_name(target)
    original = getattr(owner, name)
    replacement = patch.make(original)
    setattr(owner, name, replacement)
    _applied[target] = (original, replacement)
    try:
        yield
    finally:
        _applied.pop(target, None)
        setattr(owner, name, original)


def current(target: str) -> Any:
    """What ``target`` is right now (patched or not)."""
    owner, name = _owner_and_name(target)
    return getattr(owner, name)


def original(target: str) -> Any:
    """The attribute a patch replaced (or the current one when not patched)."""
    if target in _applied:
        return _applied[target][0]
    return current(target)


# --------------------------------------------------------------------------------------
SEAM_KINDS = (
    "private_method_override",  # a subclass of ours overrides this private method
    "private_function",  # we call this private function or method
    "class_adoption",  # we turn a built instance of this class into our subclass (__class__)
    "private_attribute",  # we read this private attribute (``()`` in a target: of an instance)
    "object_attribute",  # we rewrite this attribute on objects megatron built
)


class SeamMismatchError(MegatronExtError, RuntimeError):
    """A declared private seam is missing or changed its signature in the installed code."""


@dataclass(frozen=True)
class Seam:
    """One private dependency: ``target`` is ``module:qualname``; ``signature`` (parameter
    names, ``None`` for presence only) is what our code was written against."""

    target: str
    kind: str
    why: str
    signature: tuple[str, ...] | None = None
    verified: tuple[str, ...] = VERIFIED_MEGATRON_CORE

    @property
    def package(self) -> str:
        """The distribution whose version ``verified`` names."""
        top = self.target.split(".", 1)[0].split(":", 1)[0]
        return {"megatron": "megatron-core", "torch": "torch"}.get(top, "python")


_SEAMS: dict[str, Seam] = {}
_seams_verified = False


def declare(seam: Seam) -> Seam:
    """Add a seam; a target may be declared only once."""
    if seam.kind not in SEAM_KINDS:
        raise DeclarationError(
            f"seam {seam.target!r}: kind {seam.kind!r} is not one of {SEAM_KINDS}"
        )
    if seam.target in _SEAMS:
        raise DeclarationError(f"seam target {seam.target!r} is declared twice")
    if ":" not in seam.target:
        raise DeclarationError(f"seam target {seam.target!r} must look like 'module:qualname'")
    _SEAMS[seam.target] = seam
    return seam


def seams(kind: str | None = None) -> list[Seam]:
    """The declared seams, optionally only those of one kind."""
    _declared()
    return [s for s in _SEAMS.values() if kind is None or s.kind == kind]


def _resolve(target: str) -> Any:
    """``module:a.b`` -> the object; a part ending in ``()`` is instantiated without arguments
    (``argparse:ArgumentParser()._actions`` is an instance attribute)."""
    module_name, path = target.split(":", 1)
    owner: Any = importlib.import_module(module_name)
    for part in path.split("."):
        owner = getattr(owner, part.removesuffix("()"))
        if part.endswith("()"):
            owner = owner()
    return owner


def private(target: str) -> Any:
    """A declared private symbol (``module:qualname``), e.g.
    ``registry.private("megatron.core.tensor_parallel.random:_fork_rng")``."""
    _declared()
    if target not in _SEAMS:
        raise KeyError(f"{target!r} is not a declared seam in megatron_ext/declarations.py")
    return _resolve(target)


def adopt(instance: Any, cls: type) -> Any:
    """Turn a just-built megatron-core ``instance`` into our subclass ``cls`` in place; the
    adopted class must be a declared ``class_adoption`` seam and exactly the instance's type
    (a subclass of it may have state ``cls`` does not know)."""
    for seam in seams("class_adoption"):
        base = _resolve(seam.target)
        if not issubclass(cls, base):
            continue
        if type(instance) is not base:
            raise TypeError(
                f"only a plain megatron-core {base.__name__} can be adopted, got "
                f"{type(instance).__name__}"
            )
        instance.__class__ = cls
        return instance
    raise TypeError(f"{cls.__qualname__} adopts no declared class_adoption seam")


def assign(obj: Any, attribute: str, value: Any, seam: str) -> None:
    """Rewrite ``attribute`` on an object megatron built, under a declared object_attribute seam."""
    _declared()
    if seam not in _SEAMS or _SEAMS[seam].kind != "object_attribute":
        raise KeyError(f"{seam!r} is not a declared object_attribute seam")
    setattr(obj, attribute, value)


def _package_version(package: str) -> str:
    if package == "megatron-core":
        return megatron_core_version()
    if package == "torch":
        return importlib.import_module("torch").__version__.split("+")[0]
    import platform

    return platform.python_version()


def seam_problem(seam: Seam) -> str | None:
    """Why ``seam`` does not hold in the imported code (None when it does)."""
    import inspect

    try:
        obj = _resolve(seam.target)
    except (ImportError, AttributeError) as exc:
        return f"{seam.target} is missing ({type(exc).__name__}: {exc})"
    if seam.signature is None:
        return None
    try:
        found = tuple(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return f"{seam.target} has no readable signature"
    if found != seam.signature:
        return (
            f"{seam.target} takes ({', '.join(found)}), written for ({', '.join(seam.signature)})"
        )
    return None


def verify_seams(force: bool = False) -> None:
    """Check every declared seam (once per process unless ``force``); raise naming each broken
    target and the version found, unless MEGATRON_EXT_ALLOW_UNVERIFIED=1 (then warn)."""
    global _seams_verified
    if _seams_verified and not force:
        return
    problems = [(s, p) for s in seams() if (p := seam_problem(s)) is not None]
    _seams_verified = True
    if not problems:
        return
    lines = [
        f"  {problem} [{seam.kind}; verified on {seam.package} {', '.join(seam.verified)}, "
        f"found {_package_version(seam.package)}]"
        for seam, problem in problems
    ]
    message = (
        "megatron-ext depends on private code that changed:\n"
        + "\n".join(lines)
        + (
            f"\nInstall the verified versions, or set {ALLOW_UNVERIFIED_ENV}=1 to go on at your own risk."
        )
    )
    if os.environ.get(ALLOW_UNVERIFIED_ENV) == "1":
        warnings.warn(message, stacklevel=2)
        return
    raise SeamMismatchError(message)
