"""A small vision-language model from megatron-core parts, for the recipe and the tests.

- :class:`VisionEncoder`: a patch projection (first stage) and a megatron-core
  ``TransformerBlock`` with the local layer spec; its last stage hands on ``[s, b, h]``, or
  ``[b*s, h]`` flattened sample-major with ``flatten_output=True`` (what MIMO-style encoders
  send). It declares ``output_ndim`` so the builder can infer the bridge ndim.
- :class:`Projector`: one linear layer between two modules (for graphs with more modules).
- the language model: megatron-ext's ``GPTModel`` (local spec, mHC optional). Its first stage
  prepends the predecessors' outputs, in the plan's order, to the text embeddings; the loss
  covers the text tokens only.
- :class:`VLMData`: deterministic samples. A global micro-batch holds ``mbs * dp(LM)``
  samples; each module's DP replica takes its contiguous share, which is the order bridges
  gather (fan-in) and split (fan-out) them in. Image lengths may vary per micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from megatron.core.transformer.module import MegatronModule

from megatron_ext.errors import DataError
from megatron_ext.models.lm_loss import masked_token_loss
from megatron_ext.multimodule.builder import ModuleImpl
from megatron_ext.multimodule.model import StageContext, core_module
from megatron_ext.runtime.config_fields import CPU_SAFE_FIELDS

CPU_FRIENDLY = dict(
    hidden_dropout=0.0,
    attention_dropout=0.0,
    params_dtype=torch.float32,
    pipeline_dtype=torch.float32,
    **CPU_SAFE_FIELDS,
)


def transformer_config(
    num_layers: int, hidden_size: int, num_attention_heads: int, **overrides: Any
):
    """A CPU-friendly TransformerConfig (an MHCTransformerConfig when mHC fields are given)."""
    from megatron_ext.config import MHCTransformerConfig

    kwargs = dict(
        CPU_FRIENDLY,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
    )
    kwargs.update(overrides)
    return MHCTransformerConfig(**kwargs)


# ------------------------------------------------------------------------------ modules
class VisionEncoder(MegatronModule):
    """Patch projection + TransformerBlock; ``output_ndim`` is 2 when flattening."""

    def __init__(self, stage: StageContext, patch_dim: int, flatten_output: bool = False) -> None:
        from megatron.core.transformer.transformer_block import (
            TransformerBlock,
            TransformerBlockSubmodules,
            get_num_layers_to_build,
        )

        from megatron_ext.models.gpt import get_gpt_layer_local_spec
        from megatron_ext.models.norms import LocalNorm

        config = stage.config
        super().__init__(config=config)
        self.tp_group = stage.pg_collection.tp  # megatron's sharded_state_dict reads it
        self.pre_process = stage.pre_process
        self.post_process = stage.post_process
        self.flatten_output = flatten_output
        self.output_ndim = 2 if flatten_output else 3
        if self.pre_process:
            self.patch_embed = torch.nn.Linear(patch_dim, config.hidden_size)
        layers = get_num_layers_to_build(config, None, stage.pp_rank)
        spec = TransformerBlockSubmodules(
            layer_specs=[get_gpt_layer_local_spec()] * layers, layer_norm=LocalNorm
        )
        self.block = TransformerBlock(
            config,
            spec,
            pre_process=self.pre_process,
            post_process=self.post_process,
            pg_collection=stage.pg_collection,
        )

    def set_input_tensor(self, input_tensor: torch.Tensor | None) -> None:
        self.block.set_input_tensor(input_tensor)

    def forward(self, images: torch.Tensor | None) -> torch.Tensor:
        hidden = self.patch_embed(images) if self.pre_process else None
        hidden = self.block(hidden_states=hidden, attention_mask=None)
        if self.post_process and self.flatten_output:
            s, b, h = hidden.shape
            hidden = hidden.transpose(0, 1).reshape(b * s, h)  # sample-major, a copy
        return hidden


class Projector(MegatronModule):
    """One linear layer on ``[s, b, h]`` (a module between two others)."""

    def __init__(self, stage: StageContext) -> None:
        super().__init__(config=stage.config)
        self.tp_group = stage.pg_collection.tp
        self.proj = torch.nn.Linear(stage.config.hidden_size, stage.config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden)


def as_sbh(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    """A predecessor's output as ``[s, b, h]`` (2-D outputs are sample-major ``[b*s, h]``)."""
    if tensor.ndim == 3:
        return tensor
    n, h = tensor.shape
    return tensor.view(batch, n // batch, h).transpose(0, 1)


# ------------------------------------------------------------------------------ impls
def encoder_impl(config: Any, patch_dim: int, flatten_output: bool = False) -> ModuleImpl:
    def factory(stage: StageContext) -> torch.nn.Module:
        return VisionEncoder(stage, patch_dim, flatten_output)

    def forward(module, batch, inputs, stage: StageContext):
        images = batch[stage.name]["images"] if stage.pre_process else None
        return module(images)

    return ModuleImpl(factory=factory, forward=forward, config=config)


def projector_impl(config: Any) -> ModuleImpl:
    def forward(module, batch, inputs, stage: StageContext):
        (hidden,) = inputs.values()
        return module(hidden)

    return ModuleImpl(
        factory=Projector, forward=forward, config=config, input_width=config.hidden_size
    )


def language_model_impl(config: Any, vocab_size: int, max_sequence_length: int) -> ModuleImpl:
    from megatron_ext.models.gpt import GPTModel, get_gpt_layer_local_spec

    def factory(stage: StageContext) -> torch.nn.Module:
        mhc = bool(getattr(stage.config, "enable_mhc_connections", False))
        return GPTModel(
            stage.config,
            get_gpt_layer_local_spec(enable_mhc_connections=mhc),
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            pre_process=stage.pre_process,
            post_process=stage.post_process,
            share_embeddings_and_output_weights=True,
            pg_collection=stage.pg_collection,
        )

    def forward(module, batch, inputs, stage: StageContext):
        data = batch[stage.name]
        decoder_input = None
        if stage.pre_process:
            tokens = data["tokens"]
            text = core_module(module).embedding(
                input_ids=tokens, position_ids=data["position_ids"]
            )
            parts = [as_sbh(inputs[p], tokens.shape[0]) for p in stage.predecessors]
            decoder_input = torch.cat(parts + [text], dim=0)
        return module(
            input_ids=data["tokens"],
            position_ids=data["position_ids"],
            attention_mask=data["attention_mask"],
            decoder_input=decoder_input,
            labels=data["labels"] if stage.post_process else None,
        )

    # Its first stage concatenates each predecessor's [s, b, h] with the text embeddings.
    return ModuleImpl(
        factory=factory, forward=forward, config=config, input_width=config.hidden_size
    )


# ------------------------------------------------------------------------------ data and loss
def masked_lm_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """(sum of masked token losses, token count, report) as megatron's pretrain_gpt returns."""
    loss_sum, mask = masked_token_loss(loss_mask, output_tensor)
    tokens = mask.sum().to(torch.int)
    report = {
        "lm loss": (loss_sum.detach() / tokens.clamp(min=1)).item(),
        "loss sum": loss_sum.detach().item(),
        "tokens": int(tokens.item()),
    }
    return loss_sum, tokens, report


def forward_step(language_model: str, data_iterator, model):
    """The schedule's forward_step_func for a :class:`MultiModuleModel` fed by VLMData."""
    batch = next(data_iterator)
    output = model(batch)

    def loss_func(output_tensor):
        return masked_lm_loss(batch[language_model]["loss_mask"], output_tensor)

    return output, loss_func


def make_forward_step(language_model: str):
    return partial(forward_step, language_model)


@dataclass
class VLMData:
    """Deterministic samples for a graph of encoders feeding one language model.

    ``encoders`` maps each module that reads images to its patch size; ``image_lengths`` is
    cycled over micro-batches (different lengths exercise variable shapes). Every global
    micro-batch is drawn from its own seed (``seed``, step, micro-batch), so any rank can
    produce any module's share of it.
    """

    language_model: str
    encoders: dict[str, int]
    vocab_size: int = 64
    text_length: int = 8
    image_lengths: Sequence[int] = (4,)
    seed: int = 1234
    text_pattern: str = "random"
    """``random`` tokens, or ``arithmetic``: each sample counts from a random start with a
    random stride in 1..3 (mod vocab), which a model can learn, so the loss falls."""

    def image_length(self, microbatch: int) -> int:
        return self.image_lengths[microbatch % len(self.image_lengths)]

    def sequence_length(self, microbatch: int, lm_inputs: int) -> int:
        return lm_inputs * self.image_length(microbatch) + self.text_length

    def global_microbatch(self, step: int, microbatch: int, samples: int, lm_inputs: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 100_003 + step * 1_009 + microbatch)
        s_img = self.image_length(microbatch)
        s_txt = self.text_length
        prefix = lm_inputs * s_img
        total = prefix + s_txt
        data: dict[str, Any] = {}
        for name, patch_dim in self.encoders.items():
            data[name] = {"images": torch.randn(s_img, samples, patch_dim, generator=g)}
        if self.text_pattern == "arithmetic":
            start = torch.randint(0, self.vocab_size, (samples, 1), generator=g)
            stride = torch.randint(1, 4, (samples, 1), generator=g)
            tokens = (start + stride * torch.arange(s_txt + 1)) % self.vocab_size
        elif self.text_pattern == "random":
            tokens = torch.randint(0, self.vocab_size, (samples, s_txt + 1), generator=g)
        else:
            raise DataError(
                f"text_pattern must be 'random' or 'arithmetic', got {self.text_pattern!r}"
            )
        labels = torch.zeros(samples, total, dtype=torch.long)
        labels[:, prefix:] = tokens[:, 1:]
        loss_mask = torch.zeros(samples, total)
        loss_mask[:, prefix:] = (torch.rand(samples, s_txt, generator=g) > 0.1).float()
        data[self.language_model] = {
            "tokens": tokens[:, :-1].contiguous(),
            "position_ids": torch.arange(prefix, total)
            .unsqueeze(0)
            .expand(samples, s_txt)
            .contiguous(),
            "labels": labels,
            "loss_mask": loss_mask,
            "attention_mask": torch.triu(
                torch.ones(1, 1, total, total, dtype=torch.bool), diagonal=1
            ),
        }
        return data

    @staticmethod
    def take(module_data: dict, samples: range) -> dict:
        """A module's data for some samples (images are [s, b, p]; the rest [b, ...])."""
        out = {}
        for key, value in module_data.items():
            if key == "images":
                out[key] = value[:, samples.start : samples.stop].contiguous()
            elif key == "attention_mask":
                out[key] = value
            else:
                out[key] = value[samples.start : samples.stop].contiguous()
        return out


def lm_input_count(plan: Any) -> int:
    """How many predecessor outputs the language model prepends (each image-length long)."""
    return len(plan.predecessors(plan.language_model))


def local_batches(
    pipeline: Any, data: VLMData, step: int, num_microbatches: int, lm_mbs: int
) -> list:
    """This rank's batch for each micro-batch of a step: each local module's share."""
    plan = pipeline.plan
    samples = lm_mbs * plan.modules[plan.language_model].dp
    batches = []
    for m in range(num_microbatches):
        full = data.global_microbatch(step, m, samples, lm_input_count(plan))
        batch = {}
        for name in pipeline.local_module_names:
            stage = pipeline.stage(name)
            if name in full:
                batch[name] = data.take(full[name], plan.sample_range(name, stage.dp_rank, lm_mbs))
        batches.append(batch)
    return batches


def default_vlm_configs(
    hidden_size: int = 32,
    heads: int = 4,
    encoder_layers: int = 2,
    lm_layers: int = 2,
    **lm_overrides: Any,
) -> tuple[Any, Any]:
    """(encoder config, language-model config), CPU-friendly; mHC fields go to the LM."""
    return (
        transformer_config(encoder_layers, hidden_size, heads),
        transformer_config(lm_layers, hidden_size, heads, **lm_overrides),
    )
