"""MHAR's model tester for transformers' own common model test suite.

Not collected by this repository's pytest run: `run_suite.py` copies it into a scratch copy of
transformers' test tree as `tests/models/mhar/test_modeling_mhar.py`, next to transformers'
`causal_lm_tester.py`, `test_modeling_common.py` and `generation/test_utils.py`, where its relative
imports resolve as they do for an in-tree model.

Modelled on Llama's tester (`tests/models/llama/test_modeling_llama.py`): the same tiny shapes
(vocab 99, hidden 32, 2 layers, 2 attention heads, intermediate 37; `test_num_layers_is_small`
holds every tester to 2 layers). Two blocks of one layer each, so block mode has a finished block
and delta mode a block delta and a grouped read ahead. One test class per residual mode; nothing is
skipped here, so every failure of the common suite shows.
"""

import unittest

from transformers import is_torch_available
from transformers.testing_utils import require_torch

from ...causal_lm_tester import CausalLMModelTest, CausalLMModelTester


if is_torch_available():
    from mhar_hf import MHARConfig, MHARForCausalLM, MHARModel


class MHARModelTester(CausalLMModelTester):
    if is_torch_available():
        # MHAR's classes live outside transformers, so the tester cannot infer them from the names
        config_class = MHARConfig
        base_model_class = MHARModel
        causal_lm_class = MHARForCausalLM

    residual_mode = "full"

    def __init__(self, parent, **kwargs):
        super().__init__(parent, **kwargs)
        # MHARConfig fields; get_config passes every tester attribute named like a config argument
        self.residual_mode = type(self).residual_mode
        self.residual_heads = 4  # divides hidden_size=32: depth softmaxes over 8-wide slices
        self.residual_num_blocks = 2  # <= num_hidden_layers=2: two blocks of one layer
        self.routing_implementation = "reference"  # what "auto" picks on CPU; explicit for the record


class MHARStandardModelTester(MHARModelTester):
    residual_mode = "standard"


class MHARFullModelTester(MHARModelTester):
    residual_mode = "full"


class MHARBlockModelTester(MHARModelTester):
    residual_mode = "block"


class MHARDeltaModelTester(MHARModelTester):
    residual_mode = "delta"


class _MHARModelTest(CausalLMModelTest):
    # as Llama's: `test_cpu_offload` edge cases with the causal mask buffer
    model_split_percents = [0.5, 0.7, 0.8]
    _torch_compile_train_cls = MHARForCausalLM if is_torch_available() else None


@require_torch
class MHARStandardModelTest(_MHARModelTest, unittest.TestCase):
    model_tester_class = MHARStandardModelTester


@require_torch
class MHARFullModelTest(_MHARModelTest, unittest.TestCase):
    model_tester_class = MHARFullModelTester


@require_torch
class MHARBlockModelTest(_MHARModelTest, unittest.TestCase):
    model_tester_class = MHARBlockModelTester


@require_torch
class MHARDeltaModelTest(_MHARModelTest, unittest.TestCase):
    model_tester_class = MHARDeltaModelTester
