"""Data: every source kind packs to what a plain reference packing gives; the seeded order is
resumable at any position, split across processes exactly, and the held-out rows never train."""

import json

import pytest
import torch
from train_setup import write_jsonl_corpus

from mhar_hf.tiny import demo_corpus
from mhar_hf.train.data import build_corpus, load_documents, tokenize_and_pack

SEQ = 32


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def paragraphs():
    return [p.strip() for p in demo_corpus().split("\n\n") if p.strip()][:60]


def reference_rows(documents, tokenizer, seq_length=SEQ):
    """Plain packing: each document's ids then eos, concatenated, cut, the tail dropped."""
    stream = []
    for doc in documents:
        stream += tokenizer.encode(doc, add_special_tokens=False) + [tokenizer.eos_token_id]
    return [stream[i : i + seq_length] for i in range(0, len(stream) - seq_length + 1, seq_length)]


def packed_rows(specs, tokenizer, **kwargs):
    return [list(r) for r in tokenize_and_pack(load_documents(specs, **kwargs), tokenizer, SEQ)["input_ids"]]


def test_jsonl_parquet_txt_and_saved_folder_pack_like_the_reference(tmp_path, tokenizer, paragraphs):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    expected = reference_rows(paragraphs, tokenizer)
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(json.dumps({"body": p, "id": i}) + "\n" for i, p in enumerate(paragraphs)))
    assert packed_rows([str(jsonl)], tokenizer, text_field="body") == expected

    pq.write_table(pa.table({"text": paragraphs}), tmp_path / "c.parquet")
    assert packed_rows([str(tmp_path / "c.parquet")], tokenizer) == expected

    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": paragraphs}).save_to_disk(str(saved))
    assert packed_rows([str(saved)], tokenizer) == expected

    # A .txt file is one document, newlines and all.
    halves = ["\n\n".join(paragraphs[:30]), "\n\n".join(paragraphs[30:])]
    files = []
    for i, half in enumerate(halves):
        files.append(tmp_path / f"part{i}.txt")
        files[-1].write_text(half)
    assert packed_rows([str(f) for f in files], tokenizer) == reference_rows(halves, tokenizer)


def test_order_is_seeded_resumable_and_split_across_processes(tmp_path, tokenizer):
    data = write_jsonl_corpus(tmp_path / "c.jsonl", demo_corpus())
    corpus = build_corpus([str(data)], tokenizer, SEQ, val_sequences=5, seed=3)
    rows = [tuple(r) for r in tokenize_and_pack(load_documents([str(data)]), tokenizer, SEQ)["input_ids"]]
    train = [tuple(r) for r in corpus.train["input_ids"]]
    val = [tuple(r.tolist()) for r in corpus.val]
    assert len(val) == 5 and sorted(train + val) == sorted(rows)  # a partition of the packed corpus

    n = len(train)
    stream = corpus.sequences(0)
    first_two_epochs = [tuple(next(stream).tolist()) for _ in range(2 * n)]
    assert sorted(first_two_epochs[:n]) == sorted(train) == sorted(first_two_epochs[n:])
    assert first_two_epochs[:n] != first_two_epochs[n:]  # each epoch its own order
    assert first_two_epochs[:n] != train  # shuffled

    start = n - 3  # resume just before an epoch boundary
    resumed = corpus.sequences(start)
    assert [tuple(next(resumed).tolist()) for _ in range(6)] == first_two_epochs[start : start + 6]

    world, batch = 3, 2
    per_rank = [corpus.micro_batches(start, batch, rank, world) for rank in range(world)]
    for k in range(2):
        combined = torch.cat([next(it) for it in per_rank])
        want = first_two_epochs[start + k * world * batch : start + (k + 1) * world * batch]
        assert [tuple(r.tolist()) for r in combined] == want

    again = build_corpus([str(data)], tokenizer, SEQ, val_sequences=5, seed=3)
    other = build_corpus([str(data)], tokenizer, SEQ, val_sequences=5, seed=4)
    assert torch.equal(again.val, corpus.val) and not torch.equal(other.val, corpus.val)
    assert torch.equal(next(again.sequences(7)), next(corpus.sequences(7)))


