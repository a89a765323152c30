"""The training steps both pretraining entries share (:mod:`megatron_ext.pretrain_gpt` and
:mod:`megatron_ext.pretrain_hybrid`): megatron-ext's flags and the flag checks, the model's
TransformerConfig from the flags, batches, the loss, the forward step, the GPT datasets and the
hand-off to ``megatron.training.pretrain``. Only the model differs between the entries; each
passes its own ``model_provider`` (and flag check) to :func:`train`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.parallel_state import get_context_parallel_group
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import (
    StragglerDetector,
    get_attr_wrapped_model,
    get_batch_on_this_cp_rank,
    get_batch_on_this_tp_rank,
    get_model_config,
)
from megatron.training import get_args, get_timers, get_tokenizer, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.training import set_startup_timestamps
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

from megatron_ext import guards, registry
from megatron_ext.config import MHCTransformerConfig
from megatron_ext.launch import stop_signals, training as launch
from megatron_ext.mhc import stats_logging
from megatron_ext.mhc_flags import MHC_ALIASES
from megatron_ext.models.lm_loss import masked_token_loss
from megatron_ext.pipeline import consistency, selection

# Megatron-LM's default: pretraining reads GPT-2 BPE unless told otherwise.
ENTRY_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}

# A loss 10x the largest seen so far is reported as a spike (--check-for-spiky-loss).
SPIKY_LOSS_FACTOR = 10

# What get_batch returns, in this order.
BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")

# Flags that upstream's pretrain_gpt.py serves with code paths that this entry does not have.
UNSUPPORTED_FLAGS = {
    "sft": "--sft (SFT datasets and packed sequences)",
    "fim_data": "--fim-data (fill-in-the-middle datasets)",
    "dataloader_inter_document_masking": "--dataloader-inter-document-masking (packed sequences)",
    "hybrid_context_parallel": "--hybrid-context-parallel",
    "logits_load_dir": "--logits-load-dir (cached-logits distillation)",
}

stimer = StragglerDetector()


# ---- extra arguments ------------------------------------------------------------------------------
# Upstream dev's (and DeepSeek-V4 configs') spellings of the same two fields, accepted as aliases.
FLAG_ALIASES = {alias.main_flag: (alias.dev_flag,) for alias in MHC_ALIASES}


def _add_flag(parser: argparse.ArgumentParser, group, flag: str, **kwargs) -> None:
    """Add ``flag`` and its aliases, leaving out any spelling the parser already declares
    (a Megatron-LM whose TransformerConfig has the field itself): a second declaration would
    make argparse raise "conflicting option string"."""
    declared = parser._option_string_actions
    names = [name for name in (flag, *FLAG_ALIASES.get(flag, ())) if name not in declared]
    if names:
        group.add_argument(*names, dest=flag[2:].replace("-", "_"), **kwargs)


def add_megatron_ext_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """megatron-ext's own flags, in their own group of ``--help``, spelled as upstream
    Megatron-LM main spells them (so command lines move between the two); upstream dev's
    ``--enable-hyper-connections`` and ``--num-residual-streams`` are accepted as aliases. They
    fill the fields of :class:`megatron_ext.config.MHCTransformerConfig` of the same names."""
    defaults = MHCTransformerConfig.__dataclass_fields__
    group = parser.add_argument_group(title="megatron-ext", description="mHC residual streams")
    _add_flag(
        parser,
        group,
        "--enable-mhc-connections",
        action="store_true",
        help="n manifold-constrained hyper-connection residual streams per layer "
        "(alias: --enable-hyper-connections)",
    )
    _add_flag(
        parser,
        group,
        "--mhc-num-residual-streams",
        type=int,
        default=defaults["mhc_num_residual_streams"].default,
        help="n, the number of residual streams (alias: --num-residual-streams)",
    )
    _add_flag(
        parser,
        group,
        "--mhc-sinkhorn-iterations",
        type=int,
        default=defaults["mhc_sinkhorn_iterations"].default,
        help="Sinkhorn-Knopp iterations making H_res doubly stochastic",
    )
    _add_flag(
        parser,
        group,
        "--mhc-h-res-method",
        choices=("sinkhorn", "birkhoff"),
        default=defaults["mhc_h_res_method"].default,
        help="H_res: Sinkhorn-Knopp on n^2 logits (upstream) or birkhoff (mHC-lite: softmax "
        "over the n! permutation matrices, exactly doubly stochastic; n <= 6, no fused kernel)",
    )
    _add_flag(
        parser,
        group,
        "--mhc-variant",
        choices=("megatron", "deepseek-v4", "glm5"),
        default=defaults["mhc_variant"].default,
        help="the maps' formulas: megatron (upstream main), deepseek-v4 (DeepSeek-V4's maps, "
        "learned hc_head) or glm5 (DeepSeek-V4's maps, mean head); no fused kernel",
    )
    _add_flag(
        parser,
        group,
        "--mhc-init-gating-factor",
        type=float,
        default=defaults["mhc_init_gating_factor"].default,
        help="initial alpha_pre/alpha_post/alpha_res",
    )
    _add_flag(
        parser,
        group,
        "--mhc-learned-output-contract",
        action="store_true",
        help="GPT: contract the streams with upstream dev's learned contraction "
        "(decoder.hc_head_*) instead of the mean; loads dev GPT checkpoints",
    )
    _add_flag(
        parser,
        group,
        "--mhc-single-pass",
        action="store_true",
        help="DeepSeek-V4.1 single-pass mHC: each sub-layer aggregates with the previous "
        "sub-layer's coefficients (under PP they travel with the streams)",
    )
    _add_flag(
        parser,
        group,
        "--use-fused-mhc",
        action="store_true",
        help="run the mHC maths through the fused Triton kernels (CUDA; needs triton, "
        "n <= 8) instead of the native path",
    )
    _add_flag(
        parser,
        group,
        "--log-mhc-stats",
        action="store_true",
        help="log mHC statistics on the log interval (a fixed sample of tokens): per sub-layer "
        "H_res row/column residual and H_pre/H_post ranges, the composite forward and backward "
        "gains (TensorBoard mhc/...)",
    )
    _add_flag(
        parser,
        group,
        "--mhc-recompute-layer-num",
        type=int,
        default=None,
        help="layers per mHC recompute group with --recompute-modules mhc "
        "(default: the whole stage is one group)",
    )
    add_pipeline_schedule_arg(parser)
    return parser


def add_pipeline_schedule_arg(parser: argparse.ArgumentParser) -> None:
    """``--pipeline-schedule``, which fills MHCTransformerConfig.pipeline_schedule."""
    field = MHCTransformerConfig.__dataclass_fields__.get(selection.FIELD)
    group = parser.add_argument_group(title="megatron-ext pipeline", description="schedule")
    _add_flag(
        parser,
        group,
        selection.FLAG,
        choices=selection.SCHEDULES,
        default=field.default if field is not None else selection.ONE_F_ONE_B,
        help="1f1b: megatron's 1F1B (interleaved with virtual stages); zb-h1: megatron-ext's "
        "zero-bubble ZB-H1 (backward split into input and weight gradients, the weight "
        "gradients fill the pipeline bubble; more than one stage, no virtual stages)",
    )
    _add_flag(
        parser,
        group,
        selection.FILE_FLAG,
        default=None,
        help="with --pipeline-schedule zb-h1: a schedule text (one line per rank, F0 B0 W0 ..., "
        "as megatron-ext schedule --format text writes) whose order ZB-H1 executes, after "
        "checking its dependencies, P2P pairing and peak in-flight micro-batches",
    )


def reject_unsupported_flags(
    args: argparse.Namespace, entry: str = "megatron_ext.pretrain_gpt"
) -> None:
    """Refuse the flags of :data:`UNSUPPORTED_FLAGS`, naming upstream's script of ``entry``."""
    used = [flag for dest, flag in UNSUPPORTED_FLAGS.items() if getattr(args, dest, None)]
    if used:
        raise SystemExit(
            f"{entry} does not support " + ", ".join(used) + ". "
            f"Use Megatron-LM's own {entry.rsplit('.', 1)[-1]}.py for these."
        )


