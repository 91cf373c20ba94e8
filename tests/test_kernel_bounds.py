"""No routing kernel writes outside the tensors it is given. Every tensor the kernels write is cut
from a larger buffer whose bands before and after it are NaN; a store past a row's end, or a
token block's, lands in a band. Whole models in every mode train a step and decode with a cache
at token counts that leave partial token blocks. On CPU the kernels run under the Triton
interpreter, which stores to the same addresses a GPU would."""

import math

import pytest
import torch
from test_fused_convergence import DEVICE, randomised, tiny_model
from test_routing_kernels import configured  # noqa: F401 (fixture)

from mhar_hf.ops.routing import outputs

BAND = 64  # elements each side: 16-byte aligned in every dtype, as the kernels assume of their outputs


class BandedOutputs:
    """`outputs.allocating` with every output NaN and NaN bands around it; `stray()` names the
    outputs whose bands a kernel wrote."""

    def __init__(self):
        self.buffers: list[tuple[torch.Tensor, tuple[int, ...]]] = []

    def __call__(self, *size, dtype=None, device=None):
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        numel = math.prod(shape)
        buffer = torch.full((numel + 2 * BAND,), float("nan"), dtype=dtype, device=device)
        self.buffers.append((buffer, shape))
        return buffer[BAND:BAND + numel].view(shape)

    def stray(self) -> list[str]:
        return [f"output {i} {shape}" for i, (buffer, shape) in enumerate(self.buffers)
                if not (buffer[:BAND].isnan().all() and buffer[buffer.numel() - BAND:].isnan().all())]


SCHEDULES = [
    pytest.param("full", {}, id="full-split-pairs"),
    pytest.param("full", {"full_group_layers": 2}, id="full-groups-of-2"),
    pytest.param("block", {}, id="block-two-phase"),
    pytest.param("block", {"block_two_phase": False}, id="block-whole-reads"),
    pytest.param("delta", {}, id="delta"),
]


@pytest.mark.parametrize("mode, schedule", SCHEDULES)
def test_training_and_decoding_write_only_their_outputs(configured, mode, schedule):
    configured(**schedule)
    banded = BandedOutputs()
    model = randomised(tiny_model(mode, "fused")).train()
    tokens = torch.randint(2, 384, (3, 13), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with outputs.allocating(banded):
        model(tokens, labels=tokens).loss.backward()
        model.eval()
        with torch.no_grad():
            model.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=3, min_new_tokens=3,
                           do_sample=False, pad_token_id=0)
    assert len(banded.buffers) > 20  # the kernels' outputs went through the bands
    assert banded.stray() == []
