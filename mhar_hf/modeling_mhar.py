"""MHAR: a Llama-family decoder whose residual stream is replaced (or augmented) by learned
softmax reads over the depth history, one softmax per head of the hidden width.

Module and parameter names follow `modeling_llama.py` so that Llama checkpoints, PEFT target
names and tensor-parallel plans keep working. The routing parameters of each read live in a
small `MHARRouter` submodule (`layers.N.attn_router`, `layers.N.mlp_router`, `final_router`).

The residual state passed between layers is one NamedTuple per `config.residual_mode`, its
fields named (see `StandardState`, `FullState`, `BlockState`, `DeltaState`). A layer takes it as
flat positional tensors (`state.flat()`) and returns the next one flat, because reentrant
activation checkpointing follows gradients only through a layer's positional tensor arguments.
States are never mutated, so a layer recomputed under activation checkpointing sees exactly the
inputs of its first run.

Hidden states (`output_hidden_states`): entry i is what layer i's attention sublayer starts
from, the stream in `standard` and `delta` mode and the layer's attention read in `full` and
`block` mode (the embedding for layer 0); the last entry is the final norm's output, as in Llama.
"""


from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel, slice_logits_to_keep
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs, resolve_hidden_states_indices, selected_hidden_states

from .configuration_mhar import MHARConfig
from .routing import Read, launch_setting, route, route_and_start, route_begin_group, route_group, track

if torch.distributed.is_available():  # FSDP2's types, for grouped reads of sharded routers (_whole_here, _whole)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Partial, Replicate
else:
    FSDPModule = DTensor = None


# Residual states, one per mode. Each says what its fields hold, lays them out flat for a layer's
# positional arguments (`flat`, `from_flat`), and names the sources a read of its mode takes
# (`source_labels`: every read takes the first N of one order, so index n is the same source at
# every site; these are the routing probe's labels).


class StandardState(NamedTuple):
    """standard mode: Llama's residual."""

    stream: torch.Tensor

    def flat(self) -> tuple[torch.Tensor, ...]:
        return (self.stream,)

    @classmethod
    def from_flat(cls, tensors: Sequence[torch.Tensor]) -> "StandardState":
        (stream,) = tensors
        return cls(stream)

    @staticmethod
    def source_labels(count: int) -> list[str]:
        raise ValueError("residual_mode='standard' has no routing sites")


class FullState(NamedTuple):
    """full mode: every depth source so far, in the order made."""

    sources: tuple[torch.Tensor, ...]  # the embedding, then each layer's attention and MLP outputs
    # the fused path's two-phase reads (docs/kernels.md): the states of the layer group's reads still
    # to end, begun over the sources made before the group, two tensors each (mix, lse), in read order
    pending: tuple[torch.Tensor, ...] = ()

    def flat(self) -> tuple[torch.Tensor, ...]:
        return (*self.sources, *self.pending)

    @classmethod
    def from_flat(cls, tensors: Sequence[torch.Tensor], num_sources: int | None = None) -> "FullState":
        """`num_sources`: how many of the tensors are sources (the layer knows; None: all, no
        pending reads)."""
        if num_sources is None:
            num_sources = len(tensors)
        return cls(tuple(tensors[:num_sources]), tuple(tensors[num_sources:]))

    @staticmethod
    def source_labels(count: int) -> list[str]:
        """emb, attn0, mlp0, attn1, mlp1, ..."""
        return ["emb"] + [f"{('attn', 'mlp')[(n - 1) % 2]}{(n - 1) // 2}" for n in range(1, count)]


class BlockState(NamedTuple):
    """block mode: the finished block sums and the running one."""

    blocks: tuple[torch.Tensor, ...]  # the embedding (block 0), then each finished block's sum
    partial: torch.Tensor  # the running sum of the block in progress (the embedding before layer 0)
    # the fused path's two-phase reads (docs/kernels.md): the states of the block's reads still to
    # end, begun over its finished blocks at its start, two tensors each (mix, lse), in read order
    pending: tuple[torch.Tensor, ...] = ()

    @property
    def sources(self) -> tuple[torch.Tensor, ...]:
        """What a read takes: the finished blocks and the running one."""
        return (*self.blocks, self.partial)

    def flat(self) -> tuple[torch.Tensor, ...]:
        return (*self.sources, *self.pending)

    @classmethod
    def from_flat(cls, tensors: Sequence[torch.Tensor], num_blocks: int | None = None) -> "BlockState":
        """`num_blocks`: how many of the tensors are finished blocks (the layer knows; None: all
        but the last, no pending reads)."""
        if num_blocks is None:
            num_blocks = len(tensors) - 1
        return cls(tuple(tensors[:num_blocks]), tensors[num_blocks], tuple(tensors[num_blocks + 1:]))

    @staticmethod
    def source_labels(count: int) -> list[str]:
        """emb, block1, block2, ...: a read's last source is the block in progress."""
        return ["emb"] + [f"block{n}" for n in range(1, count)]


