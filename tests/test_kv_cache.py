"""What decoding costs (model/kv_cache.py, train/generate.py), measured by the tensors torch makes:
the prompt's pass and a sample's loss make no prompt x vocabulary logits (an 8k prompt and a 128k
vocabulary: 4 GiB in fp32); a generation's KV cache is allocated once and written in place, and a
decoding step copies no part of it (no concatenation, no grouped-query heads repeated); beyond
what was reserved the cache grows geometrically and still holds every token, as does a chat's
kept start. That the outputs stay those of the full forward and of transformers' generate is
tests/test_generate.py's, test_init_from.py's, test_longrope.py's and test_generate_placement.py's."""

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from test_generate import random_model
from tetrad.model.kv_cache import LayerCache
from tetrad.model.sampling import GREEDY
from tetrad.train.generate import Cache, continuation_loss, generate


class NewTensors(TorchDispatchMode):
    """Records (bytes, op, dtype) of every tensor an op makes: a storage none of its inputs has
    (not a view, not an in-place result)."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[int, str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.made += [(t.untyped_storage().nbytes(), str(func), t.dtype) for t in pytree.tree_leaves(out)
                      if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given]
        return out


def test_the_prompts_pass_and_the_loss_make_no_logits_of_the_prompts_positions():
    """A 30-token prompt, a vocabulary of 4096: the logits of every prompt position would be
    30 x 4096 floats; sampling reads the last position's, the loss the continuation's."""
    net = random_model(vocab_size=4096)
    prompt, vocab = list(range(40, 70)), 4096
    with NewTensors() as meter:
        new, _ = generate(net, prompt, 2, GREEDY)
        continuation_loss(net, prompt, new)
    largest = max(meter.made)
    assert largest[0] <= 2 * vocab * 4, largest  # the continuation's two positions at most (was 30)


def test_a_generations_cache_is_allocated_once_and_a_step_copies_none_of_it():
    """Reserved for the prompt and the new tokens (generate reserves them), each layer's keys and
    values stay in one storage for the whole generation; a step makes no tensor as large as one
    layer's keys of the tokens so far (a concatenation did, and the grouped-query heads' repeat: 4
    query heads a key), nor a mask (a new token sees every key)."""
    net = random_model(n_heads=8, n_kv_heads=2, seq_len=64)
    cache, prompt = Cache(), list(range(40, 60))
    cache.reserve(net, 30)
    with torch.no_grad():
        cache.feed(net, prompt)
    storages = {name: (layer.k.untyped_storage().data_ptr(), layer.v.untyped_storage().data_ptr())
                for name, layer in cache.layers.items()}
    keys = cache.layers["0"].k[:, :, :len(prompt)]  # one layer's keys of the prompt: [1, 2, 20, 8]
    with torch.no_grad(), NewTensors() as meter:
        for token in range(10):
            cache.feed(net, [token])
    assert max(meter.made)[0] < keys.numel() * keys.element_size(), max(meter.made)
    assert not [made for made in meter.made if made[2] == torch.bool]
    assert {name: (layer.k.untyped_storage().data_ptr(), layer.v.untyped_storage().data_ptr())
            for name, layer in cache.layers.items()} == storages
    assert cache.layers["0"].k.untyped_storage().nbytes() == 30 * keys[:, :, 0].numel() * 4  # room for 30 tokens
    cache = Cache()
    generate(net, prompt, 10, GREEDY, cache=cache)
    assert cache.layers["0"].k.shape[2] == len(prompt) + 10 - 1  # the last token drawn is never run


def test_beyond_what_was_reserved_the_cache_grows_geometrically_and_keeps_every_token():
    """Token by token without a reservation the storage is made 7 times in 40 tokens (room for 1,
    2, 4, ..., 64 tokens), and the keys and values returned are all those given, in order; a
    chat's kept start holds its tokens, and the next ones follow it."""
    layer, given, storages = LayerCache(), [], []
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):
        k = torch.randn(1, 1, 2, 16, generator=generator)
        given.append(k)
        keys, values = layer.extend(k, -k)
        if not storages or storages[-1] != keys.data_ptr():  # a new storage (the old one is alive as it is made)
            storages.append(keys.data_ptr())
    expected = torch.cat(given, dim=1).transpose(1, 2)
    assert torch.equal(keys, expected) and torch.equal(values, -expected)
    assert len(storages) == 7 and layer.k.shape[2] == 64
    layer.keep(25)
    more = torch.randn(1, 3, 2, 16, generator=generator)
    keys, _ = layer.extend(more, more)
    assert torch.equal(keys, torch.cat([expected[:, :, :25], more.transpose(1, 2)], dim=2))
