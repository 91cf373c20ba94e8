"""Regional torch.compile for training: the decoder layers are compiled one region at a time, as
torchtitan and the speed benchmark do, so every layer reuses one compiled graph and FSDP2's
per-layer hooks stay outside the graphs."""

from __future__ import annotations

import torch


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of a causal LM, also inside a PEFT wrapper."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder().layers


def compile_regions(model, whole_layers: bool | None = None, backend: str = "inductor") -> None:
    """Compile each decoder layer of `model` in place. An MHAR layer compiles its attention and MLP
    sublayers and leaves the routing reads between them to their own kernels (the fused reads are
    opaque to Dynamo); any other model (Llama, Qwen) compiles each layer whole, its fastest
    configuration. `whole_layers` overrides that choice (the benchmark compiles MHAR layers whole
    on the reference op)."""
    backends = torch._dynamo.list_backends(exclude_tags=())
    if backend not in backends:
        raise ValueError(f"--compile {backend}: not a torch.compile backend; one of {', '.join(backends)}")
    for layer in decoder_layers(model):
        whole = whole_layers if whole_layers is not None else not hasattr(layer, "attention_sublayer")
        if whole:
            layer.compile(backend=backend)
        else:
            layer.attention_sublayer = torch.compile(layer.attention_sublayer, backend=backend)
            layer.mlp_sublayer = torch.compile(layer.mlp_sublayer, backend=backend)
