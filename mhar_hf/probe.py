"""The routing probe: what each head of each routing site reads, averaged over a text, and the
paper's measures of how much heads and query slices disagree (docs/method.md).

`RoutingProbe` is a context manager that puts a forward pre-hook on every `MHARRouter`: each of a
router's reads runs through its `__call__`, and a grouped read (`read_group`, delta mode) names
the sites it reads for in its `ahead` keyword, so the router observes those sites too. The hook
only reads the sources and the sites' parameters, so the forward's results are unchanged.
Per site it accumulates, over tokens:
  - the routing weights of every head over the site's sources (`routing_weights`);
  - width disagreement: each head's query and keys cut into S contiguous slices, each slice
    choosing a depth distribution alone, compared (KL) with the head's shared distribution.
    For H = 1 this is the paper's single-head measure; for H > 1 it is what is left inside heads;
  - the same measure for random queries of matched norm (the null);
  - source collinearity: the mean pairwise cosine of the site's sources.
Per-head deviation from the heads' consensus is computed from the averaged weights.
`probe_folder` runs it on a saved model and a text file; `write_outputs` writes the JSON and
the two pictures; `format_table` renders the printed table.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from .folder import PROBE_FILES, PROBE_FOLDER, ROUTER_SUFFIX, ProbeRecord, read_mhar_config, write_atomically
from .modeling_mhar import RESIDUAL_STATES
from .routing import routing_keys, routing_weights

SLICES = 4
NULL_DRAWS = 4
MIN_TOKENS = 16


# ---------------------------------------------------------------------------------------------
# Measures on tensors


def _math_dtype(tensor: torch.Tensor) -> torch.dtype:
    return torch.promote_types(tensor.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs


def slice_logits(keys: torch.Tensor, query: torch.Tensor, num_heads: int, slices: int = SLICES) -> torch.Tensor:
    """`<q_[h,s], k_n[h,s]>` for every source n, head h and contiguous slice s of the head: `[N, ..., H, S]`,
    from `routing_keys`. Summed over s they are the site's routing logits."""
    width = keys.shape[-1]
    if width % (num_heads * slices):
        raise ValueError(
            f"the head width {width // num_heads} (hidden size {width} / {num_heads} heads) does not split into "
            f"{slices} equal slices: choose a slice count that divides it"
        )
    shape = (*keys.shape[:-1], num_heads, slices, width // (num_heads * slices))
    return (keys.view(shape) * query.to(keys.dtype).view(num_heads, slices, -1)).sum(-1)


def _mean_slice_kl(logits: torch.Tensor) -> torch.Tensor:
    slices = logits.shape[-1]
    shared = logits.sum(-1, keepdim=True).log_softmax(0)
    alone = (logits * slices).log_softmax(0)
    return (alone.exp() * (alone - shared)).sum(0).mean(-1)


def width_disagreement(
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    key_norm_weight: torch.Tensor,
    num_heads: int,
    eps: float,
    slices: int = SLICES,
    null_source: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over slices of KL(a_s || alpha) per token and head: `[..., H]`.

    alpha is the head's routing distribution; a_s = softmax_n(S * <q_[s], k_n[s]>) is what slice s
    would choose alone, its logits scaled by S so that alpha's logits are the slices' mean:
    slices that agree give exactly 0, and only disagreement in direction counts.
    """
    keys = routing_keys(sources, key_norm_weight, eps, null_source)
    return _mean_slice_kl(slice_logits(keys, query, num_heads, slices))


def matched_norm_queries(query: torch.Tensor, num_heads: int, draws: int, generator: torch.Generator) -> torch.Tensor:
    """`draws` random queries `[draws, d]` whose every head slice has the norm of `query`'s."""
    heads = query.detach().float().cpu().view(num_heads, -1)
    random = torch.randn(draws, *heads.shape, generator=generator)
    random = random / random.norm(dim=-1, keepdim=True) * heads.norm(dim=-1, keepdim=True)
    return random.view(draws, -1)


def head_deviation(mean_weights: torch.Tensor) -> torch.Tensor:
    """Each head's total-variation distance from the heads' consensus: `[H]` in [0, 1].

    `mean_weights` `[N, H]` is every head's depth distribution averaged over tokens; the
    consensus is their mean over heads. 0.5 means half of a head's routing mass sits elsewhere.
    """
    consensus = mean_weights.mean(-1, keepdim=True)
    return 0.5 * (mean_weights - consensus).abs().sum(0)


def source_collinearity(sources: Sequence[torch.Tensor]) -> torch.Tensor:
    """Mean pairwise cosine over the distinct pairs of sources, per token: `[...]` (needs >= 2 sources)."""
    if len(sources) < 2:
        raise ValueError("collinearity needs at least two sources")
    dtype = _math_dtype(sources[0])
    unit = torch.nn.functional.normalize(torch.stack([s.to(dtype) for s in sources], dim=-2), dim=-1)  # [..., N, d]
    gram = unit @ unit.transpose(-1, -2)
    n = len(sources)
    upper = torch.triu_indices(n, n, offset=1, device=gram.device)
    return gram[..., upper[0], upper[1]].mean(-1)


# ---------------------------------------------------------------------------------------------
# Sites and sources


def find_routers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(site name, router) in forward order, e.g. `layers.1.attn`, `layers.1.mlp`, `final`.

    Routers are recognised by class name so that a model loaded through the trust_remote_code
    bundle (a copy of the class in another module) is probed too.
    """
    routers = []
    for name, module in model.named_modules():
        if type(module).__name__ == "MHARRouter":
            site = name.removeprefix("model.").removesuffix(ROUTER_SUFFIX)
            routers.append((site, module))
    return routers


def source_labels(mode: str, count: int) -> list[str]:
    """Names of a site's `count` sources, by index, as the mode's residual state gives them
    (`FullState.source_labels`, ...); an index names the same source at every site."""
    state = RESIDUAL_STATES.get(mode)
    if state is None:
        raise ValueError(f"residual_mode={mode!r} has no routing sites to probe")
    return state.source_labels(count)


# ---------------------------------------------------------------------------------------------
# Collecting


class _SiteAccumulator:
    def __init__(self, router: torch.nn.Module, null_queries: torch.Tensor):
        self.router = router
        self.null_queries = null_queries  # [draws, d], fixed for the whole run
        self.tokens = 0
        self.weight_sum = None  # [N, H] fp64
        self.disagreement_sum = torch.zeros(router.num_heads, dtype=torch.float64)
        self.null_sum = torch.zeros(router.num_heads, dtype=torch.float64)
        self.collinearity_sum = 0.0
        self.pairs = False

    @torch.no_grad()
    def observe(self, sources: Sequence[torch.Tensor], slices: int) -> None:
        r = self.router
        null = r.null_source if r.gated else None
        weights = routing_weights(sources, r.query, r.key_norm_weight, r.num_heads, r.eps, null)
        weights = weights.flatten(1, -2)  # [N, tokens, H]
        summed = weights.sum(1).double().cpu()
        self.weight_sum = summed if self.weight_sum is None else self.weight_sum + summed
        self.tokens += weights.shape[1]
        keys = routing_keys(sources, r.key_norm_weight, r.eps, null)  # shared by the trained and null queries
        disagreement = _mean_slice_kl(slice_logits(keys, r.query, r.num_heads, slices))
        self.disagreement_sum += disagreement.flatten(0, -2).sum(0).double().cpu()
        for query in self.null_queries.to(r.query.device):
            null_disagreement = _mean_slice_kl(slice_logits(keys, query, r.num_heads, slices))
            self.null_sum += null_disagreement.flatten(0, -2).sum(0).double().cpu() / len(self.null_queries)
        if len(sources) >= 2:
            self.pairs = True
            self.collinearity_sum += float(source_collinearity(sources).double().sum())


class RoutingProbe:
    """Hooks on every routing site of `model`; use as `with RoutingProbe(model) as probe: model(...)`,
    then `probe.sites()`. The forward's results are unchanged."""

    def __init__(self, model: torch.nn.Module, slices: int = SLICES, null_draws: int = NULL_DRAWS, seed: int = 0):
        self.model = model
        self.mode = model.config.residual_mode
        self.routers = find_routers(model)
        if not self.routers:
            raise ValueError(
                f"the model ({type(model).__name__}, residual_mode={getattr(model.config, 'residual_mode', None)!r}) "
                "has no MHAR routing sites: the probe needs a full, block or delta MHAR model"
            )
        if slices < 1 or null_draws < 1:
            raise ValueError(f"slices ({slices}) and null draws ({null_draws}) must be at least 1")
        self.slices = slices
        self.null_draws = null_draws
        self.seed = seed
        generator = torch.Generator().manual_seed(seed)
        self._sites = {
            name: _SiteAccumulator(router, matched_norm_queries(router.query, router.num_heads, null_draws, generator))
            for name, router in self.routers
        }
        self._handles = []

    def __enter__(self) -> RoutingProbe:
        site_of = {router: self._sites[name] for name, router in self.routers}
        for router in site_of:

            def hook(module, args, kwargs):
                sources = args[0] if args else kwargs["sources"]
                for read in (module, *kwargs.get("ahead", ())):  # and the sites of a grouped read
                    site_of[read].observe(sources, self.slices)

            self._handles.append(router.register_forward_pre_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def sites(self) -> list[dict]:
        """Per site, in forward order: its sources, average weights `[N][H]`, query norms, gate,
        width disagreement and null per head, per-head deviation (H > 1) and collinearity."""
        results = []
        for name, site in self._sites.items():
            if site.tokens == 0:
                raise ValueError(f"routing site {name} saw no tokens: run a forward pass inside the probe first")
            r = site.router
            mean_weights = site.weight_sum / site.tokens
            results.append(
                {
                    "name": name,
                    "sources": source_labels(self.mode, mean_weights.shape[0]),
                    "weights": mean_weights.tolist(),
                    "query_norm": r.query.detach().float().cpu().view(r.num_heads, -1).norm(dim=-1).tolist(),
                    "gate": float(r.gate.detach().float()) if r.gated else None,
                    "width_disagreement": (site.disagreement_sum / site.tokens).tolist(),
                    "null_disagreement": (site.null_sum / site.tokens).tolist(),
                    "head_deviation": head_deviation(mean_weights).tolist() if r.num_heads > 1 else None,
                    "collinearity": site.collinearity_sum / site.tokens if site.pairs else None,
                }
            )
        return results


# ---------------------------------------------------------------------------------------------
# Running on a model


def token_chunks(ids: torch.Tensor, seq_len: int, batch_size: int) -> Iterable[torch.Tensor]:
    """`[batch, seq_len]` batches of consecutive windows, then the shorter remainder on its own."""
    full = len(ids) // seq_len
    if full:
        yield from ids[: full * seq_len].view(full, seq_len).split(batch_size)
    if len(ids) % seq_len:
        yield ids[full * seq_len :].unsqueeze(0)


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def summarize(sites: list[dict], num_heads: int) -> dict:
    """Means over sites (and heads), and notes on states that make the numbers trivial."""
    trained = _mean(v for s in sites for v in s["width_disagreement"])
    null = _mean(v for s in sites for v in s["null_disagreement"])
    per_head = None
    if num_heads > 1:
        per_head = [_mean(s["head_deviation"][h] for s in sites) for h in range(num_heads)]
    zero_queries = all(norm == 0 for s in sites for norm in s["query_norm"])
    gates = [s["gate"] for s in sites if s["gate"] is not None]
    zero_gates = all(g == 0 for g in gates) if gates else None
    notes = []
    if zero_queries:
        notes.append(
            "every query is zero: each head routes uniformly over its sources (an untrained or just-converted "
            "model), so disagreement and deviation are 0 by construction"
        )
    if zero_gates:
        notes.append(
            "every gate is 0: the routed terms are switched off and the model computes its plain residual "
            "exactly (a just-converted delta model)"
        )
    if num_heads == 1:
        notes.append("single-head sites: width disagreement is the paper's measure; there is no per-head deviation")
    return {
        "width_disagreement": trained,
        "null_disagreement": null,
        "learned_excess": trained - null,
        "head_deviation": per_head,
        "mean_head_deviation": _mean(per_head) if per_head else None,
        "collinearity": _mean(s["collinearity"] for s in sites if s["collinearity"] is not None),
        "zero_queries": zero_queries,
        "zero_gates": zero_gates,
        "notes": notes,
    }


@torch.no_grad()
def probe_model(
    model: torch.nn.Module,
    ids: torch.Tensor,
    seq_len: int = 512,
    batch_size: int = 8,
    slices: int = SLICES,
    null_draws: int = NULL_DRAWS,
    seed: int = 0,
) -> dict:
    """Probe `model` on the 1-D token ids `ids`: the report that `write_outputs` writes."""
    if ids.dim() != 1 or len(ids) < MIN_TOKENS:
        raise ValueError(f"the probe needs a 1-D run of at least {MIN_TOKENS} tokens; got shape {tuple(ids.shape)}")
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be at least 1")
    config = model.config
    seq_len = min(seq_len, getattr(config, "max_position_embeddings", seq_len))
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        with RoutingProbe(model, slices, null_draws, seed) as probe:
            for batch in token_chunks(ids, seq_len, batch_size):
                model(input_ids=batch.to(device), use_cache=False)
    finally:
        model.train(was_training)
    sites = probe.sites()
    return {
        "model": {
            "residual_mode": config.residual_mode,
            "residual_heads": config.residual_heads,
            "num_hidden_layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
        },
        "data": {"tokens": len(ids), "seq_len": seq_len},
        "settings": {"slices": slices, "null_draws": null_draws, "seed": seed},
        "summary": summarize(sites, config.residual_heads),
        "sites": sites,
    }


def read_text(path: str | Path, max_chars: int | None = None) -> str:
    """A text file, or a jsonl file whose lines hold a `text` field (documents joined by blank lines)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} not found: pass --data a text or jsonl file")
    if path.suffix == ".jsonl":
        texts = []
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path} line {number} is not JSON: {error}") from None
                if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                    raise ValueError(f"{path} line {number} has no string field 'text'")
                texts.append(row["text"])
                if max_chars is not None and sum(map(len, texts)) >= max_chars:
                    break
        text = "\n\n".join(texts)
    else:
        with path.open(encoding="utf-8") as f:
            text = f.read(max_chars) if max_chars is not None else f.read()
    if not text.strip():
        raise ValueError(f"data file {path} holds no text")
    return text


def load_model(path: str | Path, device: str | None = None):
    """An MHAR model and its tokenizer from a folder written by save_pretrained, with clear errors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import mhar_hf  # noqa: F401  (registers the mhar model type)

    folder = Path(path)
    config = read_mhar_config(folder)
    if config.get("residual_mode", "full") == "standard":
        raise ValueError(f"{folder} is an MHAR model in residual_mode='standard': it has no routers to probe")
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise FileNotFoundError(f"no tokenizer in {folder}: save one there with tokenizer.save_pretrained(DIR)")
    # device_map loads the weights straight onto the device
    return AutoModelForCausalLM.from_pretrained(folder, device_map=device), AutoTokenizer.from_pretrained(folder)


def probe_folder(
    path: str | Path,
    data: str | Path,
    tokens: int = 4096,
    out: str | Path | None = None,
    seq_len: int = 512,
    slices: int = SLICES,
    null_draws: int = NULL_DRAWS,
    seed: int = 0,
    device: str | None = None,
) -> tuple[dict, Path]:
    """Probe the model saved in `path` on the first `tokens` tokens of `data`; write the JSON and
    pictures to `out` (default `path/probe/`). Returns the report and the output folder."""
    if tokens < MIN_TOKENS:
        raise ValueError(f"--tokens {tokens} is too few: the probe needs at least {MIN_TOKENS}")
    model, tokenizer = load_model(path, device)
    # A token is rarely longer than 32 characters: read no more of a large file than that allows.
    text = read_text(data, max_chars=tokens * 32)
    ids = torch.tensor(tokenizer(text)["input_ids"][:tokens], dtype=torch.long)
    if len(ids) < MIN_TOKENS:
        raise ValueError(f"{data} holds only {len(ids)} tokens; the probe needs at least {MIN_TOKENS}")
    report = probe_model(model, ids, seq_len=seq_len, slices=slices, null_draws=null_draws, seed=seed)
    report["model"]["path"] = str(path)
    report["data"].update(file=str(data), requested_tokens=tokens)
    out = Path(out) if out is not None else Path(path) / PROBE_FOLDER
    write_outputs(report, out)
    return report, out


# ---------------------------------------------------------------------------------------------
# Output


def format_table(report: dict) -> str:
    """The printed table: one row per site, then the summary."""
    sites, summary = report["sites"], report["summary"]
    header = f"{'site':<16}{'N':>4}  {'reads most':<14}{'width KL':>10}{'null KL':>10}{'excess':>10}" \
             f"{'max dev':>9}{'collin':>8}{'gate':>9}"
    lines = [header, "-" * len(header)]
    for site in sites:
        weights = torch.tensor(site["weights"])
        mean = weights.mean(-1).tolist()
        top = max(range(len(mean)), key=mean.__getitem__)
        reads = "uniform" if max(mean) - min(mean) < 1e-6 else f"{site['sources'][top]} {mean[top]:.2f}"
        kl, null = _mean(site["width_disagreement"]), _mean(site["null_disagreement"])
        dev = f"{max(site['head_deviation']):9.3f}" if site["head_deviation"] else f"{'-':>9}"
        col = f"{site['collinearity']:8.3f}" if site["collinearity"] is not None else f"{'-':>8}"
        gate = f"{site['gate']:9.4f}" if site["gate"] is not None else f"{'-':>9}"
        lines.append(
            f"{site['name']:<16}{len(mean):>4}  {reads:<14}"
            f"{kl:10.4f}{null:10.4f}{kl - null:10.4f}{dev}{col}{gate}"
        )
    lines.append("")
    lines.append(
        f"width disagreement {summary['width_disagreement']:.4f} (S={report['settings']['slices']}), "
        f"matched-norm null {summary['null_disagreement']:.4f}, learned excess {summary['learned_excess']:+.4f}"
    )
    if summary["head_deviation"] is not None:
        per_head = ", ".join(f"{v:.3f}" for v in summary["head_deviation"])
        lines.append(f"per-head deviation from consensus (TV, mean over sites): {per_head}")
    if summary["collinearity"] is not None:
        lines.append(f"source collinearity (mean pairwise cosine): {summary['collinearity']:.3f}")
    lines.extend(f"note: {note}" for note in summary["notes"])
    return "\n".join(lines)


def _weight_grid(report: dict) -> tuple[torch.Tensor, list[str]]:
    """`[H, sites, max N]` average weights, NaN where a site has no such source; the source labels."""
    sites = report["sites"]
    heads = report["model"]["residual_heads"]
    width = max(len(s["weights"]) for s in sites)
    grid = torch.full((heads, len(sites), width), float("nan"))
    for row, site in enumerate(sites):
        weights = torch.tensor(site["weights"])  # [N, H]
        grid[:, row, : len(weights)] = weights.T
    return grid, source_labels(report["model"]["residual_mode"], width)


def _png(figure) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return buffer.getvalue()


def routing_heatmap_png(report: dict) -> bytes:
    """A grid of heatmaps, one per head: routing weight by site (rows) and source (columns)."""
    from matplotlib.figure import Figure

    grid, labels = _weight_grid(report)
    heads, rows, columns = grid.shape
    ncols = min(heads, 4)
    nrows = -(-heads // ncols)
    cell = 0.28
    row_cell = min(cell, 12 / (rows * nrows))  # keep deep models' grids to a readable height
    figure = Figure(figsize=(ncols * (1.5 + cell * columns), nrows * (1.0 + row_cell * rows)), layout="constrained")
    axes = figure.subplots(nrows, ncols, squeeze=False)
    vmax = float(grid.nan_to_num(0).max()) or 1.0
    names = [s["name"] for s in report["sites"]]
    for h, ax in enumerate(axes.flat):
        if h >= heads:
            ax.set_visible(False)
            continue
        image = ax.imshow(grid[h].numpy(), cmap="viridis", vmin=0, vmax=vmax, aspect="auto", interpolation="nearest")
        ax.set_title(f"head {h}" if heads > 1 else "single head", fontsize=9)
        ax.set_xticks(range(columns), labels, rotation=90, fontsize=6)
        ax.set_yticks(range(rows), names if h % ncols == 0 else [""] * rows, fontsize=6)
    figure.colorbar(image, ax=axes, shrink=0.8, label="mean routing weight")
    mode = report["model"]["residual_mode"]
    figure.suptitle(f"what each head reads ({mode} mode, {report['data']['tokens']} tokens)", fontsize=10)
    return _png(figure)


def head_deviation_png(report: dict) -> bytes:
    return _png(head_deviation_figure(report))


def head_deviation_figure(report: dict):
    """Per-head deviation from the heads' consensus across sites (or a note for single-head
    models); the legend stands right of the plot, clear of the data."""
    from matplotlib.figure import Figure

    sites, summary = report["sites"], report["summary"]
    figure = Figure(figsize=(max(5.0, 0.18 * len(sites) + 2), 3.6), layout="constrained")
    ax = figure.subplots()
    if summary["head_deviation"] is None:
        ax.text(0.5, 0.5, "single-head sites: no per-head deviation", ha="center", va="center")
        ax.set_axis_off()
        return figure
    x = range(len(sites))
    for h, mean in enumerate(summary["head_deviation"]):
        deviations = [s["head_deviation"][h] for s in sites]
        ax.plot(x, deviations, marker="o", markersize=3, label=f"head {h} (mean {mean:.3f})")
    ax.set_xticks(list(x), [s["name"] for s in sites], rotation=90, fontsize=6)
    ax.set_ylabel("TV distance from consensus")
    ax.set_ylim(bottom=0)
    title = "per-head deviation of the average depth distribution"
    if summary["zero_queries"]:
        title += " (zero queries: uniform routing)"
    ax.set_title(title, fontsize=9)
    figure.legend(loc="outside right upper", fontsize=6)
    return figure


def write_outputs(report: dict, out: str | Path) -> list[Path]:
    """Write `probe.json` (a ProbeRecord, dated), `routing_heatmap.png` and `head_deviation.png`
    into `out`. Everything is rendered before anything is written, and each file is replaced
    atomically."""
    record = ProbeRecord.from_dict(report, "the probe report")
    contents = dict(zip(PROBE_FILES, (json.dumps(record.to_dict(), indent=2) + "\n", routing_heatmap_png(report),
                                      head_deviation_png(report)), strict=True))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in contents.items():
        write_atomically(out / name, data)
    return [out / name for name in contents]


__all__ = [
    "RoutingProbe",
    "find_routers",
    "format_table",
    "head_deviation",
    "matched_norm_queries",
    "probe_folder",
    "probe_model",
    "read_text",
    "slice_logits",
    "source_collinearity",
    "source_labels",
    "width_disagreement",
    "write_outputs",
]
