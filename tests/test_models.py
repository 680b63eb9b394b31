"""Tests for the example model (engine.models.gpt) and its data (engine.models.data)."""

import math

import pytest
import torch

from engine.models import (
    GPT,
    GPTConfig,
    TokenBatches,
    default_corpus_bytes,
    gpt_from_preset,
    load_corpus,
)


def _tiny(seed=0, **overrides):
    torch.manual_seed(seed)
    return gpt_from_preset("tiny", **overrides)


def _random_batch(model, batch=4, seed=123):
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


# ----------------------------------------------------------------------- model
def test_initial_loss_near_uniform():
    model = _tiny()
    x, y = _random_batch(model)
    loss = model(x, labels=y)
    assert loss.dim() == 0
    assert torch.isfinite(loss)
    assert abs(loss.item() - math.log(256)) < 0.1, loss.item()


def test_logits_shape_without_labels():
    model = _tiny()
    x, _ = _random_batch(model, batch=3)
    logits = model(x)
    assert logits.shape == (3, model.config.block_size, 256)


def test_loss_ignores_minus_100_and_backprops():
    model = _tiny()
    x, y = _random_batch(model)
    y_masked = y.clone()
    y_masked[:, : y.shape[1] // 2] = -100
    loss_masked = model(x, labels=y_masked)
    # Matches a loss computed by hand over only the kept positions.
    logits = model(x)[:, y.shape[1] // 2 :]
    expected = torch.nn.functional.cross_entropy(
        logits.reshape(-1, 256), y[:, y.shape[1] // 2 :].reshape(-1)
    )
    torch.testing.assert_close(loss_masked, expected)
    loss_masked.backward()
    assert model.wte.weight.grad is not None
    assert all(p.grad is not None for p in model.parameters())


def test_causal_future_tokens_do_not_affect_past():
    model = _tiny().eval()
    x, _ = _random_batch(model, batch=1)
    x2 = x.clone()
    x2[0, -1] = (x2[0, -1] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(x2)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_weight_tying_shares_storage():
    model = _tiny()
    assert model.lm_head.weight is model.wte.weight
    assert model.lm_head.weight.data_ptr() == model.wte.weight.data_ptr()
    with torch.no_grad():
        model.wte.weight[0, 0] = 42.0
    assert model.lm_head.weight[0, 0].item() == 42.0
    # Counted once.
    untied = _tiny(tie_weights=False)
    assert untied.lm_head.weight is not untied.wte.weight
    assert untied.num_parameters() == model.num_parameters() + 256 * 64
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())


def test_same_seed_same_model_different_seed_different_model():
    a, b, c = _tiny(seed=7), _tiny(seed=7), _tiny(seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert not torch.equal(sa["wte.weight"], sc["wte.weight"])


def test_gpt2_style_init():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8, n_embd=256, n_head=4))
    block = model.blocks[0]
    assert torch.count_nonzero(block.attn.c_attn.bias) == 0
    assert torch.count_nonzero(block.mlp.c_fc.bias) == 0
    assert torch.all(block.ln_1.weight == 1)
    assert abs(block.attn.c_attn.weight.std().item() - 0.02) < 0.002
    proj_std = 0.02 / math.sqrt(2 * 8)
    assert abs(block.mlp.c_proj.weight.std().item() - proj_std) < 0.0005
    assert abs(block.attn.c_proj.weight.std().item() - proj_std) < 0.0005


def test_dropout_only_in_train_mode():
    model = _tiny(dropout=0.2)
    x, _ = _random_batch(model, batch=2)
    model.train()
    torch.manual_seed(1)
    a = model(x)
    torch.manual_seed(2)
    b = model(x)
    assert not torch.allclose(a, b)
    model.eval()
    with torch.no_grad():
        c, d = model(x), model(x)
    torch.testing.assert_close(c, d)
    # With dropout=0 the train-mode output is deterministic too.
    no_drop = _tiny(dropout=0.0).train()
    torch.testing.assert_close(no_drop(x), no_drop(x))


def test_presets_and_validation():
    assert gpt_from_preset("small").config == GPTConfig()
    n = gpt_from_preset("bench30m").num_parameters()
    assert 29_000_000 <= n <= 30_000_000, n
    assert gpt_from_preset("tiny", n_layer=3).config.n_layer == 3
    with pytest.raises(ValueError):
        gpt_from_preset("nope")
    with pytest.raises(TypeError):
        gpt_from_preset("tiny", not_a_field=1)
    with pytest.raises(ValueError):
        GPTConfig(n_embd=100, n_head=3)
    model = _tiny()
    with pytest.raises(ValueError):
        model(torch.zeros(1, model.config.block_size + 1, dtype=torch.long))


# ------------------------------------------------------------------------ data
@pytest.fixture(scope="module")
def corpus():
    return load_corpus(None, max_bytes=200_000)


def test_default_corpus_deterministic_and_nonempty():
    a = default_corpus_bytes(100_000)
    default_corpus_bytes.cache_clear()
    b = default_corpus_bytes(100_000)
    assert a == b
    assert len(a) == 100_000
    assert b"def " in a and b"import " in a
    big = default_corpus_bytes()
    assert len(big) > 1_000_000
    assert big[:100_000] == a  # a prefix of the same ordered walk


def test_load_corpus(tmp_path, corpus):
    assert corpus.dtype == torch.int64 and corpus.dim() == 1
    assert corpus.numel() == 200_000
    assert 0 <= corpus.min().item() and corpus.max().item() <= 255
    f = tmp_path / "tiny.txt"
    f.write_bytes(b"hello \xff world")
    t = load_corpus(str(f))
    assert t.tolist() == list(b"hello \xff world")
    missing = tmp_path / "missing.txt"
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        load_corpus(str(missing))


def test_labels_are_inputs_shifted_by_one(corpus):
    tb = TokenBatches(corpus, block_size=16, micro_batch_size=4, seed=0)
    batch = tb.next_batch()
    x, y = batch["input_ids"], batch["labels"]
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    # Each row is a contiguous window of the corpus.
    data = corpus.tolist()
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        full = row_x + row_y[-1:]
        starts = [i for i in range(len(data) - 16) if data[i : i + 17] == full]
        assert starts, "row is not a window of the corpus"


def test_ranks_together_equal_single_process(corpus):
    B, steps = 3, 5
    single = TokenBatches(corpus, block_size=16, micro_batch_size=2 * B, seed=11, world_size=1)
    ranks = [
        TokenBatches(corpus, block_size=16, micro_batch_size=B, seed=11, rank=r, world_size=2)
        for r in range(2)
    ]
    for _ in range(steps):
        s = single.next_batch()
        parts = [r.next_batch() for r in ranks]
        for key in ("input_ids", "labels"):
            assert torch.equal(torch.cat([p[key] for p in parts]), s[key])
        assert not torch.equal(parts[0]["input_ids"], parts[1]["input_ids"])


def test_seed_controls_stream_and_state_dict_resumes(corpus):
    a = TokenBatches(corpus, 16, 4, seed=1)
    b = TokenBatches(corpus, 16, 4, seed=1)
    c = TokenBatches(corpus, 16, 4, seed=2)
    first = next(iter(a))
    assert torch.equal(first["input_ids"], b.next_batch()["input_ids"])
    assert not torch.equal(first["input_ids"], c.next_batch()["input_ids"])
    state = a.state_dict()
    expected = [a.next_batch()["input_ids"] for _ in range(3)]
    d = TokenBatches(corpus, 16, 4, seed=1)
    d.load_state_dict(state)
    got = [d.next_batch()["input_ids"] for _ in range(3)]
    assert all(torch.equal(e, g) for e, g in zip(expected, got))


def test_val_split_disjoint_from_train():
    tokens = torch.arange(2000)  # token value == position
    n_val = int(2000 * 0.05)
    train = TokenBatches(tokens, block_size=8, micro_batch_size=64, seed=0, split="train")
    val = TokenBatches(tokens, block_size=8, micro_batch_size=64, seed=0, split="val")
    train_seen, val_seen = set(), set()
    for _ in range(50):
        for tb, seen in ((train, train_seen), (val, val_seen)):
            b = tb.next_batch()
            seen.update(b["input_ids"].flatten().tolist())
            seen.update(b["labels"].flatten().tolist())
    assert train_seen.isdisjoint(val_seen)
    assert max(train_seen) < 2000 - n_val <= min(val_seen)
    assert max(val_seen) == 1999  # the val split is actually sampled to its end


def test_token_batches_validation(corpus):
    with pytest.raises(ValueError):
        TokenBatches(corpus, 16, 4, rank=2, world_size=2)
    with pytest.raises(ValueError):
        TokenBatches(corpus, 16, 4, split="test")
    with pytest.raises(ValueError):
        TokenBatches(torch.arange(100), block_size=16, micro_batch_size=1, split="val")
