"""Tiny models and tokenizers built locally: for the demo, tests and smoke runs (no hub)."""

from __future__ import annotations

from collections.abc import Iterable
from importlib import resources

from .configuration_mhar import MHARConfig

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def demo_corpus() -> str:
    """The small English text shipped with the package."""
    return resources.files("mhar_hf.demo").joinpath("corpus.txt").read_text()


def train_tokenizer(texts: Iterable[str], vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on `texts`, wrapped for transformers (fully offline).

    Ids 0 and 1 are the end-of-text and padding tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=PAD, bos_token=None)


def tiny_config(**overrides) -> MHARConfig:
    """A 4-layer, 64-wide MHAR config that runs in milliseconds on a CPU."""
    fields = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        residual_heads=4,
        residual_num_blocks=2,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=1,
    )
    return MHARConfig(**{**fields, **overrides})
