"""The one registry of replaced megatron-core (and torch) attributes.

Everything megatron-ext swaps out at runtime is declared here as a :class:`Patch`:
the target (``module:attribute``), how to build the replacement from the original,
the megatron-core versions it was verified against, and why it is needed. Nothing
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
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, Iterator

VERIFIED_MEGATRON_CORE = ("0.19.2",)
ALLOW_UNVERIFIED_ENV = "MEGATRON_EXT_ALLOW_UNVERIFIED"


class UnverifiedMegatronCoreError(RuntimeError):
    """The installed megatron-core is not one megatron-ext's patches were verified on."""


@dataclass(frozen=True)
class Patch:
    """One replaced attribute.

    ``make`` receives the original attribute and returns the replacement, so a patch
    can wrap the original instead of re-implementing it.
    """

    target: str
    make: Callable[[Any], Any]
    why: str
    group: str = "core"
    verified: tuple[str, ...] = VERIFIED_MEGATRON_CORE

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
        raise ValueError(f"patch target {patch.target!r} is registered twice")
    if ":" not in patch.target:
        raise ValueError(f"patch target {patch.target!r} must look like 'module:attribute'")
    _PATCHES.append(patch)
    return patch


def patches(group: str | None = None) -> list[Patch]:
    """The registered patches, optionally only those of one group."""
    return [p for p in _PATCHES if group is None or p.group == group]


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
    path = os.path.dirname(os.path.abspath(package_info.__file__))
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
        f"Install megatron-core=={VERIFIED_MEGATRON_CORE[-1]} (or check out Megatron-LM core_r0.19.0 at "
        f"that release), or set {ALLOW_UNVERIFIED_ENV}=1 to apply them anyway at your own risk."
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
def suspended(target: str) -> Iterator[None]:
    """Run with one applied patch's original in place (tests that show why a patch exists);
    install() leaves it alone meanwhile, and the patch is back afterwards."""
    if target not in _applied:
        raise ValueError(f"{target!r} is not applied")
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
    patch = next((p for p in _PATCHES if p.target == target), None)
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
# "startup" patch: applied only while a process imports megatron (megatron_ext.launch.startup).
# --------------------------------------------------------------------------------------
register(
    Patch(
        target="torch:compile",
        make=lambda original: importlib.import_module(
            "megatron_ext.launch.startup"
        ).compile_on_first_call(original),
        why=(
            "megatron-core applies torch.compile to its fusion functions at import "
            "(megatron.core.jit), which imports torch's compiler: ~40% of an entry point's import "
            "time on every rank, for functions a CPU run never calls. While megatron is imported, "
            "functions are compiled by the real torch.compile at their first call instead "
            "(torch.compile is lazy already, so what runs is unchanged)."
        ),
        group="startup",
    )
)


# --------------------------------------------------------------------------------------
# "config" patch: applied only while megatron_ext.training_steps.transformer_config builds a
# config from the flags (registry.applied).
# --------------------------------------------------------------------------------------
register(
    Patch(
        target="megatron.core.transformer:MLATransformerConfig",
        make=lambda original: (
            importlib.import_module("megatron_ext.config").MHCMLATransformerConfig
        ),
        why=(
            "megatron.training's core_transformer_config_from_args replaces the config class it "
            "is given by megatron.core.transformer.MLATransformerConfig whenever "
            "--multi-latent-attention is set (imported inside the function), which would drop "
            "every mHC field (and --enable-mhc-connections with them). While an mHC config is "
            "built from the flags, that name is megatron-ext's MHCMLATransformerConfig (the MLA "
            "config plus the mHC fields), so every MLA flag and every mHC flag reach one config."
        ),
        group="config",
    )
)


# --------------------------------------------------------------------------------------
# "core" patches: applied by megatron_ext.install() on every machine.
# --------------------------------------------------------------------------------------
register(
    Patch(
        target="megatron.core.datasets.utils:compile_helpers",
        make=lambda original: importlib.import_module(
            "megatron_ext.checkout"
        ).compile_helpers_when_missing(original),
        why=(
            "The megatron-core wheel ships the prebuilt helpers_cpp extension but not the "
            "Makefile that compile_helpers() runs; megatron.training's initialisation calls it "
            "on rank 0 and exits when make fails. The shipped extension is used when it imports; "
            "a Megatron-LM checkout (Makefile, no extension yet) builds it with its own make; "
            "otherwise a message says how to get it."
        ),
    )
)


