"""The one registry of replaced megatron-core (and torch) attributes.

Everything megatron-ext swaps out at runtime is declared here as a :class:`Patch`:
the target (``module:attribute``), how to build the replacement from the original,
the megatron-core versions it was verified against, and why it is needed. Nothing
else in the package assigns attributes on foreign modules.

Patches come in groups. ``"core"`` patches are what :func:`megatron_ext.install`
applies on any machine; ``"cpu"`` patches are the CPU runtime's redirections and are
applied only by :func:`megatron_ext.runtime.use_cpu`. Applying is idempotent and
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
        return self.distribution_path is not None and os.path.realpath(self.path) == os.path.realpath(
            self.distribution_path
        )

    def describe(self) -> str:
        where = f"megatron-core {self.version} (code at {self.path}"
        if self.distribution_version is None:
            return where + "; no megatron-core distribution is installed, so a checkout on the path)"
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
    version = ".".join(str(part) for part in package_info.VERSION[:3]) + str(package_info.VERSION[3])
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
    check_megatron_core_version(group_patches)
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
        make=lambda _original: importlib.import_module(
            "megatron_ext.pipeline.p2p"
        ).batched_p2p_ops_forward_first,
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
            "that shape these tensors (pipeline.consistency), and every send's shape."
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

    register(Patch(target=f"megatron.core.pipeline_parallel.schedules:{attribute}", make=make,
                   why=why, group="trace"))


_trace("forward_step", "traced_forward_step",
       "Both pipelined schedules run every forward pass through it, with the micro-batch and "
       "the virtual chunk as arguments: the one place to time and label an F.")
_trace("backward_step", "traced_backward_step",
       "Every single-module backward pass; its output tensor identifies the micro-batch and chunk.")
_trace("backward_step_multimodule", "traced_backward_step",
       "The multi-module schedule's backward pass (bound by name at each schedule call).")
_trace("forward_backward_pipelining_without_interleaving", "traced_schedule",
       "1F1B: one iteration per call; its P2P communicator is handed over wrapped in a recorder "
       "(the schedule exposes no hook around its exchanges).")
_trace("forward_backward_pipelining_with_interleaving", "traced_schedule",
       "The interleaved schedule, likewise.")


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


_cpu("torch.cuda:current_device", "current_device",
     "megatron allocates P2P, shape-exchange and grad buffers on torch.cuda.current_device().")
_cpu("torch.cuda:device_count", "device_count",
     "megatron.training initialises its model-parallel groups only when a device is counted.")
_cpu("torch.cuda:set_device", "set_device",
     "megatron.training binds each rank to a GPU at start-up.")
_cpu("torch.cuda:synchronize", "synchronize",
     "P2P communication and DDP synchronise the GPU; CPU work is already ordered.")
_cpu("torch.cuda:get_rng_state", "get_rng_state",
     "megatron's CUDA RNG tracker saves generator states; the CPU generator stands in.")
_cpu("torch.cuda:set_rng_state", "set_rng_state",
     "megatron's CUDA RNG tracker restores generator states; the CPU generator stands in.")
_cpu("torch.cuda:manual_seed", "manual_seed",
     "model_parallel_cuda_manual_seed seeds the tracker's per-TP-rank streams through it.")
_cpu("torch.cuda:manual_seed_all", "manual_seed",
     "Same as torch.cuda.manual_seed, for callers that seed every device.")
_cpu("megatron.core.tensor_parallel.random:_get_cuda_rng_state", "megatron_get_rng_state",
     "The tracker's fork() reads the CUDA default generator directly.")
_cpu("megatron.core.tensor_parallel.random:_set_cuda_rng_state", "megatron_set_rng_state",
     "The tracker's fork() writes the CUDA default generator directly (lazily, via CUDA init).")
_cpu("torch.cuda:Stream", "FakeStream",
     "DDP and megatron.training create side streams for communication and model wrapping.")
_cpu("torch.cuda:Event", "FakeEvent",
     "Timers and DDP record CUDA events.")
_cpu("torch.cuda:current_stream", "current_stream",
     "DDP's grad buffers order their collectives after the current stream.")
_cpu("torch.cuda:default_stream", "current_stream",
     "Some paths wait on the default stream.")
_cpu("torch.cuda:stream", "stream",
     "megatron.training wraps DDP construction in `with torch.cuda.stream(s)`.")
_cpu("megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu",
     "host_copy_as_on_gpu",
     "The alltoall MoE dispatcher expects its split sizes as host numpy arrays after this call; "
     "on CPU it would leave torch tensors, which all_to_all_single's binding rejects.",
     wraps=True)
_cpu("megatron.training.training:initialize_megatron", "allow_no_cuda",
     "pretrain() calls initialize_megatron without allow_no_cuda, which asserts a GPU.",
     wraps=True)
_cpu("megatron.training.arguments:get_device_arch_version", "no_device_architecture",
     "validate_args asks the GPU for its architecture when TP/CP > 1; there is no driver to ask.",
     wraps=True)
_cpu("megatron.training.training:set_jit_fusion_options", "skip_jit_warmup",
     "The fused-kernel warm-up compiles CUDA kernels; on CPU it costs ~30 s and gains nothing.",
     wraps=True)
_cpu("megatron.training.training:build_train_valid_test_data_iterators",
     "keep_rng_across_data_iterators",
     "Data-iterator construction draws from the CPU generator, which is also the stand-in "
     "CUDA generator here; forking keeps dropout identical between resumed and continuous runs.",
     wraps=True)
