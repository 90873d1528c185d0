"""Tokenizers for training (lossless, storable) and the data streams (deterministic, contiguous,
every evaluation target scored exactly once)."""

from __future__ import annotations

import numpy as np
from train_helpers import GENESIS

from hkserve.checkpoint.tokenizer import Tokenizer
from hkserve.cli.main import main as hkserve_main
from hkserve.train.config import DataConfig
from hkserve.train.data import TrainStream, encode, eval_sequences, read_splits
from hkserve.train.vocab import BOS_ID, byte_tokenizer, sentencepiece_tokenizer, token_byte_lengths

ODD = "  two  spaces,\ttab, naïve café — 日本語\n\nend "  # whitespace runs and non-ASCII must survive


def _bytes_of_ids(tokenizer: Tokenizer, ids) -> int:
    return int(token_byte_lengths(tokenizer)[np.asarray(ids)].sum())


def test_byte_tokenizer_is_utf8_and_lossless(tmp_path):
    tok = byte_tokenizer()
    assert tok.vocab_size == 259
    ids = tok.encode(ODD, add_bos=False)
    assert ids == [b + 3 for b in ODD.encode()]
    assert tok.decode(ids) == ODD and _bytes_of_ids(tok, ids) == len(ODD.encode())
    tok.save(tmp_path / "tok")  # the store's format: reloads as the same tokenizer
    again = Tokenizer.load(tmp_path / "tok")
    assert again.encode(ODD) == [BOS_ID] + ids and again.decode(again.encode(ODD)) == ODD


def test_train_vocab_writes_a_lossless_sentencepiece_model(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(GENESIS * 3)
    assert (
        hkserve_main(
            ["train-vocab", "--input", str(corpus), "--vocab-size", "400", "--output", str(tmp_path / "vocab")]
        )
        == 0
    )
    assert "400 pieces" in capsys.readouterr().out
    tok = sentencepiece_tokenizer(tmp_path / "vocab.model")
    for text in (GENESIS, ODD):
        ids = tok.encode(text, add_bos=False)
        assert tok.decode(ids) == text
        assert _bytes_of_ids(tok, ids) == len(text.encode())
    assert len(tok.encode(GENESIS, add_bos=False)) < 0.6 * len(GENESIS)  # it learned merges
    tok.save(tmp_path / "tok")
    assert Tokenizer.load(tmp_path / "tok").encode(GENESIS) == tok.encode(GENESIS)


def test_train_vocab_reports_an_impossible_size(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(GENESIS)
    assert (
        hkserve_main(["train-vocab", "--input", str(corpus), "--vocab-size", "100000", "--output", str(tmp_path / "v")])
        == 1
    )
    assert "Vocabulary size too high" in capsys.readouterr().err


def test_one_text_is_split_at_line_ends(tmp_path):
    (tmp_path / "all.txt").write_text(GENESIS * 4)
    data = DataConfig(text=tmp_path / "all.txt", split={"train": 0.8, "validation": 0.1, "test": 0.1})
    splits = read_splits(data)
    assert "".join(splits[s] for s in ("train", "validation", "test")) == GENESIS * 4
    assert all(text.endswith("\n") for text in splits.values())


def test_training_batches_are_a_function_of_seed_and_step():
    ids = np.arange(10_000, dtype=np.int32)  # id = position: contiguity is visible in the values
    stream = TrainStream(ids, batch=4, sequence_len=64, update_len=16, seed=3)
    again = TrainStream(ids, batch=4, sequence_len=64, update_len=16, seed=3)
    for step in (0, 5, 400, 37):
        a, b = stream.batch_at(step), again.batch_at(step)
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(stream.batch_at(4).inputs, TrainStream(ids, 4, 64, 16, seed=4).batch_at(4).inputs)
    for step in range(8):
        batch = stream.batch_at(step)
        np.testing.assert_array_equal(batch.targets, batch.inputs + 1)  # next-token targets
        assert np.all(np.diff(batch.inputs[:, 0]) == len(ids) // 4)  # row r reads the r-th quarter
        if not stream.starts_sequence(step):  # the chunk continues the previous one of its window
            np.testing.assert_array_equal(batch.inputs[:, 0], stream.batch_at(step - 1).inputs[:, -1] + 1)
    assert [stream.starts_sequence(s) for s in range(6)] == [True, False, False, False, True, False]
    windows = {stream.window(s * 4) for s in range(stream.windows)}  # one epoch visits every window once
    assert windows == set(range(stream.windows))


def test_evaluation_scores_every_token_once():
    tok = byte_tokenizer()
    ids = encode(tok, GENESIS)
    assert ids[0] == BOS_ID
    targets, inputs = [], []
    for chunks in eval_sequences(ids, batch=3, sequence_len=64, update_len=16):
        # chunks of one group: [3, 16] each; rows are sequences, so read row by row
        rows_t = np.concatenate([c.targets for c in chunks], axis=1)
        rows_m = np.concatenate([c.mask for c in chunks], axis=1)
        rows_i = np.concatenate([c.inputs for c in chunks], axis=1)
        targets += [t[m > 0] for t, m in zip(rows_t, rows_m)]
        inputs += [i[m > 0] for i, m in zip(rows_i, rows_m)]
    np.testing.assert_array_equal(np.concatenate(targets), ids[1:])
    np.testing.assert_array_equal(np.concatenate(inputs), ids[:-1])
    scored = sum(len(t) for t in targets)
    assert _bytes_of_ids(tok, np.concatenate(targets)) == len(GENESIS.encode()) == scored