def fall_back_to_local_layers(args: argparse.Namespace) -> None:
    """An explicit ``--transformer-impl transformer_engine`` without TE builds local layers."""
    if args.transformer_impl == "transformer_engine" and not launch.transformer_engine_available():
        print_rank_0(
            "WARNING: --transformer-impl transformer_engine was requested but transformer_engine "
            "is not importable; building megatron-core's local layers instead."
        )
        args.transformer_impl = "local"


# ---- model config ---------------------------------------------------------------------------------
def transformer_config(
    args: argparse.Namespace, config_class: type[TransformerConfig]
) -> TransformerConfig:
    """The model's TransformerConfig, as ``config_class``, from the parsed flags.

    ``config_class`` receives every flag whose name matches one of its fields. Megatron itself
    substitutes its MLA or heterogeneous config class when those flags are set.
    """
    if args.yaml_cfg is not None:
        if config_class is not TransformerConfig:
            raise SystemExit(
                f"--yaml-cfg builds megatron's own TransformerConfig; it cannot build "
                f"{config_class.__name__}. Pass the model's flags on the command line instead."
            )
        from megatron.training.yaml_arguments import core_transformer_config_from_yaml

        return core_transformer_config_from_yaml(args, "language_model")
    if getattr(args, "multi_latent_attention", False) and issubclass(
        config_class, MHCTransformerConfig
    ):
        return _mhc_mla_config(args, config_class)
    return core_transformer_config_from_args(args, config_class=config_class)


