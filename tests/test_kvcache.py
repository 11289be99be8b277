"""The growing KV cache gives the logits of a full forward through growth, crops, dropped and joining rows."""

import torch
from conftest import tiny_llama

from engine import kvcache
from engine.runner import cache_argument


def test_growing_cache_matches_a_full_forward(monkeypatch):
    monkeypatch.setattr(kvcache, "MIN_CAPACITY", 4)  # grow many times within a short sequence
    model = tiny_llama(3, layers=2)
    tokens = torch.randint(0, 64, (4, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full = model(tokens, use_cache=False).logits
        cache = kvcache.GrowingCache(model.config)

        def feed(ids):
            return model(ids, **{cache_argument(model): cache}, use_cache=True).logits

        feed(tokens[:, :5])
        at = 5
        for width in (1, 3, 2, 7, 1, 4):
            wrong = (tokens[:, at:at + 3] + 1) % 64  # a rejected draft: fed, then cropped
            feed(wrong)
            cache.crop(-3)
            logits = feed(tokens[:, at:at + width])
            torch.testing.assert_close(logits, full[:, at:at + width], rtol=1e-4, atol=1e-4)
            at += width
        assert cache.get_seq_length() == at
        assert cache.layers[0]._keys.shape[-2] >= at > 4  # it grew past its first capacity

        # Row 1 finishes and the last row takes its place (as BatchRun fills holes); then the two swap.
        for rows in ([0, 3, 2], [1, 0]):
            cache.batch_select_indices(torch.tensor(rows))
            tokens, full = tokens[rows], full[rows]
            torch.testing.assert_close(feed(tokens[:, at:at + 3]), full[:, at:at + 3], rtol=1e-4, atol=1e-4)
            at += 3

        # Two requests join, into the buffers' rows that left: no new buffer, and every row decodes on.
        joining = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
        joined = kvcache.GrowingCache(model.config)
        model(joining[:, :at], **{cache_argument(model): joined}, use_cache=True)
        buffer = cache.layers[0]._keys.data_ptr()
        for mine, theirs in zip(cache.layers, joined.layers, strict=True):
            mine.append_rows(theirs)
        assert cache.layers[0]._keys.data_ptr() == buffer
        tokens = torch.cat([tokens, joining])
        full = torch.cat([full, model(joining, use_cache=False).logits])
        torch.testing.assert_close(feed(tokens[:, at:at + 3]), full[:, at:at + 3], rtol=1e-4, atol=1e-4)
