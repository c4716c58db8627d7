"""Data inputs are checked before any rank starts (issue 19): each bad input is refused with one
line and exit status 2, and nothing is spawned (a spawned rank would print a traceback)."""

import pickle

import numpy as np
import pytest

from conftest import sft_shards, tiny_config
from tetrad.cli import main
from tetrad.config import ConfigError
from tetrad.data.checks import check_data
from tetrad.data.sources import TokenStream
from tetrad.train.batches import Batches


def _npy(path, array, allow_pickle=False):
    np.save(path, array, allow_pickle=allow_pickle)
    return path


def bad_inputs(tmp):
    (tmp / "no_txt").mkdir()
    (tmp / "no_txt" / "notes.md").write_text("text, but not .txt")
    (tmp / "empty.txt").write_text("")
    (tmp / "short.txt").write_text("too short")
    (tmp / "odd.bin").write_bytes(b"\x01\x00\x02")
    (tmp / "pickled.npy").write_bytes(b"\x93NUMPY" + pickle.dumps(["not", "an", "array"]))
    ids = np.arange(4000) % 200
    (ids + 1000).astype(np.int32).tofile(tmp / "megatron_text_document.bin")  # Megatron-LM's, int32 by its .idx
    (tmp / "megatron_text_document.idx").write_bytes(b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([4]))
    return {
        "missing": ([f"--data.source={tmp / 'nothing.bin'}"], "neither a built-in corpus"),
        "unknown": (["--data.source=shakespeare"], "neither a built-in corpus"),
        "unweighted_blend": ([f"--data.source={tmp / 'short.txt'} licenses"],
                             f"a blend gives each source a weight: '1 {tmp / 'short.txt'} 1 licenses'"),
        "empty": ([f"--data.source={tmp / 'empty.txt'}"], "empty file"),
        "short": ([f"--data.source={tmp / 'short.txt'}"], "fewer than model.seq_len+2"),
        "no_txt": ([f"--data.source={tmp / 'no_txt'}"], "without .txt"),
        "odd_bin": ([f"--data.source={tmp / 'odd.bin'}"], "odd size"),
        "float": ([f"--data.source={_npy(tmp / 'f.npy', ids.astype(np.float32))}"], "float32"),
        "2d": ([f"--data.source={_npy(tmp / 'm.npy', ids.reshape(40, 100).astype(np.int32))}"], "shape (40, 100)"),
        "object": ([f"--data.source={_npy(tmp / 'o.npy', np.array([1, 'a'], dtype=object), True)}"], "not a plain"),
        "pickled": ([f"--data.source={tmp / 'pickled.npy'}"], "not a plain"),
        "too_large": ([f"--data.source={_npy(tmp / 'big.npy', (ids + 100).astype(np.uint16))}"], "token id 299"),
        "negative_tp2": ([f"--data.source={_npy(tmp / 'neg.npy', np.where(ids == 7, -3, ids).astype(np.int32))}",
                          "--parallel.tp=2"], "token id -3"),
        # each int32 id read as two uint16s, all in range: the run trained on noise
        "megatron_int32": ([f"--data.source={tmp / 'megatron_text_document.bin'}", "--model.vocab_size=128256",
                            "--train.steps=1"],
                           "is a Megatron-LM dataset of int32 tokens (its .idx says), and tetrad reads a .bin as uint16"),
        "megatron_prefix": ([f"--data.source={tmp / 'megatron_text_document'}"],
                            f"for Megatron-LM's prefix, give the file: {tmp / 'megatron_text_document.bin'}"),
        "val_too_short": (["--data.val_fraction=0.00001"], "validation tokens hold"),
        "missing_val": ([f"--data.val_source={tmp / 'val.bin'}"], "data.val_source="),
    }


def test_each_bad_data_input_is_refused_before_spawn_in_one_line(tmp_path, capsys):
    for name, (argv, expected) in bad_inputs(tmp_path).items():
        assert main(["train", *argv, f"--run.dir={tmp_path / 'run'}"]) == 2, name
        err = capsys.readouterr().err.strip()
        assert err.startswith("tetrad: config error: ") and "\n" not in err, (name, err)
        assert expected in err, (name, err)
    assert not (tmp_path / "run").exists()  # no rank started


def test_good_token_files_pass_and_a_bad_id_past_the_sample_stops_the_batches(tmp_path):
    good = _npy(tmp_path / "ids.npy", (np.arange(4000) % 256).astype(np.uint32))
    check_data(tiny_config(data={"source": str(good), "val_fraction": 0.1}))
    (tmp_path / "ids.bin").write_bytes((np.arange(4000) % 256).astype(np.uint16).tobytes())
    check_data(tiny_config(data={"source": str(tmp_path / "ids.bin")}))
    (tmp_path / "ids.idx").write_bytes(b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([8]))
    check_data(tiny_config(data={"source": str(tmp_path / "ids.bin")}))  # a Megatron-LM dataset of uint16: raw
    tokens = np.zeros(100, dtype=np.int64)
    tokens[:] = -1
    with pytest.raises(ValueError, match="token id -1"):
        Batches([(1, TokenStream([tokens]))], seq_len=8, global_batch=2, seed=0, vocab_size=256).global_batch_at(0)


def test_a_source_too_short_names_the_val_fraction_change_that_lengthens_it(tmp_path):
    """data.val_fraction moves tokens from training to validation: too few training tokens call
    for a smaller one, too few held-out tokens for a larger one; a shorter seq_len does not help
    packed fine-tuning examples, which need one example only."""
    text = tmp_path / "short.txt"
    text.write_bytes(bytes(range(40, 100)))  # 60 tokens, read as bytes
    for fraction, expected in ((0.5, "data.source holds 30 tokens, fewer than model.seq_len+2 = 34; use more data, or "
                                     "a shorter seq_len, or a smaller data.val_fraction (now 0.5)"),
                               (0.1, "the validation tokens hold 6 tokens, fewer than model.seq_len+2 = 34; use more "
                                     "data, or a shorter seq_len, or a larger data.val_fraction (now 0.1)")):
        with pytest.raises(ConfigError) as e:
            check_data(tiny_config(data={"source": str(text), "val_fraction": fraction}))
        assert str(e.value) == expected
    with pytest.raises(ConfigError) as e:
        check_data(tiny_config(data={"source": sft_shards(), "val_fraction": 1e-6}))
    assert str(e.value) == ("the validation tokens hold 0 tokens, fewer than two tokens (one example); use more "
                            "data, or a larger data.val_fraction (now 1e-06)")
