"""convert-checkpoint reads with ``weights_only=True``: a pickle that would run code is refused
in one line naming the file and ``--trust-pickle``; junk inputs and bad outputs end in one line
too, and a failed write leaves the previous output in place (issue 25 items 1 and 10)."""

from __future__ import annotations

import argparse
import pathlib

import pytest
import torch

from megatron_ext.checkpoint import convert


class _WritesAFile:
    """Unpickling this calls pathlib.Path.touch: code execution, observable as a file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_a_pickle_that_runs_code_is_refused_unless_trusted(tmp_path):
    marker = tmp_path / "code-ran"
    evil = tmp_path / "evil.pt"
    torch.save({"decoder.layers.0.mlp.weight": torch.zeros(2), "x": _WritesAFile(marker)}, evil)
    with pytest.raises(convert.ConversionError) as refused:
        convert.convert_file(str(evil), str(tmp_path / "out.pt"), "gpt", "upstream", "pr6401")
    message = str(refused.value)
    assert "\n" not in message and "evil.pt" in message and "--trust-pickle" in message, message
    assert not marker.exists() and not (tmp_path / "out.pt").exists()
    # the explicit opt-in loads it (and so runs it): that is what the flag is for
    convert.convert_file(str(evil), str(tmp_path / "out.pt"), "gpt", "upstream", "pr6401", True)
    assert marker.exists()


def test_a_megatron_torch_checkpoint_loads_without_trust(tmp_path):
    """model_optim_rng.pt carries argparse.Namespace and numpy RNG state: megatron-core's own
    safe globals, so the safe load still reads Megatron's torch format."""
    import numpy as np

    source = tmp_path / "model_optim_rng.pt"
    torch.save(
        {
            "model": {"decoder.layers.0.mlp.weight": torch.ones(2)},
            "args": argparse.Namespace(hidden_size=32),
            "rng_state": [{"np_rng_state": np.random.get_state()}],
            "iteration": 3,
        },
        source,
    )
    convert.convert_file(str(source), str(tmp_path / "out.pt"), "gpt", "upstream", "pr6401")
    assert torch.load(tmp_path / "out.pt", weights_only=False)["args"].hidden_size == 32


@pytest.mark.parametrize(
    "content, expected",
    [
        (b"", "empty or truncated"),
        (b"hello\n", "not a torch.save file"),
        (bytes(range(256)) * 8, "rand.pt"),
        (None, "not strings"),
        ("dir", "Is a directory"),
    ],
)
def test_junk_inputs_end_in_one_line(tmp_path, content, expected):
    source = tmp_path / "rand.pt"
    if content is None:
        torch.save({1: torch.zeros(1)}, source)
    elif content == "dir":
        source.mkdir()
    else:
        source.write_bytes(content)
    with pytest.raises(convert.ConversionError) as refused:
        convert.convert_file(str(source), str(tmp_path / "o.pt"), "hybrid", "upstream", "pr6401")
    assert expected in str(refused.value) and "\n" not in str(refused.value), refused.value


def test_a_bad_output_path_is_named_and_nothing_is_overwritten(tmp_path):
    source = tmp_path / "in.pt"
    torch.save({"decoder.layers.0.mlp.weight": torch.ones(1)}, source)
    with pytest.raises(convert.ConversionError, match="does not exist; create it"):
        convert.convert_file(str(source), str(tmp_path / "no" / "o.pt"), "gpt", "upstream", "dev")
    with pytest.raises(convert.ConversionError, match="is the input"):
        convert.convert_file(str(source), str(source), "gpt", "upstream", "dev")
    (tmp_path / "outdir").mkdir()
    with pytest.raises(convert.ConversionError, match="is a directory"):
        convert.convert_file(str(source), str(tmp_path / "outdir"), "gpt", "upstream", "dev")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt", "outdir"]
