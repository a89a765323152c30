"""Every declared runtime replacement (:class:`~megatron_ext.registry.Patch`) and private
dependency (:class:`~megatron_ext.registry.Seam`) of megatron-ext, with versions and why.

The machinery (applying, undoing, checking versions and seams) is :mod:`megatron_ext.registry`,
which loads this module the first time it is asked for a patch or a seam. Each replacement is
named as data, ``"module:function"``, and imported only when its patch is applied, so this
module imports nothing of the product and the product's modules may use the registry freely.
"""

from __future__ import annotations

from megatron_ext.registry import Patch, Seam, declare, register

# --------------------------------------------------------------------------------------
# "startup" patch: applied only while a process imports megatron (megatron_ext.launch.startup).
# --------------------------------------------------------------------------------------
register(
    Patch(
        target="torch:compile",
        replacement="megatron_ext.launch.startup:compile_on_first_call",
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
# "config" patch: applied only while megatron_ext.training_steps.transformer_config builds an
# mHC config from --multi-latent-attention flags (registry.applied).
# --------------------------------------------------------------------------------------
register(
    Patch(
        target="megatron.core.transformer:MLATransformerConfig",
        replacement="megatron_ext.config:MHCMLATransformerConfig",
        wraps=False,
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
        replacement="megatron_ext.checkout:compile_helpers_when_missing",
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
        replacement="megatron_ext.pipeline.p2p:batched_p2p_ops_forward_first",
        wraps=False,
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
        replacement="megatron_ext.pipeline.shapes:communicate_with_pipeline_width",
        why=(
            "Every inter-stage message is the edge's typed stage payload packed into one tensor "
            "(pipeline.payload: with mHC and PP > 1 the n-stream residual [s, b, n*h], with "
            "single-pass mHC also the fp32 coefficients), but the schedules size fixed receive "
            "buffers from hidden_size (1F1B through get_tensor_shapes, the interleaved schedule "
            "inline, with no hook; megatron-ext's ZB-H1 through the same communicator). Every "
            "exchange passes through _communicate, the one place all can take the payload's "
            "width. The same seam "
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
        replacement="megatron_ext.guards:inference_wrapper_rejecting_mhc_pipeline",
        why=(
            "Inference wrappers receive pipeline activations into single-stream "
            "(hidden_size) buffers; with mHC and an inference pipeline group larger than one "
            "they would fail or misread. The group is resolved inside __init__ (inference "
            "config first, training groups otherwise), so the check runs right after it."
        ),
    )
)


register(
    Patch(
        target=(
            "megatron.core.transformer.multi_token_prediction:is_inference_column_parallel_linear"
        ),
        replacement="megatron_ext.models.te_absent:inference_linear_check_without_te",
        why=(
            "megatron-core 0.20.0 bug without Transformer Engine: MultiTokenPredictionLayer."
            "__init__ asks is_inference_column_parallel_linear (imported into the module, looked "
            "up there), whose isinstance gets TE's stand-ins instead of classes and raises "
            "TypeError, so no MTP layer builds on CPU. Where those linears are not classes the "
            "answer is False (no module can be one); otherwise the original answers. 0.19.2 "
            "has no such check."
        ),
        verified=("0.20.0",),
        applies_on=("0.20.0",),
    )
)


# --------------------------------------------------------------------------------------
# "trace" patches: applied only inside megatron_ext.schedules.trace.tracing() (megatron-ext
# run --trace); outside it nothing is wrapped, so tracing off costs nothing.
# --------------------------------------------------------------------------------------
def _trace(attribute: str, maker: str, why: str) -> None:
    register(
        Patch(
            target=f"megatron.core.pipeline_parallel.schedules:{attribute}",
            replacement=f"megatron_ext.schedules.trace:{maker}",
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

# megatron-ext's own ZB-H1 schedule (parallelism.schedule: zb-h1): its forwards and input
# gradients go through megatron's passes above; the schedule function and its weight-gradient
# step are ours, wrapped the same way.
register(
    Patch(
        target="megatron_ext.pipeline.zero_bubble:forward_backward_pipelining_zero_bubble_h1",
        replacement="megatron_ext.schedules.trace:traced_schedule",
        why=(
            "ZB-H1: one iteration per call, its P2P communicator handed over wrapped in a "
            "recorder, as for megatron's schedules."
        ),
        group="trace",
    )
)
register(
    Patch(
        target="megatron_ext.pipeline.zero_bubble:weight_gradient_step",
        replacement="megatron_ext.schedules.trace:traced_weight_gradient_step",
        why=(
            "ZB-H1 runs every deferred weight gradient (W) through this module-level function, "
            "looked up in its module at each call: the one place to time and label a W."
        ),
        group="trace",
    )
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
            replacement="megatron_ext.models.tied_output:init_without_dead_output_weight",
            why=_DEAD_MTP_OUTPUT_WEIGHT_WHY,
        )
    )


register(
    Patch(
        target="megatron.training.checkpointing:check_checkpoint_args",
        replacement="megatron_ext.guards.checkpoint_args:checking_model_settings",
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
        target="megatron.training.training:training_log",
        replacement="megatron_ext.mhc.stats_logging:logging_mhc_stats",
        why=(
            "--log-mhc-stats: megatron.training has no hook for model-specific scalars. Every "
            "rank calls training_log after every step (train() looks it up by name), so the "
            "wrapper gathers the mHC statistics recorded during a logged step there and writes "
            "them with megatron's TensorBoard writer. Without --log-mhc-stats it only calls the "
            "original."
        ),
    )
)


register(
    Patch(
        target="megatron.training.training:get_forward_backward_func",
        replacement="megatron_ext.pipeline.selection:choosing_pipeline_schedule",
        why=(
            "--pipeline-schedule zb-h1 (recipes: parallelism.schedule): megatron.training has no "
            "way to name a schedule; train() and evaluate() each call get_forward_backward_func "
            "(imported into megatron.training.training, looked up by name there) and use what "
            "it returns. The wrapper returns megatron's own function unless the run's "
            "arguments say zb-h1 and megatron would run 1F1B; then it returns megatron-ext's "
            "ZB-H1 (pipeline.zero_bubble), which runs the training steps and hands the "
            "forward-only ones (evaluation) to megatron's 1F1B. Same arguments, same return "
            "value (losses, tokens), so train_step, evaluate and finalize_model_grads are "
            "unchanged."
        ),
    )
)


register(
    Patch(
        target="megatron.training.checkpointing:_maybe_setup_gpt_to_hybrid_load",
        replacement="megatron_ext.guards.checkpoint_args:refusing_mhc_mismatch_before_loading",
        why=(
            "A torch_dist load reads tensors before check_checkpoint_args runs, so an mHC "
            "checkpoint with another stream count or H_res method (sinkhorn n² vs birkhoff n! "
            "logits) fails in dist checkpointing with a bare global shape mismatch. "
            "load_checkpoint calls this private function with the checkpoint's args before "
            "any tensor is read (looked up by name), so the mHC settings are compared there "
            "and the refusal names the flags to pass."
        ),
    )
)


register(
    Patch(
        target="megatron.training.checkpointing:maybe_msc",
        replacement="megatron_ext.checkpoint.tracker:AtomicTrackerStorage",
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
        replacement="megatron_ext.checkpoint.sync_save:results_queue_for_sync_saves",
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
        replacement="megatron_ext.launch.faults:killing_before_save_finalize",
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

    register(
        Patch(
            target=target,
            replacement=f"megatron_ext.runtime.cpu:{replacement_name}",
            why=why,
            group="cpu",
            wraps=wraps,
        )
    )


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
for _linear in ("ColumnParallelLinear", "RowParallelLinear"):
    declare(
        Seam(
            f"{_MCORE}.tensor_parallel.layers:{_linear}._forward_impl",
            "private_method_override",
            "megatron_ext.pipeline.wgrad's linears of the same name route the matmul through "
            "their deferrable-weight-gradient function when config.pipeline_schedule is zb-h1; "
            "forward calls this hook with keyword arguments (input, weight, bias, "
            "gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, "
            "grad_output_buffer, wgrad_deferral_limit, tp_group, gtp_remat_size), everything "
            "else of megatron's forward (TP mappings, bias handling) is kept.",
            ("self", "input", "weight", "args", "kwargs"),
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

declare(
    Seam(
        "torch.nn.modules.module:Module._load_from_state_dict",
        "private_method_override",
        "HyperConnectionModule refuses a state dict whose H_res block is the other "
        "mhc_h_res_method's width (sinkhorn n², birkhoff n!) with the flag to pass, before "
        "torch reports a bare size mismatch; then it defers to torch's.",
        (
            "self",
            "state_dict",
            "prefix",
            "local_metadata",
            "strict",
            "missing_keys",
            "unexpected_keys",
            "error_msgs",
        ),
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
        "Schedule tracing hands the schedule the process groups it would build itself; the "
        "ZB-H1 schedule builds the same default groups megatron's 1F1B builds.",
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

declare(
    Seam(
        "multiprocessing.util:_exit_function",
        "private_function",
        "A failing rank leaves at once through os._exit (launch.faults.run_failing_fast), "
        "which skips multiprocessing's clean-up: a Manager's server process stays and its "
        "pymp-* temporary directory with the listener-* socket is left behind (issue 41 item "
        "13). This is the function multiprocessing registers with atexit for that clean-up "
        "(shut Managers and Pools down, remove the temporary directory); Python has no public "
        "name for it.",
        None,
        _PYTHON,
    )
)

declare(
    Seam(
        "multiprocessing.process:current_process()._config",
        "private_attribute",
        "A rank of the local launcher takes the run's multiprocessing temporary directory as its "
        "own (launch.mp_temp_dir.share_with_children) before it starts any worker: the "
        "processes it starts inherit this dict, so every DataLoader worker's listener-* socket "
        "lies in the one directory the launcher removes, however the workers end (issue 41 item "
        "13: a signal ends them without multiprocessing's clean-up, and each left a pymp-* "
        "directory). Its 'tempdir' key is what multiprocessing.util.get_temp_dir reads and "
        "sets; Python has no public way to choose the directory.",
        None,
        _PYTHON,
    )
)

declare(
    Seam(
        "atexit:_run_exitfuncs",
        "private_function",
        "The megatron-ext program and the training entries (after a returned training, "
        "launch.startup.end_rank) run the exit handlers themselves, then leave through "
        "os._exit to skip the interpreter teardown of megatron's ~2,900 modules (issue 25 "
        "item 18); "
        "Python has no public way to run the atexit handlers early. A C function without a "
        "text signature: only its presence is checked.",
        None,
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

declare(
    Seam(
        "megatron.training.arguments:_add_tokenizer_args",
        "private_function",
        "prepare-data takes megatron's tokenizer defaults (special tokens, fast/slow HF, "
        "SentencePiece options) from megatron's own tokenizer argument group, as Megatron-LM's "
        "tools/preprocess_data.py does, so build_tokenizer sees what pretrain_gpt.py would.",
        ("parser",),
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
        f"{_MCORE}.tensor_parallel.layers:RowParallelLinear",
        "object_attribute",
        "megatron_ext.models.linears' RowParallelLinear sets explicit_expert_comm on an expert "
        "linear whose expert-TP group has one rank (megatron sets it only above one), so the "
        "forward skips the identity output reduce whose view output megatron's expert MLP "
        "adds its bias to in place (an autograd error at EP=1 with add_bias_linear=True).",
    )
)
declare(
    Seam(
        f"{_MCORE}.transformer.transformer_block:TransformerBlock.set_input_tensor",
        "object_attribute",
        "Single-pass mHC: a receiving stage's HyperConnectionTransformerBlock unpacks the stage "
        "payload that set_input_tensor stored as input_tensor and stores its hidden_states "
        "field back there, where TransformerBlock.forward reads its input when not "
        "pre_process (the coefficients field stays with the block).",
    )
)
declare(
    Seam(
        f"{_MCORE}.models.hybrid.hybrid_block:HybridStack.set_input_tensor",
        "object_attribute",
        "Single-pass mHC on the Hybrid stack: a receiving stage's HybridStack unpacks the stage "
        "payload that set_input_tensor stored as input_tensor and stores its hidden_states "
        "field back there, where HybridStack.forward reads its input when not pre_process "
        "(the coefficients field stays with the stack).",
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