class DeltaState(NamedTuple):
    """delta mode: the plain residual and the block entries its gated reads take."""

    stream: torch.Tensor
    boundary: torch.Tensor  # the stream where the current block started
    blocks: tuple[torch.Tensor, ...]  # the embedding, then each ended block's change of the stream
    reads_ahead: tuple[torch.Tensor, ...]  # later sites' reads, made at their block's start (see the layer's)

    def flat(self) -> tuple[torch.Tensor, ...]:
        return (self.stream, self.boundary, *self.blocks, *self.reads_ahead)

    @classmethod
    def from_flat(cls, tensors: Sequence[torch.Tensor], num_blocks: int) -> "DeltaState":
        """`num_blocks`: how many of the tensors are block entries (the layer knows)."""
        return cls(tensors[0], tensors[1], tuple(tensors[2:2 + num_blocks]), tuple(tensors[2 + num_blocks:]))

    @staticmethod
    def source_labels(count: int) -> list[str]:
        """null, emb, block1, ...: each read's null source, then the block entries."""
        return (["null", "emb"] + [f"block{n}" for n in range(1, count - 1)])[:count]


RESIDUAL_STATES = {"standard": StandardState, "full": FullState, "block": BlockState, "delta": DeltaState}


class MHARRouter(nn.Module):
    """One routing site: a pseudo-query and a key-norm weight; in delta mode also a null source
    and a gate, and a read returns `gate * mix` (the decoder layer adds the stream).

    A site reads in one of three ways: `read`, `read_and_start` (a read that begins the next
    site's read of the same sources and more) and `read_group` (reads of several sites at once).
    `router(sources, ...)` is `router.read(sources, ...)`."""

    def __init__(self, config: MHARConfig, gated: bool):
        super().__init__()
        self.num_heads = config.residual_heads
        self.eps = config.rms_norm_eps
        self.implementation = config.routing_implementation
        self.query = nn.Parameter(torch.zeros(config.hidden_size))
        self.key_norm_weight = nn.Parameter(torch.ones(config.hidden_size))
        self.gated = gated
        if gated:
            self.null_source = nn.Parameter(torch.zeros(config.hidden_size))
            self.gate = nn.Parameter(torch.zeros(1))  # 1-D: FSDP rejects 0-d parameters

    def read(self, sources: Sequence[torch.Tensor], residual: torch.Tensor | None = None,
             prefix=None) -> torch.Tensor:
        """The site's read of `sources` (each `[..., d]`): the per-head softmax mix (`routing.route`).
        A gated site returns `gate * mix`, or with `residual` (the stream) `residual + gate * mix`.
        `prefix` (from another site's `read_and_start`) ends the read begun there."""
        return self(sources, residual=residual, prefix=prefix)

    def read_and_start(self, sources: Sequence[torch.Tensor], begin: "MHARRouter") -> tuple[torch.Tensor, object]:
        """This site's read of `sources`, and the start of `begin`'s read, which takes these sources
        and more (full mode: a layer's attention read, then its MLP read): returns (read, prefix),
        and `begin.read(more_sources, prefix=prefix)` then folds in only the sources added
        (`routing.route_and_start`; off the fused path the prefix is None). Ungated sites only."""
        return self(sources, use="read_and_start", begin=begin)

    def read_group(self, sources: Sequence[torch.Tensor], ahead: Sequence["MHARRouter"]) -> tuple[torch.Tensor, ...]:
        """The reads of `sources` by this site and by the sites `ahead`, which read the same sources
        later (delta mode's block spans), made together (`routing.route_group`): this site's read
        first, each `gate * mix`. Gated sites only. The sites ahead are not called; their
        parameters are gathered here when FSDP2 holds them sharded (`_whole`)."""
        return self(sources, use="read_group", ahead=tuple(ahead))

    # The three reads run through `__call__` (this dispatch on `use`), so module hooks see each: the probe's
    # and benchmarks' pre-hooks take its sources and `begin`/`ahead`; FSDP2 shards layers, not routers (`_whole`).
    def forward(self, sources: Sequence[torch.Tensor], *, use: str = "read", **arguments):
        """Runs the read that `use` names (`read`, `read_and_start`, `read_group`): call those methods."""
        if use == "read":
            return self._read(sources, **arguments)
        if use == "read_and_start":
            return self._read_and_start(sources, **arguments)
        if use == "read_group":
            return self._read_group(sources, **arguments)
        raise ValueError(f"use={use!r}: a router reads by 'read', 'read_and_start' or 'read_group'")

    def _read(self, sources, residual=None, prefix=None):
        return route(
            sources,
            self.query,
            self.key_norm_weight,
            self.num_heads,
            self.eps,
            null_source=self.null_source if self.gated else None,
            implementation=self.implementation,
            gate=self.gate if self.gated else None,
            residual=residual,
            prefix=prefix,
        )

    def _read_and_start(self, sources, begin):
        if self.gated or begin.gated or (begin.num_heads, begin.eps) != (self.num_heads, self.eps):
            raise ValueError("a split read pairs two ungated routers of the same heads and eps")
        return route_and_start(sources, self.query, self.key_norm_weight, begin.query, begin.key_norm_weight,
                               self.num_heads, self.eps, self.implementation)

    def _read_group(self, sources, ahead):
        routers = (self, *ahead)
        if not all(r.gated and (r.num_heads, r.eps) == (self.num_heads, self.eps) for r in routers):
            raise ValueError("grouped reads are of gated routers of the same heads and eps")
        reads = [Read(*(_whole(getattr(r, name), getattr(self, name)) for name in Read._fields)) for r in routers]
        return route_group(sources, reads, self.num_heads, self.eps, self.implementation)

    def extra_repr(self) -> str:
        return f"{self.query.shape[0]}, heads={self.num_heads}, gated={self.gated}"


