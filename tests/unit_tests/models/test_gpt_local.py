"""megatron-ext's GPTModel + local spec is megatron-core's, except that its norms also work
under sequence parallelism."""

import dataclasses

import torch

from megatron.core.models.gpt import GPTModel as CoreGPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec as core_local_spec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megatron_ext.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_ext.models.norms import LocalNorm
from megatron_ext.testing.distributed import model_parallel
from megatron_ext.testing.equivalence import TrainPlan, make_microbatches, transformer_config


def _build(model_class, spec, seed=3):
    plan = TrainPlan(num_layers=2)
    config = transformer_config(plan, parallel=False)
    torch.manual_seed(seed)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed)
    model = model_class(
        config, spec, vocab_size=plan.vocab_size, max_sequence_length=plan.seq_length
    )
    return model, plan


def test_same_parameters_and_outputs_as_megatron_core():
    with model_parallel():
        ours, plan = _build(GPTModel, get_gpt_layer_local_spec())
        core, _ = _build(CoreGPTModel, core_local_spec())
        ours_params = dict(ours.named_parameters())
        core_params = dict(core.named_parameters())
        assert list(ours_params) == list(core_params)
        for name, param in ours_params.items():
            assert torch.equal(param, core_params[name]), name
        batch = make_microbatches(plan, 0)[0]
        args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
        assert torch.equal(ours(*args, labels=batch["labels"]), core(*args, labels=batch["labels"]))


def _norm_classes(value, found):
    if value in (LocalNorm, WrappedTorchNorm):
        found.add(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _norm_classes(getattr(value, field.name), found)
    elif hasattr(value, "submodules"):
        _norm_classes(value.module, found)
        _norm_classes(value.submodules, found)
    return found


def test_local_spec_has_no_sequence_parallel_refusing_norm():
    assert _norm_classes(get_gpt_layer_local_spec(qk_layernorm=True), set()) == {LocalNorm}


def test_local_norm_marks_parameters_for_tensor_parallel_grad_sum():
    plan = TrainPlan()
    for sequence_parallel in (False, True):
        config = transformer_config(plan, parallel=False)
        config.sequence_parallel = sequence_parallel
        norm = LocalNorm(config, hidden_size=plan.hidden_size)
        assert all(p.sequence_parallel is sequence_parallel for p in norm.parameters())