register(
    Patch(
        target="megatron.core.pipeline_parallel.p2p_communication:_batched_p2p_ops",
        make=lambda _original: (
            importlib.import_module("megatron_ext.pipeline.p2p").batched_p2p_ops_forward_first
        ),
        why=(
            "With batch_p2p_comm=True and PP=2 the previous and next rank coincide, and the "
            "upstream posting order (send_prev, recv_prev, send_next, recv_next) matches a "
            "gradient with the peer's activation receive: interleaved (VPP) runs get silently "
            "wrong gradients. Forward messages are posted before backward ones instead."
        ),
    )
)


register(
    Patch(
        target="megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator._communicate",
        make=lambda original: importlib.import_module(
            "megatron_ext.pipeline.shapes"
        ).communicate_with_pipeline_width(original),
        why=(
            "With mHC and PP > 1 every inter-stage tensor is the n-stream residual [s, b, n*h], "
            "but both schedules size fixed receive buffers from hidden_size (1F1B through "
            "get_tensor_shapes, the interleaved schedule inline, with no hook). Every exchange "
            "passes through _communicate, the one place both can be widened. The same seam "
            "checks, at a communicator's first exchange, that all stages agree on the fields "
            "that shape these tensors (pipeline.consistency; only the shape, once per shape, "
            "where the entry's model provider agreed on the fields before build), and every "
            "send's shape."
        ),
    )
)


register(
    Patch(
        target=(
            "megatron.core.inference.model_inference_wrappers.abstract_model_inference_wrapper:"
            "AbstractModelInferenceWrapper.__init__"
        ),
        make=lambda original: importlib.import_module(
            "megatron_ext.guards"
        ).inference_wrapper_rejecting_mhc_pipeline(original),
        why=(
            "Inference wrappers receive pipeline activations into single-stream "
            "(hidden_size) buffers; with mHC and an inference pipeline group larger than one "
            "they would fail or misread. The group is resolved inside __init__ (inference "
            "config first, training groups otherwise), so the check runs right after it."
        ),
    )
)


# --------------------------------------------------------------------------------------
# "trace" patches: applied only inside megatron_ext.pipeline.trace.tracing() (megatron-ext
# run --trace); outside it nothing is wrapped, so tracing off costs nothing.
# --------------------------------------------------------------------------------------
def _trace(attribute: str, maker: str, why: str) -> None:
    def make(original: Any) -> Any:
        return getattr(importlib.import_module("megatron_ext.pipeline.trace"), maker)(original)

    register(
        Patch(
            target=f"megatron.core.pipeline_parallel.schedules:{attribute}",
            make=make,
            why=why,
            group="trace",
        )
    )


_trace(
    "forward_step",
    "traced_forward_step",
    "Both pipelined schedules run every forward pass through it, with the micro-batch and "
    "the virtual chunk as arguments: the one place to time and label an F.",
)
_trace(
    "backward_step",
    "traced_backward_step",
    "Every single-module backward pass; its output tensor identifies the micro-batch and chunk.",
)
_trace(
    "backward_step_multimodule",
    "traced_backward_step",
    "The multi-module schedule's backward pass (bound by name at each schedule call).",
)
_trace(
    "forward_backward_pipelining_without_interleaving",
    "traced_schedule",
    "1F1B: one iteration per call; its P2P communicator is handed over wrapped in a recorder "
    "(the schedule exposes no hook around its exchanges).",
)
_trace(
    "forward_backward_pipelining_with_interleaving",
    "traced_schedule",
    "The interleaved schedule, likewise.",
)


_DEAD_MTP_OUTPUT_WEIGHT_WHY = (
    "With tied embeddings and MTP under PP, the MTP stage (pre_process=False) gets an "
    "output_layer.weight because the allocation condition looks only at pre_process; the "
    "stage feeds its embedding copy to the output layer instead, so the weight never gets a "
    "gradient (constant num-zeros) and a torch_dist save asserts in LanguageModule's tied "
    "state dict. It is released right after construction (cf. Megatron-LM PR #7577)."
)

for _model_target in (
    "megatron.core.models.gpt.gpt_model:GPTModel.__init__",
    "megatron.core.models.hybrid.hybrid_model:HybridModel.__init__",
):
    register(
        Patch(
            target=_model_target,
            make=lambda original: importlib.import_module(
                "megatron_ext.models.tied_output"
            ).init_without_dead_output_weight(original),
            why=_DEAD_MTP_OUTPUT_WEIGHT_WHY,
        )
    )


