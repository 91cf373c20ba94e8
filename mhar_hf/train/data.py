"""Training data: documents -> tokens -> fixed-length packed sequences, in a seeded order
that any process can enter at any position.

Sources: local `.jsonl`/`.json`, `.parquet` and `.txt` files (a text file is one document),
a folder written by `Dataset.save_to_disk`, or a `datasets` name. Each document becomes
`[bos] + tokens + [eos]` (bos only when the tokenizer has one); documents are concatenated and
cut into sequences of exactly `seq_length` tokens, so there is no padding. Packing runs over
batches of 1,000 documents and drops each batch's last partial sequence.

The order is a pure function of the seed: "global sequence g" means the same sequence for
every process and every world size, and a run resumes by starting at its position g.
  in memory (default)  the packed corpus lives in Arrow files (memory-mapped, so it may be
                       larger than RAM); epoch e visits the training rows in a permutation
                       seeded by (seed, e); resuming is O(1).
  streaming            nothing is prepared ahead; sequences come in file order, shuffled
                       through a seeded buffer; resuming re-reads the stream up to g.
The held-out validation sequences are a seeded random sample of the packed corpus (streaming:
the first ones of the stream) and never appear in training. With separate validation sources
(`val_specs`, e.g. files held out whole), they are a sample of those sources' packed rows drawn
with a fixed seed, so runs of every seed are scored on the same rows, and the training sequences
are the whole of the training sources.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".text": "text", ".md": "text"}
PACK_DOCUMENTS = 1000  # documents per packing batch


def _looks_like_path(spec: str) -> bool:
    # "org/name" is a datasets name; "./x", "/x", "~/x" and "x.jsonl" are meant as local paths.
    return spec.startswith((".", os.sep, "~")) or Path(spec).suffix in FILE_BUILDERS


def check_sources(specs: Sequence[str]) -> None:
    """Fail early on a local path that does not exist (a bare name is taken as a `datasets` name)."""
    if not specs:
        raise ValueError("no --data given: pass one or more files, folders or datasets names")
    for spec in specs:
        if not Path(spec).expanduser().exists() and _looks_like_path(spec):
            raise FileNotFoundError(f"--data {spec}: no such file or folder")
        path = Path(spec).expanduser()
        if path.is_file() and path.suffix not in FILE_BUILDERS:
            raise ValueError(f"--data {spec}: unsupported file type {path.suffix!r}; use one of {', '.join(FILE_BUILDERS)}")
        if path.is_file() and path.stat().st_size == 0:
            raise ValueError(f"--data {spec} is empty: it holds no documents")


def load_documents(specs: Sequence[str], text_field: str = "text", streaming: bool = False, split: str = "train",
                   name: str | None = None):
    """One `datasets` dataset (iterable when `streaming`) with a single `text` column."""
    import datasets

    check_sources(specs)
    parts = []
    files = [Path(s).expanduser() for s in specs if Path(s).expanduser().is_file()]
    for builder, group in itertools.groupby(sorted(files, key=lambda p: FILE_BUILDERS[p.suffix]), key=lambda p: FILE_BUILDERS[p.suffix]):
        kwargs = {"sample_by": "document"} if builder == "text" else {}
        parts.append(datasets.load_dataset(builder, data_files=[str(p) for p in group], split="train",
                                           streaming=streaming, **kwargs))
    for spec in specs:
        path = Path(spec).expanduser()
        if path.is_file():
            continue
        if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise ValueError(f"--data {spec} has splits {list(loaded)}, not {split!r}: pass --data-split")
                loaded = loaded[split]
            parts.append(loaded.to_iterable_dataset() if streaming else loaded)
        else:
            parts.append(datasets.load_dataset(str(path) if path.is_dir() else spec, name, split=split, streaming=streaming))
    columns = []
    for spec, part in zip(specs, parts):
        names = part.column_names
        if names is not None and text_field not in names:
            raise ValueError(f"--data {spec} has columns {names}, no {text_field!r}: pass --text-field")
        columns.append(part.select_columns([text_field]).rename_column(text_field, "text") if text_field != "text" else part.select_columns(["text"]))
    return columns[0] if len(columns) == 1 else datasets.concatenate_datasets(columns)


def tokenize_and_pack(documents, tokenizer, seq_length: int, num_proc: int | None = None):
    """Map documents to rows of exactly `seq_length` token ids (column `input_ids`)."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token: documents could not be separated; set tokenizer.eos_token")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id

    def pack(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        stream = []
        for doc in ids:
            if bos is not None:
                stream.append(bos)
            stream.extend(doc)
            stream.append(eos)
        usable = len(stream) // seq_length * seq_length
        return {"input_ids": [stream[i : i + seq_length] for i in range(0, usable, seq_length)]}

    kwargs = {} if num_proc is None else {"num_proc": num_proc}
    return documents.map(pack, batched=True, batch_size=PACK_DOCUMENTS, remove_columns=["text"], **kwargs)


@dataclass
class PackedCorpus:
    """Training sequences in a seeded order, plus the held-out validation sequences."""

    train: object  # datasets.Dataset or IterableDataset of `input_ids` rows
    val: torch.Tensor  # [num_val, seq_length]
    seed: int
    shuffle_buffer: int = 0

    @property
    def streaming(self) -> bool:
        import datasets

        return isinstance(self.train, datasets.IterableDataset)

    def epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.train))

    def sequences(self, start: int = 0) -> Iterator[torch.Tensor]:
        """Global sequences `start, start+1, ...` (epochs repeat forever, each in a new order)."""
        if self.streaming:
            yield from self._stream_sequences(start)
            return
        size = len(self.train)
        epoch, offset = divmod(start, size)
        while True:
            order = self.epoch_order(epoch)
            for row in order[offset:]:
                yield torch.tensor(self.train[int(row)]["input_ids"])
            epoch, offset = epoch + 1, 0

    def _stream_sequences(self, start: int) -> Iterator[torch.Tensor]:
        stream = self.train.shuffle(seed=self.seed, buffer_size=self.shuffle_buffer) if self.shuffle_buffer else self.train
        seen = 0
        for epoch in itertools.count():
            stream.set_epoch(epoch)
            empty = True
            for row in stream:
                empty = False
                if seen >= start:
                    yield torch.tensor(row["input_ids"])
                seen += 1
            if empty:
                raise ValueError("the training stream yields no sequences")

    def micro_batches(self, start: int, batch_size: int, rank: int = 0, world_size: int = 1) -> Iterator[torch.Tensor]:
        """This process's micro-batches: global micro-batch k is sequences
        `start + k*world*batch ... + (k+1)*world*batch`, and process r takes slice r of it."""
        if not self.streaming:  # random access: fetch only this process's rows
            size = len(self.train)
            orders: dict[int, np.ndarray] = {}
            for k in itertools.count():
                rows = []
                for g in range(start + (k * world_size + rank) * batch_size, start + (k * world_size + rank + 1) * batch_size):
                    epoch, offset = divmod(g, size)
                    if epoch not in orders:
                        orders = {epoch: self.epoch_order(epoch)}  # one epoch's order kept at a time
                    rows.append(int(orders[epoch][offset]))
                yield torch.tensor(self.train[rows]["input_ids"])
        else:
            sequences = self.sequences(start)
            while True:
                group = list(itertools.islice(sequences, world_size * batch_size))
                yield torch.stack(group[rank * batch_size : (rank + 1) * batch_size])


