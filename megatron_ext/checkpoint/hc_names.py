"""mHC parameter names: megatron-ext's <-> transformers' and the DeepSeek release's.

The same numbers under three spellings (``mhc_variant="deepseek-v4"`` / ``"glm5"`` computes
with them as DeepSeek-V4 does, :mod:`megatron_ext.mhc.variants`). Per sub-layer:

=========================================  ==========================  ==========================
megatron-ext (= Megatron-LM)               transformers                DeepSeek release
=========================================  ==========================  ==========================
``…self_attention_hyper_connection.``      ``layers.i.attn_hc.``       ``layers.i.hc_attn_``
``…mlp_hyper_connection.``                 ``layers.i.ffn_hc.``        ``layers.i.hc_ffn_``
  ``mapping_proj.weight`` [(2+n)n, nh]       ``fn``                      ``fn``
  ``bias`` [(2+n)n]                          ``base``                    ``base``
  ``alpha_pre``, ``alpha_post``,             ``scale`` [3] (their        ``scale``
  ``alpha_res`` [1] each                     concatenation)
``decoder.hc_head_fn/base/scale``          ``hc_head.hc_fn/hc_base/    ``hc_head_fn/base/scale``
                                           hc_scale``
=========================================  ==========================  ==========================

Sources: transformers ``models/deepseek_v4/modeling_deepseek_v4.py`` (``DeepseekV4DecoderLayer``
``attn_hc`` / ``ffn_hc``, ``DeepseekV4Model.hc_head``) and transformers ``conversion_mapping.py``
(its "deepseek_v4" entry renames the release's ``layers.i.hc_attn_*`` / ``hc_ffn_*`` and
top-level ``hc_head_*`` to those).

Layers. A release layer holds an attention and an FFN hyper connection. A megatron-ext GPT
layer does too (layer i <-> release layer i). A megatron-ext Hybrid layer holds one: the
Hybrid pattern must alternate attention and MLP/MoE layers (``*-*-``, ``*E*E``), and Hybrid
layers 2k, 2k+1 are release layer k; anything else (Mamba, two attentions in a row) has no
release counterpart and is refused. Indices are those of the state dict (a whole model: a
single-stage checkpoint, or the global numbering of a distributed one).

Only these parameters are renamed; every other key passes through unchanged, so a conversion
and its inverse give back the input exactly. MTP layers' hyper connections are left as they are
(the release's MTP modules are laid out differently). ``mhc_h_res_method="birkhoff"`` has an n!-
wide res block with no comb counterpart: refused.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from megatron_ext.checkpoint.convert import ConversionError

NAMES = ("transformers", "deepseek")

_OURS_SITE = {"attn": "self_attention_hyper_connection", "ffn": "mlp_hyper_connection"}
_ALPHAS = ("alpha_pre", "alpha_post", "alpha_res")
_OUR_PARAMS = ("mapping_proj.weight", "bias", *_ALPHAS)
_OURS_KEY = re.compile(
    r"^(?P<head>(?:.*\.)?)decoder\.layers\.(?P<index>\d+)\."
    r"(?P<site>self_attention_hyper_connection|mlp_hyper_connection)\.(?P<param>.+)$"
)
_OUR_HEAD = re.compile(r"^(?P<head>(?:.*\.)?)decoder\.hc_head_(?P<part>fn|base|scale)$")

# (site, part) -> key format, per naming; part in fn/base/scale.
_SITE_KEY = {
    "transformers": "layers.{index}.{site}_hc.{part}",
    "deepseek": "layers.{index}.hc_{site}_{part}",
}
_HEAD_KEY = {"transformers": "hc_head.hc_{part}", "deepseek": "hc_head_{part}"}
_THEIR_SITE_KEY = {
    "transformers": re.compile(
        r"^layers\.(?P<index>\d+)\.(?P<site>attn|ffn)_hc\.(?P<part>fn|base|scale)$"
    ),
    "deepseek": re.compile(
        r"^layers\.(?P<index>\d+)\.hc_(?P<site>attn|ffn)_(?P<part>fn|base|scale)$"
    ),
}
_THEIR_HEAD_KEY = {
    "transformers": re.compile(r"^hc_head\.hc_(?P<part>fn|base|scale)$"),
    "deepseek": re.compile(r"^hc_head_(?P<part>fn|base|scale)$"),
}


def _check_names(names: str) -> None:
    if names not in NAMES:
        raise ConversionError(f"mhc names must be one of {', '.join(NAMES)}, got {names!r}")


def _check_comb_width(key: str, bias: Any) -> None:
    """The res block must be n² wide (a comb); birkhoff's n! is not."""
    width = int(bias.shape[0])
    n = math.isqrt(width + 1) - 1
    if n < 1 or n * n + 2 * n != width:
        raise ConversionError(
            f"{key}: a {width}-wide bias is not (2+n)·n: a model trained with "
            "mhc_h_res_method='birkhoff' (n! res logits) has no DeepSeek comb to convert to"
        )