# Where core_transformer_config_from_args looks up its MLA config class (see the registry).
MLA_CONFIG_PATCH = "megatron.core.transformer:MLATransformerConfig"


def _mhc_mla_config(args: argparse.Namespace, config_class: type[TransformerConfig]):
    """The MLA config with the mHC fields: megatron substitutes its own MLATransformerConfig
    for any class it is given under --multi-latent-attention, so it gets ours instead."""
    from megatron_ext.config import MHCMLATransformerConfig

    if config_class not in (MHCTransformerConfig, MHCMLATransformerConfig):
        raise SystemExit(
            f"--multi-latent-attention builds megatron_ext.config.MHCMLATransformerConfig; "
            f"{config_class.__name__} has no MLA variant. Subclass MHCMLATransformerConfig and "
            "pass that as the entry's config_class"
        )
    with registry.applied(MLA_CONFIG_PATCH):
        return core_transformer_config_from_args(args, config_class=MHCMLATransformerConfig)


def agreed_run_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The flags beyond the TransformerConfig that shape the tied embedding (all-reduced across
    the first and last stages while they are built) and the tensors the stages exchange."""
    return {
        "share_embeddings_and_output_weights": not args.untie_embeddings_and_output_weights,
        "padded_vocab_size": args.padded_vocab_size,
        "seq_length": args.seq_length,
        "micro_batch_size": args.micro_batch_size,
    }


def stage_config(
    args: argparse.Namespace,
    config: TransformerConfig | None,
    config_class: type[TransformerConfig],
    pg_collection=None,
) -> TransformerConfig:
    """This stage's TransformerConfig (from the flags unless ``pretrain`` passes one), agreed
    with every other pipeline stage before the model is built (on the provider's first call;
    see :mod:`megatron_ext.pipeline.consistency`): megatron-core all-reduces the tied
    embedding inside the constructor, where stages built differently fail without naming
    who differs. Raises PipelineConsistencyError on every rank of the pipeline group."""
    if config is None:
        config = transformer_config(args, config_class)
    _check_config_schedule(args, config)
    group = getattr(pg_collection, "pp", None)
    if group is None and mpu.model_parallel_is_initialized():
        group = mpu.get_pipeline_model_parallel_group()
    consistency.agree_before_build(config, group, agreed_run_fields(args))
    return config


def _check_config_schedule(args: argparse.Namespace, config: TransformerConfig) -> None:
    """The config runs the schedule the flags chose (a config class without the
    pipeline_schedule field would build layers that never defer a weight gradient), and the
    config's settings allow it (the flags check saw the arguments only)."""
    wanted, built = selection.selected_schedule(args), selection.selected_schedule(config)
    if wanted != built:
        raise SystemExit(
            f"error: {selection.FLAG} {wanted}: the model's config ({type(config).__name__}) "
            f"has {selection.FIELD}={built!r}; build it from MHCTransformerConfig (the "
            "entry's default config_class) or a subclass"
        )
    wanted_file = getattr(args, selection.FILE_FIELD, None)
    if wanted_file != getattr(config, selection.FILE_FIELD, None):
        raise SystemExit(
            f"error: {selection.FILE_FLAG} {wanted_file}: the model's config "
            f"({type(config).__name__}) has {selection.FILE_FIELD}="
            f"{getattr(config, selection.FILE_FIELD, None)!r}; build it from "
            "MHCTransformerConfig (the entry's default config_class) or a subclass"
        )
    guards.check_schedule_supported(config)