register(
    Patch(
        target="megatron.training.checkpointing:check_checkpoint_args",
        make=lambda original: importlib.import_module(
            "megatron_ext.guards.checkpoint_args"
        ).checking_model_settings(original),
        why=(
            "megatron.training compares only a few model arguments on load and skips "
            "padded_vocab_size for distributed checkpoints: an mHC checkpoint loads silently "
            "into an mHC-off model (hyper-connection weights dropped) and a TP change that "
            "re-pads the vocabulary changes the loss. Both are refused, naming the fix."
        ),
    )
)


register(
    Patch(
        target="megatron.training.checkpointing:maybe_msc",
        make=lambda original: importlib.import_module(
            "megatron_ext.checkpoint.tracker"
        ).AtomicTrackerStorage(original),
        why=(
            "save_checkpoint rewrites latest_checkpointed_iteration.txt in place (open 'w', then "
            "write): a process killed in between leaves an empty tracker that megatron refuses "
            "to load from. The module does its file I/O through maybe_msc, so a stand-in that "
            "writes the tracker to a temporary file and renames it makes that write atomic."
        ),
    )
)


register(
    Patch(
        target=(
            "megatron.core.dist_checkpointing.strategies.filesystem_async:get_write_results_queue"
        ),
        make=lambda original: importlib.import_module(
            "megatron_ext.checkpoint.sync_save"
        ).results_queue_for_sync_saves(original),
        why=(
            "FileSystemWriterAsync passes every save's write results through a queue of a "
            "multiprocessing Manager (spawned at a process's first save; it imports torch to "
            "unpickle them), made for async saves whose writer is another process. A "
            "synchronous save writes and collects in the rank itself (execute_sync), so while "
            "megatron.training's args say async_save is off the writer gets an in-process queue: "
            "the first save of a run no longer waits seconds for the Manager. Looked up by name "
            "in prepare_write_data at each save."
        ),
    )
)


# --------------------------------------------------------------------------------------
# "fault" patch: applied only in a rank whose MEGATRON_EXT_FAULT asks for kind=kill-while-saving
# (megatron_ext.launch.faults.arm_save_fault); otherwise nothing is wrapped.
# --------------------------------------------------------------------------------------
register(
    Patch(
        target=(
            "megatron.core.dist_checkpointing.strategies.state_dict_saver:"
            "save_state_dict_async_finalize"
        ),
        make=lambda original: importlib.import_module(
            "megatron_ext.launch.faults"
        ).killing_before_save_finalize(original),
        why=(
            "Fault injection inside a checkpoint save, at a fixed point: a synchronous torch_dist "
            "save calls it on every rank after every rank wrote its shard files (a barrier) and "
            "before the coordinator writes .metadata, metadata.json and the tracker; the "
            "strategy looks it up at each save (_import_mcore_async), so the module attribute "
            "is the seam. Killing a rank there leaves a checkpoint with shards and no metadata."
        ),
        group="fault",
    )
)


# --------------------------------------------------------------------------------------
# "cpu" patches: the CPU runtime (megatron_ext.runtime.use_cpu), never on a GPU machine.
# Together with runtime.cpu.CudaToCpuMode these are everything the runtime redirects.
# --------------------------------------------------------------------------------------
def _cpu(target: str, replacement_name: str, why: str, wraps: bool = False) -> None:
    """Register a CPU-runtime patch whose replacement lives in megatron_ext.runtime.cpu."""

    def make(original: Any) -> Any:
        replacement = getattr(importlib.import_module("megatron_ext.runtime.cpu"), replacement_name)
        return replacement(original) if wraps else replacement

    register(Patch(target=target, make=make, why=why, group="cpu"))


