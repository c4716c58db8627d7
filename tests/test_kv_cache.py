"""What decoding costs (model/kv_cache.py, train/generate.py), measured by the tensors torch makes:
the prompt's pass and a sample's loss make no prompt x vocabulary logits (an 8k prompt and a 128k
vocabulary: 4 GiB in fp32); a generation's KV cache is allocated once and written in place, and a
decoding step copies no part of it (no concatenation, no grouped-query heads repeated); beyond
what was reserved the cache grows geometrically and still holds every token, as does a chat's
kept start. A windowed layer holds two windows however long the generation, and a windowed model
decodes as transformers' generate and as its full forward past its window, a chat's next turn too
(one going back past what the window kept runs again). Decoding's attention folds each key
head's query heads into its rows and is grouped-query attention, a masked call bounded in rows.
That the outputs are the full forward's and transformers' elsewhere is tests/test_generate.py's,
test_init_from.py's, test_longrope.py's and test_generate_placement.py's."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from test_generate import random_model
from tetrad.data.tokenizer import byte_tokenizer
from tetrad.model import kv_cache
from tetrad.model.kv_cache import LayerCache
from tetrad.model.sampling import GREEDY
from tetrad.train.generate import Cache, continuation_loss, generate, load_generator


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


def test_a_generation_keeps_no_steps_logits_unless_asked():
    """Each step's whole-vocabulary fp32 logits are freed once its token is drawn (kept, they are
    4 GiB for 8k tokens of a 128k vocabulary on the GPU); `keep_logits` keeps them for a caller
    that compares them."""
    import gc
    import weakref
    net, vocab = random_model(vocab_size=4096), 4096

    class Logits(TorchDispatchMode):  # a weak reference to every new fp32 tensor of one vocabulary
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.made += [weakref.ref(t) for t in pytree.tree_leaves(out)
                          if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() == vocab]
            return out

    for keep, alive in ((False, 0), (True, 6)):
        with Logits() as meter:
            new, logits = generate(net, list(range(40, 50)), 6, GREEDY, keep_logits=keep)
        gc.collect()
        assert len(new) == 6 and len(logits) == alive
        held = {ref().untyped_storage().data_ptr() for ref in meter.made if ref() is not None}
        assert len(held) == alive  # storages: a step's logits may be a view of its head's output


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


def test_a_windowed_model_and_a_chats_next_turn_decode_as_transformers_generate(tmp_path):
    """A Mistral with a window of 8 and grouped-query heads: a 20-token prompt (its pass masked by
    the window), 30 greedy tokens (each attending over the window's last keys), then a next turn
    that keeps the cache and runs 3 new prompt tokens after it (masked against the cached ones),
    each the tokens transformers' generate picks."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        sliding_window=8)
    torch.manual_seed(0)
    theirs = transformers.MistralForCausalLM(config).eval()
    with torch.no_grad():
        theirs.lm_head.weight.mul_(20)  # greedy picks far apart: no near-tie that rounding could flip
    theirs.save_pretrained(tmp_path / "hf", safe_serialization=True)
    byte_tokenizer().save(str(tmp_path / "hf" / "tokenizer.json"))
    ours, _, _ = load_generator(tmp_path / "hf")
    assert ours.cfg.sliding_window == 8
    cache, prompt = Cache(), list(range(100, 120))
    for max_new in (30, 20):
        new, _ = generate(ours, prompt, max_new, GREEDY, cache=cache)
        with torch.no_grad():
            expected = theirs.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new,
                                       eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert new == expected
        prompt = prompt + new + [5, 6, 7]
    assert cache.reused == 20 + 30 - 1


def test_a_chats_next_turn_allocates_what_it_reserved_not_twice_the_last_turns():
    """A next turn's reservation (its prompt and new tokens, within the context) is what its cache
    grows to: doubling the last turn's room (the growth without one) overshot it, here past the
    model's 64-token context (78 tokens of keys and values per layer; a long chat on a GPU holds
    twice its cache, three times while the old one is copied)."""
    net = random_model(seq_len=64)
    cache, prompt = Cache(), list(range(40, 70))
    new, _ = generate(net, prompt, 10, GREEDY, cache=cache)
    assert cache.layers["0"].k.shape[2] == 39
    prompt = prompt + new + [5, 6, 7]
    generate(net, prompt, 5, GREEDY, cache=cache)
    assert [layer.k.shape[2] for layer in cache.layers.values()] == [len(prompt) + 5 - 1] * len(cache.layers)


def test_a_window_layer_holds_two_windows_and_returns_the_keys_its_queries_see():
    """Token by token, a window of 8: the buffers never hold more than 16 tokens, each step returns
    the last 7 keys before the new token and the new one, in order, and a chat's next turn can go
    back a quarter window (2 tokens) at any point, not a whole window once tokens were forgotten."""
    layer, given = LayerCache(window=8), []
    generator = torch.Generator().manual_seed(0)
    for t in range(40):
        k = torch.randn(1, 1, 2, 16, generator=generator)
        given.append(k)
        keys, values = layer.extend(k, -k)
        expected = torch.cat(given[max(0, t - 7):], dim=1).transpose(1, 2)
        assert torch.equal(keys, expected) and torch.equal(values, -expected)
        assert layer.k.shape[2] <= 16 and layer.can_keep(t + 1 - 2)
    assert layer.start > 0 and not layer.can_keep(40 - 8)
    layer.keep(38)  # back two tokens: the next one sees the 7 before it
    more = torch.randn(1, 3, 2, 16, generator=generator)
    keys, _ = layer.extend(more, more)
    assert torch.equal(keys, torch.cat(given[31:38] + [more], dim=1).transpose(1, 2))
    layer.keep(0)
    keys, _ = layer.extend(more, more)
    assert torch.equal(keys, more.transpose(1, 2)) and layer.start == 0


def _full_forward_greedy(net, prompt: list[int], max_new: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            ids.append(int(net(torch.tensor([ids]), torch.arange(len(ids)))[0, -1].argmax()))
    return ids[len(prompt):]


def test_a_long_generation_holds_two_windows_in_each_local_layer_and_decodes_as_the_full_forward():
    """Gemma 3's layout, local (window 8) and global layers in turn: 60 tokens after a 12-token
    prompt are the full forward's greedy picks; the local layers' buffers hold 16 tokens, the global
    ones every token run (71). A next turn going back past what the local layers kept runs the
    conversation again (nothing reused) and decodes as a fresh cache; one going back a token reuses
    the rest."""
    net = random_model(n_layers=4, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
                       seq_len=128)
    with torch.no_grad():
        (net.embed.weight if net.head is None else net.head.weight).mul_(20)  # greedy picks far apart: no near-tie
    cache, prompt = Cache(), list(range(40, 52))
    new, _ = generate(net, prompt, 60, GREEDY, cache=cache)
    assert new == _full_forward_greedy(net, prompt, 60)
    assert [layer.k.shape[2] for layer in cache.layers.values()] == [16, 71, 16, 71]
    back = prompt + new[:30] + [5, 6, 7]
    again, _ = generate(net, back, 10, GREEDY, cache=cache)
    assert cache.reused == 0 and again == generate(net, back, 10, GREEDY)[0] == _full_forward_greedy(net, back, 10)
    one_back = back + again[:-2] + [9]
    generate(net, one_back, 5, GREEDY, cache=cache)
    assert cache.reused == len(back) + len(again) - 2


@pytest.mark.parametrize("rows,calls", [(1024, 1), (4, 5)])
def test_folded_heads_attend_as_grouped_query_attention_a_bounded_number_of_rows_a_call(monkeypatch, rows, calls):
    """Each key head's 3 query heads folded into its query rows, over a mask of each of 5
    positions and values of another width: SDPA's grouped-query attention's output; with
    FOLDED_ROWS 4 one position's 3 rows a call (5 calls), so a call's mask never holds more."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=generator) for shape in ((2, 5, 6, 8), (2, 2, 9, 8), (2, 2, 9, 12)))
    visible = torch.rand(2, 1, 5, 9, generator=generator) < 0.6
    visible[..., 0] = True  # every query sees a key
    expected = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=visible, enable_gqa=True)
    sdpa, masks = F.scaled_dot_product_attention, []
    monkeypatch.setattr(kv_cache, "FOLDED_ROWS", rows)
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: masks.append(kw["attn_mask"].shape) or sdpa(*a, **kw))
    out = kv_cache.folded_attention(q, k, v, visible)
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-6, rtol=1e-6)
    assert len(masks) == calls and max(shape[2] for shape in masks) <= rows
