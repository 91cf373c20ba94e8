"""Multi-Head Attention Residuals for Hugging Face Transformers.

Importing the package registers `mhar` with AutoConfig, AutoModel, AutoModelForCausalLM and the
sequence-classification, question-answering and token-classification Auto classes.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .configuration_mhar import PRESETS, RESIDUAL_MODES, MHARConfig
from .modeling_mhar import (
    MHARForCausalLM,
    MHARForQuestionAnswering,
    MHARForSequenceClassification,
    MHARForTokenClassification,
    MHARModel,
    MHARPreTrainedModel,
    MHARRouter,
)
from .remote_code import save_remote_code
from .routing import route, route_and_start, route_reference, routing_keys, routing_weights

AutoConfig.register(MHARConfig.model_type, MHARConfig, exist_ok=True)
AutoModel.register(MHARConfig, MHARModel, exist_ok=True)
AutoModelForCausalLM.register(MHARConfig, MHARForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(MHARConfig, MHARForSequenceClassification, exist_ok=True)
AutoModelForQuestionAnswering.register(MHARConfig, MHARForQuestionAnswering, exist_ok=True)
AutoModelForTokenClassification.register(MHARConfig, MHARForTokenClassification, exist_ok=True)

__version__ = "0.1.0"
__all__ = [
    "MHARConfig",
    "MHARForCausalLM",
    "MHARForQuestionAnswering",
    "MHARForSequenceClassification",
    "MHARForTokenClassification",
    "MHARModel",
    "MHARPreTrainedModel",
    "MHARRouter",
    "PRESETS",
    "RESIDUAL_MODES",
    "route",
    "route_and_start",
    "route_reference",
    "routing_keys",
    "routing_weights",
    "save_remote_code",
]