_cpu(
    "torch.cuda:current_device",
    "current_device",
    "megatron allocates P2P, shape-exchange and grad buffers on torch.cuda.current_device().",
)
_cpu(
    "torch.cuda:device_count",
    "device_count",
    "megatron.training initialises its model-parallel groups only when a device is counted.",
)
_cpu(
    "torch.cuda:set_device", "set_device", "megatron.training binds each rank to a GPU at start-up."
)
_cpu(
    "torch.cuda:synchronize",
    "synchronize",
    "P2P communication and DDP synchronise the GPU; CPU work is already ordered.",
)
_cpu(
    "torch.cuda:get_rng_state",
    "get_rng_state",
    "megatron's CUDA RNG tracker saves generator states; the CPU generator stands in.",
)
_cpu(
    "torch.cuda:set_rng_state",
    "set_rng_state",
    "megatron's CUDA RNG tracker restores generator states; the CPU generator stands in.",
)
_cpu(
    "torch.cuda:manual_seed",
    "manual_seed",
    "model_parallel_cuda_manual_seed seeds the tracker's per-TP-rank streams through it.",
)
_cpu(
    "torch.cuda:manual_seed_all",
    "manual_seed",
    "Same as torch.cuda.manual_seed, for callers that seed every device.",
)
_cpu(
    "megatron.core.tensor_parallel.random:_get_cuda_rng_state",
    "megatron_get_rng_state",
    "The tracker's fork() reads the CUDA default generator directly.",
)
_cpu(
    "megatron.core.tensor_parallel.random:_set_cuda_rng_state",
    "megatron_set_rng_state",
    "The tracker's fork() writes the CUDA default generator directly (lazily, via CUDA init).",
)
_cpu(
    "torch.cuda:Stream",
    "FakeStream",
    "DDP and megatron.training create side streams for communication and model wrapping.",
)
_cpu("torch.cuda:Event", "FakeEvent", "Timers and DDP record CUDA events.")
_cpu(
    "torch.cuda:current_stream",
    "current_stream",
    "DDP's grad buffers order their collectives after the current stream.",
)
_cpu("torch.cuda:default_stream", "current_stream", "Some paths wait on the default stream.")
_cpu(
    "torch.cuda:stream",
    "stream",
    "megatron.training wraps DDP construction in `with torch.cuda.stream(s)`.",
)
_cpu(
    "megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu",
    "host_copy_as_on_gpu",
    "The alltoall MoE dispatcher expects its split sizes as host numpy arrays after this call; "
    "on CPU it would leave torch tensors, which all_to_all_single's binding rejects.",
    wraps=True,
)
_cpu(
    "megatron.training.training:initialize_megatron",
    "allow_no_cuda",
    "pretrain() calls initialize_megatron without allow_no_cuda, which asserts a GPU.",
    wraps=True,
)
_cpu(
    "megatron.training.arguments:get_device_arch_version",
    "no_device_architecture",
    "validate_args asks the GPU for its architecture when TP/CP > 1; there is no driver to ask.",
    wraps=True,
)
_cpu(
    "megatron.training.training:set_jit_fusion_options",
    "skip_jit_warmup",
    "The fused-kernel warm-up compiles CUDA kernels; on CPU it costs ~30 s and gains nothing.",
    wraps=True,
)
_cpu(
    "megatron.training.training:build_train_valid_test_data_iterators",
    "keep_rng_across_data_iterators",
    "Data-iterator construction draws from the CPU generator, which is also the stand-in "
    "CUDA generator here; forking keeps dropout identical between resumed and continuous runs.",
    wraps=True,
)


# --------------------------------------------------------------------------------------
# Seams: private megatron-core / torch / argparse surfaces megatron-ext depends on without
# replacing them (overridden private methods, private functions it calls, classes whose
# instances it adopts, private attributes it reads). Each is declared once with why; the
# product obtains private symbols through private() and adopts instances through adopt(),
# and verify_seams() (run by install()) checks each still exists with the signature it was
# written against. tests/unit_tests/test_registry_static.py fails on an undeclared one.
# --------------------------------------------------------------------------------------
SEAM_KINDS = (
    "private_method_override",  # a subclass of ours overrides this private method
    "private_function",  # we call this private function or method
    "class_adoption",  # we turn a built instance of this class into our subclass (__class__)
    "private_attribute",  # we read this private attribute (``()`` in a target: of an instance)
    "object_attribute",  # we rewrite this attribute on objects megatron built
)


class SeamMismatchError(RuntimeError):
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
        raise ValueError(f"seam {seam.target!r}: kind {seam.kind!r} is not one of {SEAM_KINDS}")
    if seam.target in _SEAMS:
        raise ValueError(f"seam target {seam.target!r} is declared twice")
    if ":" not in seam.target:
        raise ValueError(f"seam target {seam.target!r} must look like 'module:qualname'")
    _SEAMS[seam.target] = seam
    return seam


