"""MHAR's model tester for transformers' own common model test suite.

Not collected by this repository's pytest run: `run_suite.py` copies it into a scratch copy of
transformers' test tree as `tests/models/mhar/test_modeling_mhar.py`, next to transformers'
`causal_lm_tester.py`, `test_modeling_common.py` and `generation/test_utils.py`, where its relative
imports resolve as they do for an in-tree model.

Modelled on Llama's tester (`tests/models/llama/test_modeling_llama.py`): the same tiny shapes
(vocab 99, hidden 32, 2 layers, 2 attention heads, intermediate 37; `test_num_layers_is_small`
holds every tester to 2 layers). Two blocks of one layer each, so block mode has a finished block
and delta mode a block delta and a grouped read ahead. One test class per residual mode. Nothing is
skipped here; one common test is replaced (see its docstring) because its check for hidden-state
support looks where MHAR does not keep it.
"""

import unittest

from transformers import is_torch_available
from transformers.testing_utils import require_torch

from ...causal_lm_tester import CausalLMModelTest, CausalLMModelTester


if is_torch_available():
    import torch

    from mhar_hf import (
        MHARConfig,
        MHARForCausalLM,
        MHARForQuestionAnswering,
        MHARForSequenceClassification,
        MHARForTokenClassification,
        MHARModel,
    )


class MHARModelTester(CausalLMModelTester):
    if is_torch_available():
        # MHAR's classes live outside transformers, so the tester cannot infer them from the names
        config_class = MHARConfig
        base_model_class = MHARModel
        causal_lm_class = MHARForCausalLM
        sequence_classification_class = MHARForSequenceClassification
        question_answering_class = MHARForQuestionAnswering
        token_classification_class = MHARForTokenClassification

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

    def test_can_capture_specific_layers_hidden_states(self):
        """The common test looks for a `hidden_states` entry in `_can_record_outputs` (module
        outputs captured by hooks) and skips without one. MHAR builds its hidden states in the
        model: in full and block mode a layer's is its attention read, made inside the layer and
        the output of no module. The same check, written here: indices keep exactly those states."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            with self.subTest(model_class.__name__):
                model = model_class(config).eval()
                with torch.no_grad():
                    every = model(**self._prepare_for_class(inputs, model_class), output_hidden_states=True).hidden_states
                    chosen = [0, 2, -1]
                    kept = model(**self._prepare_for_class(inputs, model_class), output_hidden_states=chosen).hidden_states
                self.assertEqual(len(every), config.num_hidden_layers + 1)
                self.assertEqual(len(kept), len(every))
                wanted = {index % len(every) for index in chosen}
                for index, (state, reference) in enumerate(zip(kept, every)):
                    if index in wanted:
                        torch.testing.assert_close(state, reference)
                    else:
                        self.assertIsNone(state)


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