class MHARAttention(nn.Module):
    """Llama attention with the two backbone options Llama lacks: q/k/v-only bias (Qwen2) and
    per-head q/k RMSNorm before RoPE (Qwen3)."""

    def __init__(self, config: MHARConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True

        qkv_bias = config.attention_bias or config.qkv_bias
        q_width, kv_width = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_width, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_width, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_width, bias=qkv_bias)
        self.o_proj = nn.Linear(q_width, config.hidden_size, bias=config.attention_bias)
        if config.qk_norm:
            self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(hidden_shape)
        if self.config.qk_norm:
            query_states, key_states = self.q_norm(query_states), self.k_norm(key_states)
        query_states, key_states = query_states.transpose(1, 2), key_states.transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class MHARDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: MHARConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = MHARAttention(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

        self.residual_mode = config.residual_mode
        if self.residual_mode != "standard":
            gated = self.residual_mode == "delta"
            # Layer 0's attention would only ever read one source (the embedding, or the null
            # source alone in delta mode), so it gets no router and takes its input directly.
            self.attn_router = MHARRouter(config, gated) if layer_idx > 0 else None
            self.mlp_router = MHARRouter(config, gated)
            self.starts_block = layer_idx % config.layers_per_block == 0
            # delta mode: the last layer of each block but the model's last makes the block's delta
            self.ends_block = (layer_idx + 1) % config.layers_per_block == 0 and \
                layer_idx + 1 < config.num_hidden_layers
            self.routing_implementation = config.routing_implementation
            # delta mode: the blocks this layer receives, the embedding and one per block ended before it
            # (block mode: the block sums, one per block started before it)
            self.blocks_received = 1 + layer_idx // config.layers_per_block if self.residual_mode == "delta" \
                else -(-layer_idx // config.layers_per_block)
            self.layer_idx = layer_idx
        # delta mode, a layer that starts a block: (layer, router name) of the later reads of the
        # blocks it completes, read together with its MLP read (MHARModel sets them); block mode:
        # of the block's later reads, begun with its own (two-phase reads). Names, not routers:
        # PEFT's modules_to_save swaps a router for a wrapper after the model is built.
        self.reads_ahead: tuple[tuple[nn.Module, str], ...] = ()
        # full mode: the layers after this one (MHARModel sets them), whose reads a group of layers
        # starting here begins with its own; the group's size is a launch knob, read per forward
        self.later_layers: tuple[nn.Module, ...] = ()

    def forward(
        self,
        *residual: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, ...]:
        """`residual`: the residual state's tensors, flat (`state.flat()`). Returns the layer's
        hidden state (what its attention sublayer starts from) followed by the next state's
        tensors (`unflatten(..., returned=True)` names them)."""
        attend = partial(
            self.attention_sublayer,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden, state = getattr(self, f"_forward_{self.residual_mode}")(self.unflatten(residual), attend)
        return hidden, *state.flat()

    def unflatten(self, tensors: Sequence[torch.Tensor], returned: bool = False):
        """The residual state in the flat `tensors`: the one this layer receives, or with
        `returned` the one it returns (see the module docstring)."""
        if self.residual_mode == "delta":  # a block's last layer returns one block entry more
            return DeltaState.from_flat(tensors, self.blocks_received + int(returned and self.ends_block))
        if self.residual_mode == "block":  # a block's first layer returns one block sum more
            return BlockState.from_flat(tensors, self.blocks_received + int(returned and self.starts_block))
        if self.residual_mode == "full":  # the embedding and two sources per layer before this one (and it)
            return FullState.from_flat(tensors, 1 + 2 * (self.layer_idx + int(returned)))
        return RESIDUAL_STATES[self.residual_mode].from_flat(tensors)

    # Each sublayer adds delta mode's gated `read` to its input and its output to `residual` when
    # given them: inside the sublayer, so that a compiled sublayer fuses the adds (and their
    # backward, where the stream's two gradients meet) instead of leaving an eager kernel each.
    def attention_sublayer(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None,
                           read: torch.Tensor | None = None, **kwargs):
        hidden_states = hidden_states if read is None else hidden_states + read
        out = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)[0]
        return out if residual is None else residual + out

    def mlp_sublayer(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None,
                     read: torch.Tensor | None = None, boundary: torch.Tensor | None = None):
        """With `boundary` (delta mode, a block's last layer): the output and its difference from
        the stream at the block's start, the block's delta."""
        hidden_states = hidden_states if read is None else hidden_states + read
        out = self.mlp(self.post_attention_layernorm(hidden_states))
        out = out if residual is None else residual + out
        return out if boundary is None else (out, out - boundary)

    def depth_source(self, tensor: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
        """A tensor routing sites will read, marked where it is made, after the depth source made
        before it (see `routing.track`), in that source's dtype: a read's sources share one. Under
        autocast full and block mode's sources are in the autocast dtype from the embedding on
        (`MHARModel.initial_state`); delta mode's stream stays in the weights' dtype, as Llama's
        does, so a converted model keeps computing what its source computes."""
        return track(tensor.to(after.dtype), self.routing_implementation, after)

    # Each mode's step takes the layer's residual state and returns (its hidden state, the next state).
    def _forward_standard(self, state: StandardState, attend):
        stream = attend(state.stream, residual=state.stream)
        return state.stream, StandardState(self.mlp_sublayer(stream, residual=stream))

    def _forward_full(self, state: FullState, attend):
        sources, pending = state.sources, state.pending
        group = launch_setting("full_group_layers", 1)
        # a group's first layer: on the fused path, the group's reads begin over the sources so far
        # (two-phase reads, as a block's in block mode); a group of one layer runs as a split pair
        ahead = tuple((layer, name) for layer in self.later_layers[:group - 1] for name in ("attn_router", "mlp_router"))
        if self.layer_idx % group == 0 and ahead and self._hands_reads_on(ahead):
            routers = [r for r in (self.attn_router, self.mlp_router) if r is not None]
            routers += [getattr(layer, name) for layer, name in ahead]
            pending = _begin_reads(sources, routers, self.routing_implementation)
        if not pending:  # split pairs: the MLP read takes the attention read's sources and one more
            # (one pass serves both)
            if self.attn_router is not None:
                hidden, prefix = self.attn_router.read_and_start(sources, begin=self.mlp_router)
            else:
                hidden, prefix = sources[0], None
            sources = (*sources, self.depth_source(attend(hidden), after=sources[-1]))
            mlp_input = self.mlp_router.read(sources, prefix=prefix)
            return hidden, FullState((*sources, self.depth_source(self.mlp_sublayer(mlp_input), after=sources[-1])))
        begun = 1 + 2 * (self.layer_idx - self.layer_idx % group)  # the sources made before the group
        hidden = sources[0]
        if self.attn_router is not None:
            hidden, pending = self._begun_read(self.attn_router, sources, begun, pending)
        sources = (*sources, self.depth_source(attend(hidden), after=sources[-1]))
        mlp_input, pending = self._begun_read(self.mlp_router, sources, begun, pending)
        sources = (*sources, self.depth_source(self.mlp_sublayer(mlp_input), after=sources[-1]))
        return hidden, FullState(sources, pending)

    def _forward_block(self, state: BlockState, attend):
        blocks, partial, pending = state.blocks, state.partial, state.pending
        if self.starts_block:  # the running sum joins the blocks, which every read of this block takes
            blocks, pending = (*blocks, partial), ()
            # on the fused path, the block's reads begin over them now (unless the launch config says whole reads)
            if self._hands_reads_on(self.reads_ahead) and launch_setting("block_two_phase", False):
                routers = [r for r in (self.attn_router, self.mlp_router) if r is not None]
                routers += [getattr(layer, name) for layer, name in self.reads_ahead]
                pending = _begin_reads(blocks, routers, self.routing_implementation)
            hidden = partial
            if self.attn_router is not None:  # its read takes the blocks alone
                hidden, pending = self._begun_read(self.attn_router, blocks, len(blocks), pending)
            running = attend(hidden)
        else:
            hidden, pending = self._begun_read(self.attn_router, (*blocks, partial), len(blocks), pending)
            running = attend(hidden, residual=partial)
        running = self.depth_source(running, after=partial)
        mlp_input, pending = self._begun_read(self.mlp_router, (*blocks, running), len(blocks), pending)
        running_after_mlp = self.mlp_sublayer(mlp_input, residual=running)
        return hidden, BlockState(blocks, self.depth_source(running_after_mlp, after=running), pending)

    def _hands_reads_on(self, reads_ahead) -> bool:
        """Whether this layer makes (or begins) the reads of the later sites `reads_ahead` and hands
        them on in the residual state. Not under activation checkpointing: every later layer's
        checkpoint keeps the state it was handed until the backward, so each such read (a tensor the
        size of the stream) would stay alive through the forward; each site then reads in its own
        layer, recomputed with it (whether gradients are on is left out: reentrant checkpointing runs
        the first forward without them). And only where FSDP2 lets it gather those routers (`_whole_here`)."""
        if self.gradient_checkpointing and self.training:
            return False
        return _whole_here(reads_ahead)

    @staticmethod
    def _begun_read(router, sources, begun: int, pending):
        """A read and the pending states left: it ends the first pending state (begun over the
        first `begun` sources) when its group's reads were begun together, else reads whole."""
        if not pending:
            return router.read(sources), ()
        return router.read(sources, prefix=(pending[0], pending[1], begun)), pending[2:]

    def _forward_delta(self, state: DeltaState, attend):
        blocks, ahead = state.blocks, state.reads_ahead
        read = None
        if self.attn_router is not None and not (ahead or self.starts_block):
            # nothing handed on (activation checkpointing, or routers FSDP2 could not gather): the
            # layer's two reads take the same blocks, so it makes them together, one pass for both
            pair = self.attn_router.read_group(blocks, [self.mlp_router])
            read, ahead = pair[0], pair[1:]
        elif self.attn_router is not None:  # a block's first one reads the blocks before the one just ended
            read, ahead = self._delta_read(self.attn_router, blocks[:-1] if self.starts_block else blocks, ahead)
        if self.starts_block and self.reads_ahead and self._hands_reads_on(self.reads_ahead):
            ahead = self.mlp_router.read_group(blocks, [getattr(layer, name) for layer, name in self.reads_ahead])
        stream = attend(state.stream, residual=state.stream, read=read)
        read, ahead = self._delta_read(self.mlp_router, blocks, ahead)
        if not self.ends_block:
            stream = self.mlp_sublayer(stream, residual=stream, read=read)
            return state.stream, state._replace(stream=stream, reads_ahead=ahead)
        # the delta from the sublayer, where compiled it costs no kernel of its own either way
        stream, delta = self.mlp_sublayer(stream, residual=stream, read=read, boundary=state.boundary)
        blocks = (*blocks, self.depth_source(delta, after=blocks[-1]))
        return state.stream, DeltaState(stream, boundary=stream, blocks=blocks, reads_ahead=ahead)

    @staticmethod
    def _delta_read(router, blocks, ahead):
        """A delta read, `gate * mix`, and the reads still ahead: the first of `ahead` when the
        block's reads were computed together, else the router's own read."""
        return (ahead[0], ahead[1:]) if ahead else (router.read(blocks), ())


def _group_delta_reads(layers) -> None:
    """Delta mode: every read from one block start to the next takes the same blocks (the MLP
    read of the starting layer, both reads of the layers after it, and the attention read of the
    next block's first layer, made before that block is added), so the starting layer computes
    them together (`routing.route_group`: on the fused path one pass over the blocks for all)."""
    starts = [i for i, layer in enumerate(layers) if layer.starts_block] + [len(layers)]
    for start, end in zip(starts, starts[1:]):
        later = [(layer, name) for layer in layers[start + 1:end] for name in ("attn_router", "mlp_router")]
        layers[start].reads_ahead = (*later, *([(layers[end], "attn_router")] if end < len(layers) else []))


def _group_block_reads(layers) -> None:
    """Block mode: every read of a block takes the block sums finished before it (and then the
    block's running sum, which differs per read), so the block's first layer begins them together
    (`_begin_reads`): it names the reads of the block's later layers."""
    starts = [i for i, layer in enumerate(layers) if layer.starts_block] + [len(layers)]
    for start, end in zip(starts, starts[1:]):
        layers[start].reads_ahead = tuple((layer, name) for layer in layers[start + 1:end]
                                          for name in ("attn_router", "mlp_router"))


def _begin_reads(sources, routers, implementation: str) -> tuple[torch.Tensor, ...]:
    """Two-phase reads (`routing.route_begin_group`, docs/kernels.md; block mode's over a block's
    finished blocks, full mode's over the sources made before a group of layers): on the fused
    path one pass over `sources` begins the read of each of `routers` (in the order they read),
    and returns their states flat, (mix, lse) each, for `MHARDecoderLayer._begun_read` to end;
    elsewhere () and each router reads whole. The later routers' parameters are gathered where
    FSDP2 holds them sharded (`_whole`)."""
    first = routers[0]
    reads = [Read(_whole(r.query, first.query), _whole(r.key_norm_weight, first.key_norm_weight)) for r in routers]
    states = route_begin_group(sources, reads, first.num_heads, first.eps, implementation)
    return tuple(t for state in states for t in state) if states is not None else ()


def _whole_here(reads_ahead) -> bool:
    """Whether a group's first layer (a block's, or a full-mode group of layers') can compute the
    reads of these (layer, router name) now. FSDP2 keeps a layer's parameters sharded (DTensors)
    outside its own forward: those routers' are gathered for the group (`_whole`). But a layer it
    has unsharded early (prefetched) frees its whole parameters again after its forward, before
    the group's backward needs them: then each router reads in its own layer."""
    if FSDPModule is None:
        return True
    for layer, name in reads_ahead:
        if isinstance(layer, FSDPModule) and not all(isinstance(p, DTensor) for p in getattr(layer, name).parameters()):
            return False
    return True


def _whole(param: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    """A router parameter as one whole tensor, in the dtype of `like`, the same parameter of the
    router that runs (which FSDP2 has unsharded in its compute dtype). A sharded one (DTensor) is
    gathered, and its gradient averaged over the ranks and scattered back, as FSDP2 does its own."""
    if DTensor is None or not isinstance(param, DTensor):
        return param
    dims = param.device_mesh.ndim
    whole = param.redistribute(placements=[Replicate()] * dims).to_local(grad_placements=[Partial("avg")] * dims)
    return whole.to(like.dtype)


class MHARPreTrainedModel(PreTrainedModel):
    config: MHARConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MHARDecoderLayer"]
    _supports_flash_attn = True  # token attention is Llama's; routing never touches the KV cache
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    _can_record_outputs = {"attentions": MHARAttention}

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, MHARRouter):
            init.zeros_(module.query)  # zero queries: uniform weights over depth at init
            init.ones_(module.key_norm_weight)
            if module.gated:
                init.zeros_(module.null_source)
                init.zeros_(module.gate)  # zero gates: a converted model computes what its source did


class MHARModel(MHARPreTrainedModel):
    def __init__(self, config: MHARConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([MHARDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        if config.residual_mode in ("full", "block"):
            self.final_router = MHARRouter(config, gated=False)
        if config.residual_mode == "delta":
            _group_delta_reads(self.layers)
        if config.residual_mode == "block":
            _group_block_reads(self.layers)
        if config.residual_mode == "full":
            for i, layer in enumerate(self.layers):
                layer.later_layers = tuple(self.layers[i + 1:])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def initial_state(self, embeddings: torch.Tensor):
        """The residual state before layer 0 (see the module docstring)."""
        mode = self.config.residual_mode
        if mode in ("full", "block"):  # every later source is a sublayer output (full) or a block's sum of
            # them (block), made in autocast's dtype when it is on: the embedding joins them there, so each
            # read moves half the bytes of fp32 sources, and no fp32 copy of the stream is kept beside them
            device = embeddings.device.type
            if torch.is_autocast_enabled(device):
                embeddings = embeddings.to(torch.get_autocast_dtype(device))
            first = track(embeddings, self.config.routing_implementation)
            return FullState(sources=(first,)) if mode == "full" else BlockState(blocks=(), partial=first)
        if mode == "delta":  # the embedding is the first block entry
            first = track(embeddings, self.config.routing_implementation)
            return DeltaState(stream=embeddings, boundary=embeddings, blocks=(first,), reads_ahead=())
        return StandardState(stream=embeddings)

    def final_hidden(self, state) -> torch.Tensor:
        """The input of the final norm: the last routed read (of every source in full mode, of
        the blocks and the running one in block mode), or the plain stream."""
        if self.config.residual_mode in ("full", "block"):
            return self.final_router.read(state.sources)
        return state.stream

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | int | list[int] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        """`output_hidden_states`: True for every layer's hidden state (see the module docstring),
        or the indices of those to keep (the others are None), as in transformers' models."""
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        # the mask looks for packed sequences in positions it is given, a check that waits for the
        # GPU (and cannot run under CUDA graph capture): positions made here hold one sequence per row
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids=position_ids)

        keep = self._hidden_states_to_keep(output_hidden_states)
        all_hidden_states = []
        state = self.initial_state(inputs_embeds)
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden, *tensors = decoder_layer(
                *state.flat(),
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                **kwargs,
            )
            state = decoder_layer.unflatten(tensors, returned=True)
            if keep is not None:
                all_hidden_states.append(hidden if len(all_hidden_states) in keep else None)
        hidden_states = self.norm(self.final_hidden(state))
        if keep is not None:
            all_hidden_states.append(hidden_states if len(all_hidden_states) in keep else None)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            cache=cache,
            hidden_states=tuple(all_hidden_states) if keep is not None else None,
        )

    def _hidden_states_to_keep(self, output_hidden_states) -> set[int] | None:
        """The hidden-state indices to return (None: none), from the argument or the config."""
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        if output_hidden_states is False:
            return None
        count = self.config.num_hidden_layers + 1
        selected = selected_hidden_states(output_hidden_states)
        return set(range(count)) if selected is None else resolve_hidden_states_indices(self, selected, count)


class MHARForCausalLM(MHARPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    def __init__(self, config: MHARConfig):
        super().__init__(config)
        self.model = MHARModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


# Task heads on the base model, as Llama's (transformers' generic heads build it through AutoModel).
class MHARForSequenceClassification(GenericForSequenceClassification, MHARPreTrainedModel): ...


class MHARForQuestionAnswering(GenericForQuestionAnswering, MHARPreTrainedModel):
    base_model_prefix = "transformer"  # Llama's name for it here, so its checkpoints load


class MHARForTokenClassification(GenericForTokenClassification, MHARPreTrainedModel): ...


__all__ = [
    "MHARForCausalLM",
    "MHARForQuestionAnswering",
    "MHARForSequenceClassification",
    "MHARForTokenClassification",
    "MHARModel",
    "MHARPreTrainedModel",
    "MHARRouter",
]