def build_corpus(specs: Sequence[str], tokenizer, seq_length: int, val_sequences: int, seed: int,
                 text_field: str = "text", streaming: bool = False, shuffle_buffer: int = 10_000,
                 split: str = "train", name: str | None = None, min_train_sequences: int = 1,
                 val_specs: Sequence[str] | None = None) -> PackedCorpus:
    """Load, tokenise, pack and split; fail with a clear message when too little data is left."""
    documents = load_documents(specs, text_field=text_field, streaming=streaming, split=split, name=name)
    packed = tokenize_and_pack(documents, tokenizer, seq_length)
    if val_specs:
        val = validation_rows(val_specs, tokenizer, seq_length, val_sequences, text_field=text_field)
        if streaming:
            head = list(itertools.islice(packed, min_train_sequences))
            _check_enough(len(head), min_train_sequences, seq_length, 0, min_train_sequences)
        else:
            _check_enough(len(packed), min_train_sequences, seq_length, 0, min_train_sequences)
        return PackedCorpus(train=packed, val=val, seed=seed, shuffle_buffer=shuffle_buffer if streaming else 0)
    needed = val_sequences + min_train_sequences
    if streaming:
        try:
            head = [torch.tensor(row["input_ids"]) for row in itertools.islice(packed, needed)]
        except KeyError as error:  # a stream's columns are only known once it is read
            raise ValueError(f"--data {', '.join(specs)}: no column {error} in the stream: pass --text-field") from None
        _check_enough(len(head), needed, seq_length, val_sequences, min_train_sequences)
        val = torch.stack(head[:val_sequences]) if val_sequences else torch.empty(0, seq_length, dtype=torch.long)
        return PackedCorpus(train=packed.skip(val_sequences), val=val, seed=seed, shuffle_buffer=shuffle_buffer)
    _check_enough(len(packed), needed, seq_length, val_sequences, min_train_sequences)
    order = np.random.default_rng([seed, 2**31]).permutation(len(packed))
    val_rows = np.sort(order[:val_sequences])
    train_rows = np.sort(order[val_sequences:])
    val = torch.tensor(packed.select(val_rows)["input_ids"]) if val_sequences else torch.empty(0, seq_length, dtype=torch.long)
    return PackedCorpus(train=packed.select(train_rows), val=val, seed=seed)


def validation_rows(specs: Sequence[str], tokenizer, seq_length: int, count: int, text_field: str = "text") -> torch.Tensor:
    """`count` packed rows of the sources `specs`, sampled with a fixed seed (the same rows for
    every run, whatever its --seed), in corpus order."""
    packed = tokenize_and_pack(load_documents(specs, text_field=text_field), tokenizer, seq_length)
    if len(packed) < count:
        raise ValueError(
            f"--val-data {', '.join(map(str, specs))} gives only {len(packed)} packed sequences of {seq_length} "
            f"tokens, but --val-sequences is {count}: add validation data or lower --val-sequences"
        )
    if count == 0:
        return torch.empty(0, seq_length, dtype=torch.long)
    rows = np.sort(np.random.default_rng(0).permutation(len(packed))[:count])
    return torch.tensor(packed.select(rows)["input_ids"])


def _check_enough(have: int, needed: int, seq_length: int, val: int, train: int) -> None:
    if have < needed:
        raise ValueError(
            f"the data gives only {have} packed sequences of {seq_length} tokens, but {val} validation "
            f"sequences plus {train} training sequences (one global batch) are needed: add data, lower "
            f"--seq-length, --val-sequences, --batch-size or the number of processes"
        )
