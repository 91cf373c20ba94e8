"""MHARConfig: a Llama config plus the residual-routing fields."""

from __future__ import annotations

import math

from huggingface_hub.dataclasses import strict
from transformers.models.llama.configuration_llama import LlamaConfig

RESIDUAL_MODES = ("standard", "full", "block", "delta")
ROUTING_IMPLEMENTATIONS = ("auto", "reference", "fused")

# The paper's shapes (docs/method.md). From-scratch presets use Qwen3-style blocks
# (per-head q/k RMSNorm, tied embeddings, RoPE base 1e4); 8B is Llama-3.1-8B exactly.
_FROM_SCRATCH = dict(
    vocab_size=151936,
    qk_norm=True,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=0,
)
PRESETS: dict[str, dict] = {
    "100M": dict(_FROM_SCRATCH, hidden_size=512, num_hidden_layers=12, num_attention_heads=8,
                 num_key_value_heads=4, intermediate_size=1536),
    "350M": dict(_FROM_SCRATCH, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                 num_key_value_heads=8, intermediate_size=4096),
    "1B": dict(_FROM_SCRATCH, hidden_size=1280, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=8, intermediate_size=5120),
    "8B": dict(
        vocab_size=128256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=14336, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        residual_mode="delta",
    ),
}


@strict
class MHARConfig(LlamaConfig):
    r"""Configuration of an MHAR model: every `LlamaConfig` field, plus

    residual_mode (`str`, defaults to `"full"`):
        `standard` (the plain Llama residual), `full` (route over every sublayer output),
        `block` (Kimi's Block Attention Residuals) or `delta` (identity-preserving gated routing,
        what the converter writes).
    residual_heads (`int`, defaults to 8):
        H, the number of depth softmaxes per routing site; it must divide `hidden_size`.
        H = 1 is Kimi's Attention Residuals.
    residual_num_blocks (`int`, defaults to 8):
        Delta mode (and block mode when `residual_block_layers` is unset): the depth history is
        cut into blocks of `ceil(num_hidden_layers / residual_num_blocks)` layers, so at most this
        many (a model with fewer layers gets a block per layer).
    residual_block_layers (`int`, *optional*):
        Block mode: layers per block.
    routing_implementation (`str`, defaults to `"auto"`):
        `auto` (fused kernels on CUDA when installed), `reference` or `fused`. The environment
        variable `MHAR_ROUTING` overrides it.
    qkv_bias (`bool`, defaults to `False`):
        Bias on the q/k/v projections only (Qwen2); `attention_bias` puts one on o_proj too (Llama).
    qk_norm (`bool`, defaults to `False`):
        Per-head RMSNorm on queries and keys before RoPE (Qwen3).
    """

    model_type = "mhar"

    residual_mode: str = "full"
    residual_heads: int = 8
    residual_num_blocks: int = 8
    residual_block_layers: int | None = None
    routing_implementation: str = "auto"
    qkv_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self._check_residual_fields()

    def _check_residual_fields(self):
        layers = self.num_hidden_layers
        if self.residual_mode not in RESIDUAL_MODES:
            raise ValueError(f"residual_mode={self.residual_mode!r} is unknown; allowed: {', '.join(RESIDUAL_MODES)}")
        if not isinstance(self.residual_heads, int) or self.residual_heads < 1 or self.hidden_size % self.residual_heads:
            divisors = [h for h in range(1, 65) if self.hidden_size % h == 0]
            raise ValueError(
                f"residual_heads={self.residual_heads!r} must be a positive integer dividing hidden_size="
                f"{self.hidden_size}; for example one of {divisors}"
            )
        if not isinstance(self.residual_num_blocks, int) or self.residual_num_blocks < 1:
            raise ValueError(f"residual_num_blocks={self.residual_num_blocks!r} must be a positive integer")
        if self.residual_block_layers is not None and not 1 <= self.residual_block_layers <= layers:
            raise ValueError(
                f"residual_block_layers={self.residual_block_layers} must be between 1 and num_hidden_layers={layers} "
                "(or None to derive it from residual_num_blocks)"
            )
        if self.routing_implementation not in ROUTING_IMPLEMENTATIONS:
            raise ValueError(
                f"routing_implementation={self.routing_implementation!r} is unknown; allowed: "
                f"{', '.join(ROUTING_IMPLEMENTATIONS)}"
            )

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """Llama's tensor-parallel plan, plus the q/k norms when the model has them (Qwen3)."""
        if not self.qk_norm:
            return dict(LlamaConfig.base_model_tp_plan)
        return {
            **LlamaConfig.base_model_tp_plan,
            "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
            "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
        }

    @property
    def layers_per_block(self) -> int:
        """Layers between block boundaries in block and delta modes."""
        if self.residual_mode == "block" and self.residual_block_layers is not None:
            return self.residual_block_layers
        return math.ceil(self.num_hidden_layers / self.residual_num_blocks)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> MHARConfig:
        """A config with one of the paper's shapes (`100M`, `350M`, `1B`, `8B`); keywords override fields."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; allowed: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


__all__ = ["MHARConfig", "PRESETS", "RESIDUAL_MODES"]
