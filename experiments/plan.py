"""The experiment plan: one model shape, one training recipe, and the arms that differ only in
how the residual stream is read.

Every from-scratch arm shares the shape, the tokenizer, the seed (unless the arm names another),
the data order, the schedule and the token budget; an arm fixes only `residual_mode`,
`residual_heads` and, in block mode, `residual_block_layers`. The mid-training miniature
pre-trains a plain Qwen3 model of the same shape (the converter's input), converts it to delta
mode, and continues the plain model and the converted one with the same recipe.
"""

from __future__ import annotations

from dataclasses import dataclass

# Qwen3-style blocks like the package's from-scratch presets: q/k norm, tied embeddings,
# RoPE base 1e4. `small` is the GPU shape; `tiny` runs in seconds on a CPU (tests).
SHAPES = {
    "small": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=6, num_attention_heads=3,
                  num_key_value_heads=3, head_dim=64, max_position_embeddings=1024),
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=64),
}
COMMON = dict(qk_norm=True, tie_word_embeddings=True, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

# The recipe of every run (`mhar train` arguments). Steps come from the token budget.
RECIPES = {
    "small": dict(seq_length=1024, batch_size=32, grad_accum=2, val_sequences=128, evals=12, warmup_fraction=0.05),
    "tiny": dict(seq_length=32, batch_size=2, grad_accum=2, val_sequences=4, evals=2, warmup_fraction=0.25),
}
OPTIMISER = dict(lr=1e-3, min_lr_ratio=0.1, schedule="cosine", weight_decay=0.1, adam_betas=(0.9, 0.95), clip=1.0)
MIDTRAIN_OPTIMISER = dict(OPTIMISER, lr=3e-4)  # a continued run re-warms to a lower peak
MIDTRAIN_SEED = 1  # the continuation visits the corpus in another order than pre-training did
MIDTRAIN_FRACTION = 0.25  # continuation tokens as a share of the from-scratch budget
DELTA_BLOCKS = 3  # delta mode (and the config's default for the others): 3 blocks of 2 layers


@dataclass(frozen=True)
class Arm:
    mode: str  # residual_mode, or "qwen3" for the converter's plain source model
    heads: int = 8
    seed: int = 0
    block_layers: int | None = None
    convert_from: str | None = None  # delta arms: the arm whose trained model is converted
    midtrain: bool = False  # a continuation: MIDTRAIN_OPTIMISER, MIDTRAIN_SEED, MIDTRAIN_FRACTION

    def residual_fields(self) -> dict:
        fields = dict(residual_mode=self.mode, residual_heads=self.heads, residual_num_blocks=DELTA_BLOCKS)
        if self.block_layers:
            fields["residual_block_layers"] = self.block_layers
        return fields


ARMS = {
    "plain": Arm("standard"),
    "full-h1": Arm("full", heads=1),
    "full-h4": Arm("full", heads=4),
    "full-h8": Arm("full", heads=8),
    "full-h16": Arm("full", heads=16),
    "block-h8": Arm("block", heads=8, block_layers=2),
    "plain-seed1": Arm("standard", seed=1),
    "full-h8-seed1": Arm("full", heads=8, seed=1),
    # mid-training miniature
    "qwen3-source": Arm("qwen3"),
    "midtrain-plain": Arm("qwen3", midtrain=True, convert_from="qwen3-source"),
    "midtrain-delta-h8": Arm("delta", heads=8, midtrain=True, convert_from="qwen3-source"),
}
FROM_SCRATCH = ["plain", "full-h1", "full-h4", "full-h8", "full-h16", "block-h8"]
SEED_PAIRS = [("plain", "plain-seed1"), ("full-h8", "full-h8-seed1")]
MIDTRAIN = ["qwen3-source", "midtrain-plain", "midtrain-delta-h8"]


def steps_for(recipe: dict, tokens: int, fraction: float = 1.0) -> int:
    return max(2, int(tokens * fraction) // step_tokens(recipe))


def step_tokens(recipe: dict) -> int:
    return recipe["seq_length"] * recipe["batch_size"] * recipe["grad_accum"]


def non_embedding_parameters(shape: dict) -> int:
    """Backbone weights of the plain model outside the (tied) embedding: attention, MLP, norms."""
    d, layers, inter = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    attention = d * q + 2 * d * kv + q * d + 2 * shape["head_dim"]
    return layers * (attention + 3 * d * inter + 2 * d) + d