def seams(kind: str | None = None) -> list[Seam]:
    """The declared seams, optionally only those of one kind."""
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
    if target not in _SEAMS:
        raise KeyError(f"{target!r} is not a declared seam in megatron_ext/registry.py")
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
    problems = [(s, p) for s in _SEAMS.values() if (p := seam_problem(s)) is not None]
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


_TORCH = ("2.14",)
_PYTHON = ("3.12",)

_MCORE = "megatron.core"
_LAYER = f"{_MCORE}.transformer.transformer_layer:TransformerLayer"
_MTP = f"{_MCORE}.transformer.multi_token_prediction"
_BRIDGE = f"{_MCORE}.pipeline_parallel.bridge_communicator:BridgeCommunicator"
_MULTIMODULE = f"{_MCORE}.pipeline_parallel.multimodule_communicator"
_RANDOM = f"{_MCORE}.tensor_parallel.random"

# ---- overridden private methods -------------------------------------------------------
declare(
    Seam(
        f"{_LAYER}._forward_attention",
        "private_method_override",
        "HyperConnectionTransformerLayer runs the attention sub-layer on the n streams "
        "(aggregate, attend, merge); TransformerLayer.forward calls this hook.",
        (
            "self",
            "hidden_states",
            "attention_mask",
            "context",
            "context_mask",
            "rotary_pos_emb",
            "rotary_pos_cos",
            "rotary_pos_sin",
            "rotary_pos_cos_sin",
            "attention_bias",
            "inference_context",
            "packed_seq_params",
            "sequence_len_offset",
            "padding_mask",
            "inference_params",
        ),
    )
)
declare(
    Seam(
        f"{_LAYER}._forward_mlp",
        "private_method_override",
        "HyperConnectionTransformerLayer runs the MLP sub-layer on the n streams.",
        ("self", "hidden_states", "inference_context", "padding_mask", "packed_seq_params"),
    )
)
declare(
    Seam(
        f"{_MTP}:MultiTokenPredictionLayer._concat_embeddings",
        "private_method_override",
        "The Hybrid mHC MTP layer contracts the n streams before concatenating the embedding.",
        ("self", "hidden_states", "decoder_input"),
    )
)
declare(
    Seam(
        f"{_MTP}:MultiTokenPredictionLayer._postprocess",
        "private_method_override",
        "The Hybrid mHC MTP layer keeps its output as n streams for the next depth.",
        ("self", "hidden_states"),
    )
)
declare(
    Seam(
        f"{_BRIDGE}._get_or_create_broadcast_pg",
        "private_method_override",
        "GridBridgeCommunicator creates the broadcast groups on the grids' backend (upstream "
        "hard-codes nccl, which fails on CPU/gloo) and caches them per pipeline.",
        ("ranks_list",),
    )
)
declare(
    Seam(
        f"{_BRIDGE}._get_or_create_bridge_pg",
        "private_method_override",
        "GridBridgeCommunicator: the leader (bridge) groups, likewise on the grids' backend.",
        ("ranks",),
    )
)
declare(
    Seam(
        f"{_MULTIMODULE}:MultiModulePipelineCommunicator._build_bridge_comms",
        "private_method_override",
        "MultiModuleCommunicator builds GridBridgeCommunicators instead of megatron's bridges.",
        ("self",),
    )
)
declare(
    Seam(
        "torch.nn.modules.module:Module._apply",
        "private_method_override",
        "HyperConnectionModule keeps its mapping parameters fp32 when the model is cast to "
        "bf16/fp16 (.half(), Float16Module): every cast goes through _apply.",
        ("self", "fn", "recurse"),
        _TORCH,
    )
)