def language_model_kwargs(
    args: argparse.Namespace, pre_process: bool, post_process: bool
) -> dict[str, Any]:
    """The constructor arguments GPTModel and HybridModel take alike from the flags."""
    return dict(
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
    )


# ---- batches, loss and the forward step ---------------------------------------------------------
def _stage_reads_data(vp_stage: int | None, config: TransformerConfig) -> tuple[bool, bool]:
    """(does this stage read batches, does it host MTP layers). The first stage embeds
    tokens, the last computes the loss, and MTP layers need both tokens and labels."""
    mtp_here = mtp_on_this_rank(
        layout=config.pipeline_model_parallel_layout,
        mtp_num_layers=config.mtp_num_layers,
        ignore_virtual=False,
        vp_stage=vp_stage,
    )
    return is_first_or_last_pipeline_stage(vp_stage) or mtp_here, mtp_here


def _next_batch_on_device(data_iterator) -> dict[str, torch.Tensor | None]:
    """TP rank 0's micro-batch, restricted to the keys the model reads (a blended dataset adds
    provenance keys, which the context-parallel split must not try to slice)."""
    sample = next(data_iterator)
    return {
        key: sample[key].cuda(non_blocking=True) if sample.get(key) is not None else None
        for key in BATCH_KEYS
    }


def get_batch(data_iterator, vp_stage: int | None, config: TransformerConfig):
    """(tokens, labels, loss_mask, attention_mask, position_ids) for this rank.

    Only TP rank 0 reads the iterator, and it broadcasts the batch to the other TP ranks. Each
    context-parallel rank then keeps its share of the sequence. Middle pipeline stages get
    Nones because their input arrives from the previous stage.
    """
    reads_data, mtp_here = _stage_reads_data(vp_stage, config)
    if not reads_data:
        return (None,) * len(BATCH_KEYS)
    args = get_args()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = _next_batch_on_device(data_iterator) if tp_rank == 0 else {}
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=mtp_here,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    batch = get_batch_on_this_cp_rank(
        batch, is_hybrid_cp=False, cp_group=get_context_parallel_group()
    )
    return tuple(batch.get(key) for key in BATCH_KEYS)