def _release_index(model: str, index: int, site: str, key: str) -> int:
    if model == "gpt":
        return index
    expected = "attn" if index % 2 == 0 else "ffn"
    if site != expected:
        raise ConversionError(
            f"{key}: Hybrid layer {index} has the {site} hyper connection, but a release layer "
            "pairs an attention layer (even index) with the MLP/MoE layer after it; only "
            "alternating attention and MLP/MoE patterns (e.g. '*-*-') convert"
        )
    return index // 2


def _our_index(model: str, index: int, site: str) -> int:
    return index if model == "gpt" else 2 * index + (site == "ffn")


def to_mhc_names(
    state_dict: Mapping[str, Any], names: str, model: str = "gpt", prefix: str = ""
) -> dict[str, Any]:
    """megatron-ext keys -> ``names`` ("transformers" or "deepseek") for the mHC parameters;
    ``prefix`` goes before every renamed key (e.g. "model." for a transformers
    ``DeepseekV4ForCausalLM``)."""
    import torch

    _check_names(names)
    converted: dict[str, Any] = {}
    sites: dict[tuple[str, int, str], dict[str, Any]] = {}
    for key, value in state_dict.items():
        match = _OURS_KEY.match(key)
        head = _OUR_HEAD.match(key)
        if match and match["param"] in _OUR_PARAMS:
            site = "attn" if match["site"] == _OURS_SITE["attn"] else "ffn"
            sites.setdefault((match["head"], int(match["index"]), site), {})[match["param"]] = value
        elif head:
            converted[prefix + _HEAD_KEY[names].format(part=head["part"])] = value
        else:
            converted[key] = value
    for (_, index, site), params in sites.items():
        where = f"decoder.layers.{index}.{_OURS_SITE[site]}"
        missing = [p for p in _OUR_PARAMS if p not in params]
        if missing:
            raise ConversionError(f"{where}: missing {', '.join(missing)}")
        _check_comb_width(where + ".bias", params["bias"])
        layer = _release_index(model, index, site, where)
        scale = torch.cat([params[a].reshape(1) for a in _ALPHAS])
        for part, value in (("fn", params["mapping_proj.weight"]), ("base", params["bias"])):
            converted[prefix + _SITE_KEY[names].format(index=layer, site=site, part=part)] = value
        converted[prefix + _SITE_KEY[names].format(index=layer, site=site, part="scale")] = scale
    return converted


def from_mhc_names(
    state_dict: Mapping[str, Any],
    names: str,
    model: str = "gpt",
    prefix: str = "",
    our_prefix: str = "",
) -> dict[str, Any]:
    """``names`` keys -> megatron-ext's for the mHC parameters (the inverse of
    :func:`to_mhc_names`); ``our_prefix`` goes before ``decoder.`` (e.g. "module.")."""
    _check_names(names)
    converted: dict[str, Any] = {}
    for key, value in state_dict.items():
        rest = key[len(prefix) :] if key.startswith(prefix) else None
        site = _THEIR_SITE_KEY[names].match(rest) if rest is not None else None
        head = _THEIR_HEAD_KEY[names].match(rest) if rest is not None else None
        if site:
            index = _our_index(model, int(site["index"]), site["site"])
            base = f"{our_prefix}decoder.layers.{index}.{_OURS_SITE[site['site']]}."
            if site["part"] == "fn":
                converted[base + "mapping_proj.weight"] = value
            elif site["part"] == "base":
                _check_comb_width(key, value)
                converted[base + "bias"] = value
            else:
                if tuple(value.shape) != (3,):
                    raise ConversionError(
                        f"{key}: scale must have 3 entries, got {tuple(value.shape)}"
                    )
                for i, alpha in enumerate(_ALPHAS):
                    converted[base + alpha] = value[i : i + 1].clone()
        elif head:
            converted[f"{our_prefix}decoder.hc_head_{head['part']}"] = value
        else:
            converted[key] = value
    return converted


def convert_mhc_names(
    state_dict: Mapping[str, Any], model: str, to: str, names: str
) -> dict[str, Any]:
    """``convert-checkpoint --mhc-names NAMES``: ``to="upstream"`` writes ``names``,
    ``to="megatron-ext"`` reads them."""
    if model not in ("gpt", "hybrid"):
        raise ConversionError(f"model must be 'gpt' or 'hybrid', got {model!r}")
    if to == "upstream":
        return to_mhc_names(state_dict, names, model)
    if to == "megatron-ext":
        return from_mhc_names(state_dict, names, model)
    raise ConversionError(f"to must be 'upstream' or 'megatron-ext', got {to!r}")


__all__ = ["NAMES", "convert_mhc_names", "from_mhc_names", "to_mhc_names"]