# ---- private functions called --------------------------------------------------------
declare(
    Seam(
        f"{_RANDOM}:_get_all_rng_states",
        "private_function",
        "mHC recompute saves the CPU, CUDA and tracker RNG states at the first forward so the "
        "recomputed dropout masks match.",
        (),
    )
)
declare(
    Seam(
        f"{_RANDOM}:_set_all_rng_states",
        "private_function",
        "mHC recompute restores those states before recomputing.",
        ("cpu_rng_state", "cuda_rng_state", "cuda_rng_state_tracker"),
    )
)
declare(
    Seam(
        f"{_RANDOM}:_fork_rng",
        "private_function",
        "mHC recompute restores the caller's RNG states after recomputing.",
        (),
    )
)
declare(
    Seam(
        f"{_MULTIMODULE}:_prepare_tensor_for_comm",
        "private_function",
        "MultiModuleCommunicator shapes tensors for the bridge exactly as megatron's does.",
        ("tensor",),
    )
)
declare(
    Seam(
        f"{_MULTIMODULE}:_restore_tensor_from_comm",
        "private_function",
        "MultiModuleCommunicator restores received tensors exactly as megatron's does.",
        ("tensor",),
    )
)
declare(
    Seam(
        f"{_MCORE}.pipeline_parallel.schedules:_build_default_pg_collection",
        "private_function",
        "Schedule tracing hands the schedule the process groups it would build itself.",
        (),
    )
)
declare(
    Seam(
        f"{_MCORE}.parallel_state:_set_global_memory_buffer",
        "private_function",
        "Multi-module pipelines never call initialize_model_parallel, which creates the global "
        "memory buffer local attention needs; there is no public creator.",
        (),
    )
)
declare(
    Seam(
        "torch.autograd:_is_checkpoint_valid",
        "private_function",
        "mHC recompute refuses torch.autograd.grad through a recomputed region, as megatron's "
        "CheckpointFunction does.",
        (),
        _TORCH,
    )
)
declare(
    Seam(
        "argparse:ArgumentParser._get_formatter",
        "private_function",
        "The --help repair formats each help string as argparse would.",
        ("self",),
        _PYTHON,
    )
)
declare(
    Seam(
        "argparse:HelpFormatter._expand_help",
        "private_function",
        "The --help repair finds megatron help strings that do not %-format.",
        ("self", "action"),
        _PYTHON,
    )
)
declare(
    Seam(
        "sys:_current_frames",
        "private_function",
        "The stall watchdog's heartbeat names where a rank's main thread is (and whether it waits "
        "on a peer) from another thread; Python has no public way to read a thread's frame.",
        (),
        _PYTHON,
    )
)

# ---- class adoptions ------------------------------------------------------------------
declare(
    Seam(
        f"{_MCORE}.transformer.transformer_block:TransformerBlock",
        "class_adoption",
        "megatron's GPTModel builds its decoder block itself; HyperConnectionTransformerBlock "
        "adopts it in place (its attributes: config, layers, final_layernorm, post_process).",
        (
            "config",
            "spec",
            "post_layer_norm",
            "pre_process",
            "post_process",
            "pg_collection",
            "vp_stage",
        ),
    )
)
declare(
    Seam(
        f"{_MTP}:MultiTokenPredictionBlock",
        "class_adoption",
        "megatron's HybridModel builds its MTP block itself; HyperConnectionMTPBlock adopts it.",
        (
            "config",
            "spec",
            "vp_stage",
            "pg_collection",
            "mtp_layer_pattern",
            "mtp_num_depths",
            "hybrid_submodules",
            "mamba_submodules",
            "name",
        ),
    )
)

# ---- private attributes read -----------------------------------------------------------
declare(
    Seam(
        "argparse:ArgumentParser()._option_string_actions",
        "private_attribute",
        "Our flags and their aliases skip spellings megatron's parser already declares.",
        None,
        _PYTHON,
    )
)
declare(
    Seam(
        "argparse:ArgumentParser()._actions",
        "private_attribute",
        "The --help repair and the parser-default check walk every action of megatron's parser.",
        None,
        _PYTHON,
    )
)
declare(
    Seam(
        "torch.distributed.distributed_c10d:_world.pg_map",
        "private_attribute",
        "Tests release the process groups they created (torch lists them nowhere public).",
        None,
        _TORCH,
    )
)

# ---- attributes rewritten on objects megatron built -------------------------------------
declare(
    Seam(
        "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel",
        "object_attribute",
        "Tests empty a finished DDP's grad_accs (each parameter's grad-accumulator node, whose "
        "hook refers back to the DDP): that cycle runs through C++, so Python's collector never "
        "frees the model, its optimizer or its process groups (and their gloo threads).",
    )
)
declare(
    Seam(
        "argparse:Action",
        "object_attribute",
        "megatron-core 0.19.2 has a help string with a bare '%' that breaks --help; its help is "
        "rewritten with the '%' escaped.",
        None,
        _PYTHON,
    )
)