def _validate_loss(loss: torch.Tensor, args: argparse.Namespace) -> None:
    """NaN/Inf and spike checks on this rank's loss, before any reduction mixes ranks."""
    rerun_state_machine = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for rejection_func, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rerun_state_machine.validate_result(
                result=loss,
                rejection_func=rejection_func,
                message=f"found {what} in local forward loss calculation",
                tolerance=0.0,  # the forward pass is deterministic
                fatal=True,
            )
    if args.check_for_spiky_loss:
        rerun_state_machine.validate_result(
            result=loss,
            rejection_func=partial(
                rerun_state_machine.is_unexpectedly_large,
                threshold=SPIKY_LOSS_FACTOR,
                context="loss",
            ),
            message="Spiky loss",
            tolerance=0.0,
            fatal=False,
        )


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model=None):
    """Sum of the per-token losses under the mask, and the number of tokens counted.

    megatron-core's schedules sum both over micro-batches (and data-parallel ranks) and divide
    at the end, so the loss is a true per-token mean however the masks vary. The report entry
    ``[loss_sum, num_tokens]`` is what ``lm loss`` is logged from.
    """
    loss, mask = masked_token_loss(loss_mask, output_tensor)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    _validate_loss(loss, get_args())
    return loss, num_tokens, report


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """One micro-batch forward: this stage's output, and the loss function to apply to it."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    with stimer(bdata=True):
        vp_stage = get_attr_wrapped_model(model, "vp_stage")
        tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
            data_iterator, vp_stage, get_model_config(model)
        )
    timers("batch-generator").stop()

    if return_schedule_plan:
        # Only the MoE comm-overlap schedule asks for a plan instead of running the forward.
        assert get_args().overlap_moe_expert_parallel_comm, (
            "a schedule plan is only built with --overlap-moe-expert-parallel-comm"
        )
        plan = model.build_schedule_plan(
            tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask
        )
        return plan, partial(loss_func, loss_mask, model=model)

    with stimer:
        output_tensor = model(
            tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask
        )
    return output_tensor, partial(loss_func, loss_mask, model=model)


# ---- datasets ------------------------------------------------------------------------------------
def is_dataset_built_on_rank(vp_stage: int | None = None) -> bool:
    # Only stages that read batches need a dataset, and TP rank 0 reads for its group.
    return is_first_or_last_pipeline_stage(vp_stage) and mpu.get_tensor_model_parallel_rank() == 0


def _sequences_per_dataset(args: argparse.Namespace) -> dict | None:
    if args.per_dataset_sequences_path is None:
        return None
    with open(args.per_dataset_sequences_path) as f:
        return json.load(f)


def gpt_dataset_config(args: argparse.Namespace) -> GPTDatasetConfig:
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        fast_cache_load=args.dataloader_fast_cache_load,
        sequences_per_dataset=_sequences_per_dataset(args),
        defer_npy_index_mmap=args.dataloader_defer_npy_index_mmap,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage: int | None = None):
    """The train, validation and test datasets: mock with --mock-data, indexed otherwise."""
    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(
        dataset_type,
        train_val_test_num_samples,
        partial(is_dataset_built_on_rank, vp_stage=vp_stage),
        gpt_dataset_config(args),
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


# Every rank calls the provider; the builder itself decides which ranks build (see above).
# (megatron's attribute on the function, which a function's type does not declare)
train_valid_test_datasets_provider.is_distributed = True  # type: ignore[attr-defined]


# ---- entry ---------------------------------------------------------------------------------------
def train(
    model_provider: Callable[..., Any],
    program_start: float,
    check_args: Callable[[argparse.Namespace], None],
    config_class: type[TransformerConfig] = MHCTransformerConfig,
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
) -> None:
    """Parse the command line's Megatron flags, check them (``check_args``, the entry's own) and
    run ``pretrain`` with ``model_provider(..., config_class=config_class)`` (the entry's model)."""
    set_startup_timestamps(program_start=program_start, main_entry=time.time())
    stop_signals.install_rank_handlers(sys.argv[1:])  # a stop during start-up is held, not fatal
    runtime = launch.select_runtime()
    args = launch.parse_megatron_args(
        extra_args_providers=(add_megatron_ext_args, extra_args_provider),
        parser_defaults={**ENTRY_DEFAULTS, **launch.machine_defaults(on_cpu=runtime == "cpu")},
    )
    check_args(args)
    fall_back_to_local_layers(args)
    stats_logging.start_if_requested(args)
    launch.run_pretrain(
        args,
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        model_provider=partial(model_provider, config_class=config_class),
    )
