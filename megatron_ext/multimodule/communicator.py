"""megatron-core's multi-module communicator with its gaps closed, by subclassing.

:class:`GridBridgeCommunicator` is megatron-core's ``BridgeCommunicator`` whose leader and
broadcast groups use the grids' backend: upstream creates them with ``backend='nccl'``
(``_get_or_create_broadcast_pg`` / ``_get_or_create_bridge_pg``), which fails on CPU/gloo. It
also caches those groups per pipeline rather than per process, so a pipeline's
:meth:`~megatron_ext.multimodule.builder.MultiModulePipeline.destroy` releases them.

:class:`MultiModuleCommunicator` is megatron-core's ``MultiModulePipelineCommunicator`` with:

- one warm-up count per rank, from the stages downstream of it
  (:meth:`~megatron_ext.multimodule.plan.MultiModulePlan.warmup_on`), instead of the global
  longest path minus the position of the rank's first module. The schedule computes its
  warm-up as ``total_stages - current_stage - 1``; ``current_stage`` is defined so that this
  is the per-rank count. This is what lets encoders with different pipeline depths feed one
  language model (upstream deadlocks);
- gradients from several successors of one module summed (upstream keeps the last one);
- outgoing tensors checked before anything is sent: a module's last stage must return the
  ndim its bridges carry (else :class:`OutputNdimError`), and a tensor crossing an
  intra-module P2P link must not be 3-D with a singleton last dim (else
  :class:`AmbiguousShapeError`: it would arrive 2-D), and a tensor crossing a bridge must
  have the last dim its receiving module takes (``ModuleImpl.input_width``, or what the
  built module shows: ``builder.input_width_of``), else :class:`BridgeShapeError` naming
  both modules and both widths;
- such an error is carried downstream in the first micro-batch: instead of the activation the
  failing rank sends an abort marker (a tensor with no elements whose shape names the error),
  through megatron-core's own shape exchange, so every rank waiting for that micro-batch
  raises the same error class instead of waiting forever. Ranks upstream of the failing stage
  and sibling branches are not released (they are already past the exchange); they fail when
  the process-group timeout expires.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator
from megatron.core.pipeline_parallel.multimodule_communicator import (
    MultiModulePipelineCommunicator,
)

from megatron_ext import registry
from megatron_ext.multimodule.errors import (
    AmbiguousShapeError,
    BridgeShapeError,
    MultiModuleError,
    OutputNdimError,
)

# megatron's own reshaping for the bridge, so ours sends what its receivers expect.
_COMMUNICATOR = "megatron.core.pipeline_parallel.multimodule_communicator"
_prepare_tensor_for_comm = registry.private(f"{_COMMUNICATOR}:_prepare_tensor_for_comm")
_restore_tensor_from_comm = registry.private(f"{_COMMUNICATOR}:_restore_tensor_from_comm")

# Megatron's activations are [s, b, h].
MEGATRON_DIM_MAPPING = {"s": 0, "b": 1, "h": 2}

# Abort markers: every dim but the batch dim is the code, the batch dim is 0, so the marker
# has no elements and survives megatron's fan-in (cat) and fan-out (split) along the batch.
# The codes are far from any real hidden or sequence size.
_ABORT_CODES = {
    OutputNdimError: 1_000_003,
    AmbiguousShapeError: 1_000_033,
    BridgeShapeError: 1_000_037,
}
_ERROR_OF_CODE = {code: error for error, code in _ABORT_CODES.items()}


def abort_marker(
    error: type[MultiModuleError], ndim: int, batch_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    shape = [_ABORT_CODES[error]] * ndim
    shape[batch_dim if ndim == 3 else 0] = 0
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    return torch.empty(shape, dtype=dtype, device=device)


def aborted_with(tensor: Any) -> type | None:
    """The error class an abort marker names, or None for an ordinary tensor."""
    if isinstance(tensor, list):
        tensor = tensor[0] if len(tensor) == 1 else None
    if not isinstance(tensor, torch.Tensor) or tensor.numel() != 0:
        return None
    codes = {size for size in tensor.shape if size != 0}
    if len(codes) == 1 and (code := codes.pop()) in _ERROR_OF_CODE:
        return _ERROR_OF_CODE[code]
    return None


class GridBridgeCommunicator(BridgeCommunicator):
    """megatron-core's BridgeCommunicator with its groups on the grids' backend."""

    def __init__(self, *args: Any, pg_cache: dict, **kwargs: Any) -> None:
        self._pg_cache = pg_cache
        super().__init__(*args, **kwargs)

    def _backend(self) -> str | None:
        return self.src_grid.backend

    # Upstream calls these through ``self``, so instance methods take precedence over its
    # classmethods of the same name.
    def _get_or_create_broadcast_pg(self, ranks_list: list[list[int]]):
        key = ("broadcast", self._backend(), tuple(sorted(tuple(r) for r in ranks_list)))
        if key not in self._pg_cache:
            group, _ = dist.new_subgroups_by_enumeration(ranks_list, backend=self._backend())
            self._pg_cache[key] = group
        return self._pg_cache[key]

    def _get_or_create_bridge_pg(self, ranks: list[int]):
        key = ("bridge", self._backend(), tuple(sorted(ranks)))
        if key not in self._pg_cache:
            self._pg_cache[key] = dist.new_group(sorted(ranks), backend=self._backend())
        return self._pg_cache[key]


class MultiModuleCommunicator(MultiModulePipelineCommunicator):
    """megatron-core's multi-module communicator with per-rank warm-up, summed fan-out
    gradients and checked, abort-carrying sends (see the module docstring)."""

    def __init__(
        self,
        plan: Any,
        module_to_grid_map: dict,
        config: Any,
        module_output_ndim: dict[str, int],
        pg_cache: dict,
        input_width: dict[str, int] | None = None,
    ) -> None:
        self.plan = plan
        self.input_width = dict(input_width or {})
        self._pg_cache = pg_cache
        super().__init__(
            module_to_grid_map,
            {name: plan.successors(name) for name in module_to_grid_map},
            config,
            dim_mapping=dict(MEGATRON_DIM_MAPPING),
            module_output_ndim=dict(module_output_ndim),
        )

    def _build_bridge_comms(self) -> None:
        for src, src_grid in self.module_to_grid_map.items():
            for dst in self.topology[src]:
                self.bridge_comms.append(
                    GridBridgeCommunicator(
                        src_grid=src_grid,
                        dest_grid=self.module_to_grid_map[dst],
                        dim_mapping=self.dim_mapping,
                        comm_dtype=self.config.pipeline_dtype,
                        src_module_name=src,
                        dest_module_name=dst,
                        tensor_ndim=self.module_output_ndim.get(src, 3),
                        pg_cache=self._pg_cache,
                    )
                )

    # ------------------------------------------------------------------ warm-up
    @property
    def total_stages(self) -> int:
        return self.plan.total_stages

    @property
    def current_stage(self) -> int:
        """Chosen so that the schedule's ``total_stages - current_stage - 1`` is this rank's
        warm-up: the number of stages downstream of it."""
        return self.plan.total_stages - 1 - self.plan.warmup_on(self.current_rank)

    # ------------------------------------------------------------------ checks and aborts
    def _describe(self, name: str) -> str:
        info = self.rank_module_map[name]
        return f"rank {self.current_rank} (module {name!r}, pipeline stage {info.pp_rank} of {info.pp_size})"

    def _outgoing_problem(self, output_dict: dict) -> tuple[type, str] | None:
        for name, info in self.rank_module_map.items():
            last = info.pp_rank == info.pp_size - 1
            if last and not info.bridge_comms_as_src_module:
                continue  # the language model's last stage sends nothing
            tensor = output_dict.get(name) if isinstance(output_dict, dict) else None
            if isinstance(tensor, list) and len(tensor) == 1:
                tensor = tensor[0]
            if not isinstance(tensor, torch.Tensor):
                return (
                    OutputNdimError,
                    f"{self._describe(name)} must hand its successors a tensor under the key "
                    f"{name!r}, got {type(tensor).__name__}",
                )
            shape = tuple(tensor.shape)
            if last:
                expected = self.module_output_ndim.get(name, 3)
                if tensor.ndim != expected:
                    targets = [b.dest_module_name for b in info.bridge_comms_as_src_module]
                    return (
                        OutputNdimError,
                        f"{self._describe(name)} returned a {tensor.ndim}-D tensor {shape}, but "
                        f"its bridge(s) to {targets} were built for {expected}-D tensors; set "
                        f"output_ndim={tensor.ndim} for {name!r} in the plan (or give the "
                        f"module an output_ndim attribute), or return a {expected}-D tensor",
                    )
                problem = self._width_problem(name, info, shape)
                if problem is not None:
                    return BridgeShapeError, problem
            elif tensor.ndim not in (2, 3):
                return (
                    OutputNdimError,
                    f"{self._describe(name)} returned a {tensor.ndim}-D tensor {shape}; "
                    "stages of one module exchange 3-D [s, b, h] or 2-D [N, h] tensors",
                )
            elif tensor.ndim == 3 and shape[-1] == 1:
                return (
                    AmbiguousShapeError,
                    f"{self._describe(name)} returned the 3-D tensor {shape} with a singleton "
                    "last dim; megatron's intra-module P2P carries 2-D tensors as [N, h, 1] and "
                    "squeezes a trailing 1 on arrival, so this one would arrive 2-D. Give it a "
                    "last dim > 1 or send it 2-D",
                )
        return None

    def _width_problem(self, name: str, info: Any, shape: tuple) -> str | None:
        """The first bridge whose receiver takes another last dim than ``shape``'s."""
        for bridge in info.bridge_comms_as_src_module:
            dst = bridge.dest_module_name
            width = self.input_width.get(dst)
            if width is not None and shape[-1] != width:
                return (
                    f"bridge {name} -> {dst}: {self._describe(name)} sends {list(shape)} "
                    f"(width {shape[-1]}), but {dst!r} takes width {width} "
                    f"([s, b, {width}]); build {name!r} and {dst!r} with the same hidden size"
                )
        return None

    def _send_aborts(self, error: type) -> None:
        """Send the abort marker wherever this rank would send the next activation."""
        markers = {}
        for name, info in self.rank_module_map.items():
            if info.pp_rank == info.pp_size - 1:
                ndim = self.module_output_ndim.get(name, 3)
            else:
                ndim = 3
            markers[name] = abort_marker(
                error, ndim, self.dim_mapping["b"], self.config.pipeline_dtype
            )
        super().send_forward(markers)

    def _check_before_sending(self, output_dict: dict) -> None:
        problem = self._outgoing_problem(output_dict)
        if problem is not None:
            error, message = problem
            self._send_aborts(error)
            raise error(message)

    def _check_received(self, input_dict: dict, propagate: bool) -> None:
        for key, tensor in input_dict.items():
            error = aborted_with(tensor)
            if error is None:
                continue
            if propagate:
                self._send_aborts(error)
            names = ", ".join(repr(n) for n in self.rank_module_map)
            raise error(
                f"rank {self.current_rank} (module(s) {names}) received an abort marker from "
                f"{key!r} instead of an activation: an upstream stage raised {error.__name__} "
                "(its rank reports the details)"
            )

    # ------------------------------------------------------------------ the exchanges
    def recv_forward(self, tensor_shape=None, is_first_stage: bool = False) -> dict:
        received = super().recv_forward(tensor_shape, is_first_stage)
        self._check_received(received, propagate=True)
        return received

    def send_forward(self, output_dict: dict, is_last_stage: bool = False) -> None:
        self._check_before_sending(output_dict)
        super().send_forward(output_dict, is_last_stage)

    def send_backward_recv_forward(
        self, grad_dict, tensor_shape=None, is_first_stage: bool = False
    ):
        received = super().send_backward_recv_forward(grad_dict, tensor_shape, is_first_stage)
        self._check_received(received, propagate=False)
        return received

    def send_forward_recv_backward(
        self, output_dict, tensor_shape=None, is_last_stage: bool = False
    ):
        """Upstream's exchange, with the gradients of several successors summed."""
        self._check_before_sending(output_dict)
        grad_dict: dict = {}
        for name, info in self.rank_module_map.items():
            if info.pp_rank == info.pp_size - 1:
                for bridge in info.bridge_comms_as_src_module:
                    grad = bridge.send_forward_recv_backward(output_dict[name])
                    _accumulate(grad_dict, bridge.src_module_name, grad)
            else:
                grad = info.p2p_communicator.send_forward_recv_backward(
                    _prepare_tensor_for_comm(output_dict[name]),
                    tensor_shapes=tensor_shape,
                    is_last_stage=False,
                )
                grad_dict[name] = _restore_tensor_from_comm(grad)
        return grad_dict

    def recv_backward(self, tensor_shape=None, is_last_stage: bool = False) -> dict:
        """Upstream's receive, with the gradients of several successors summed."""
        grad_dict: dict = {}
        for name, info in self.rank_module_map.items():
            if info.pp_rank == info.pp_size - 1:
                for bridge in info.bridge_comms_as_src_module:
                    _accumulate(grad_dict, bridge.src_module_name, bridge.recv_backward())
            else:
                grad = info.p2p_communicator.recv_backward(
                    tensor_shapes=tensor_shape, is_last_stage=False
                )
                grad_dict[name] = _restore_tensor_from_comm(grad)
        return grad_dict


def _accumulate(grads: dict, key: str, grad: torch.Tensor | None) -> None:
    if grad is None:
        grads.setdefault(key, None)
    elif grads.get(key) is None:
        grads[key] = grad
    else:
        grads[key] = grads[key] + grad


__all__ = [
    "GridBridgeCommunicator",
    "MultiModuleCommunicator",
    "MEGATRON_DIM_MAPPING",
    "MultiModuleError",
    "abort_marker",
    "aborted_with",
]
