"""Reading a tetrad checkpoint one part at a time (init_from.stored_weights, by which
checkpoint.init_from and `tetrad generate` fill each rank's shards): the folder's .metadata is
read once per reader, not once more for every tensor, and the parts read are the tensors'."""

from __future__ import annotations

import pytest
import torch

from tetrad.cli import main
from tetrad.train.checkpoint import SafeReader
from tetrad.train.convert import StoredWeights, logical_shapes
from tetrad.train.init_from import stored_weights


def test_a_checkpoints_metadata_is_read_once_for_all_its_tensors(tmp_path, monkeypatch):
    """Before: every tensor's read (a DCP load with a reader of its own) read .metadata again."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    names = list(logical_shapes(StoredWeights(tmp_path / "ckpt").cfg.model))
    reads, read_metadata = [], SafeReader.read_metadata

    def counted(self, *args, **kwargs):
        reads.append(self.path)
        return read_metadata(self, *args, **kwargs)
    monkeypatch.setattr(SafeReader, "read_metadata", counted)
    read = stored_weights(tmp_path / "ckpt")
    parts = {}
    for name in names:
        handle = read(name)
        rows = handle.shape[0] // 2
        rest = tuple(slice(0, n) for n in handle.shape[1:])
        parts[name] = (handle[(slice(0, rows), *rest)], handle[(slice(rows, handle.shape[0]), *rest)],
                       handle[(slice(0, handle.shape[0]), *rest)])  # each half, as a tp rank's rows, and the whole
    assert len(reads) == 1, f".metadata read {len(reads)} times for {len(names)} tensors"
    for name, (top, bottom, whole) in parts.items():
        assert torch.equal(torch.cat([top, bottom]), whole) and whole.abs().sum() > 0, name


def test_a_reader_pointed_at_another_checkpoint_reads_that_ones_metadata(tmp_path):
    """MetadataOnce keeps one folder's metadata: a DCP load given another checkpoint_id (reset)
    must not answer with the first folder's. Before: the first's, stale."""
    import torch.distributed.checkpoint as dcp
    from tetrad.train.checkpoint.store import one_process
    from tetrad.train.init_from import MetadataOnce
    for name, size in (("a", 2), ("b", 3)):
        with one_process():
            dcp.save({"x": torch.ones(size)}, checkpoint_id=tmp_path / name, no_dist=True)
    reader = MetadataOnce(tmp_path / "a")
    assert tuple(reader.read_metadata().state_dict_metadata["x"].size) == (2,)
    loaded = {"x": torch.zeros(3)}
    with one_process():
        dcp.load(loaded, storage_reader=reader, checkpoint_id=tmp_path / "b", no_dist=True)
    assert torch.equal(loaded["x"], torch.ones(3)) and tuple(reader.read_metadata().state_dict_metadata["x"].size) == (3,)