def test_separate_validation_sources_score_every_seed_on_the_same_rows(tmp_path, paragraphs, tokenizer):
    train_file = tmp_path / "train.jsonl"
    val_file = tmp_path / "val.jsonl"
    train_file.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs[:40]))
    val_file.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs[40:]))
    val_rows = [tuple(r) for r in reference_rows(paragraphs[40:], tokenizer)]
    for seed in (0, 1):
        corpus = build_corpus([str(train_file)], tokenizer, SEQ, val_sequences=3, seed=seed, val_specs=[str(val_file)])
        assert sorted(tuple(r) for r in corpus.train["input_ids"]) == sorted(map(tuple, reference_rows(paragraphs[:40], tokenizer)))
        val = [tuple(r.tolist()) for r in corpus.val]
        assert len(val) == 3 and set(val) <= set(val_rows)
        if seed == 0:
            first = val
        assert val == first
    streamed = build_corpus([str(train_file)], tokenizer, SEQ, val_sequences=3, seed=0, streaming=True,
                            val_specs=[str(val_file)], shuffle_buffer=0)
    assert [tuple(r.tolist()) for r in streamed.val] == first
    assert tuple(next(streamed.sequences(0)).tolist()) == tuple(reference_rows(paragraphs[:40], tokenizer)[0])
    with pytest.raises(ValueError, match="--val-data .* but --val-sequences is 999"):
        build_corpus([str(train_file)], tokenizer, SEQ, val_sequences=999, seed=0, val_specs=[str(val_file)])


def test_streaming_gives_the_same_sequences_and_resumes(tmp_path, tokenizer):
    data = write_jsonl_corpus(tmp_path / "c.jsonl", demo_corpus())
    rows = [list(r) for r in tokenize_and_pack(load_documents([str(data)]), tokenizer, SEQ)["input_ids"]]
    corpus = build_corpus([str(data)], tokenizer, SEQ, val_sequences=4, seed=0, streaming=True, shuffle_buffer=0)
    assert corpus.streaming and corpus.val.tolist() == rows[:4]
    train = rows[4:]
    stream = corpus.sequences(0)
    assert [next(stream).tolist() for _ in range(len(train) + 2)] == train + train[:2]  # file order, then again
    assert next(corpus.sequences(len(train) - 1)).tolist() == train[-1]
    batches = [corpus.micro_batches(10, 2, rank, 2) for rank in range(2)]
    assert torch.cat([next(b) for b in batches]).tolist() == train[10:14]

    shuffled = build_corpus([str(data)], tokenizer, SEQ, val_sequences=4, seed=0, streaming=True, shuffle_buffer=16)
    first = [next(shuffled.sequences(0)).tolist() for _ in range(2)]
    assert first[0] == first[1]  # seeded
    order = shuffled.sequences(0)
    epoch = [next(order).tolist() for _ in range(len(train))]
    assert sorted(epoch) == sorted(train) and epoch != train


def test_bad_data_fails_clearly(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="missing.jsonl: no such file"):
        build_corpus([str(tmp_path / "missing.jsonl")], tokenizer, SEQ, 4, 0)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty.jsonl is empty"):
        build_corpus([str(tmp_path / "empty.jsonl")], tokenizer, SEQ, 4, 0)
    (tmp_path / "short.jsonl").write_text(json.dumps({"text": "a few words only"}) + "\n")
    with pytest.raises(ValueError, match="only 0 packed sequences"):
        build_corpus([str(tmp_path / "short.jsonl")], tokenizer, SEQ, 0, 0, streaming=True)
    (tmp_path / "x.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        build_corpus([str(tmp_path / "x.csv")], tokenizer, SEQ, 4, 0)
    (tmp_path / "other.jsonl").write_text(json.dumps({"body": "hello"}) + "\n")
    with pytest.raises(ValueError, match="no 'text': pass --text-field"):
        build_corpus([str(tmp_path / "other.jsonl")], tokenizer, SEQ, 4, 0)
    with pytest.raises(ValueError, match="pass --text-field"):
        build_corpus([str(tmp_path / "other.jsonl")], tokenizer, SEQ, 4, 0, streaming=True)
