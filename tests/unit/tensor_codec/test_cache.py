"""qualify.tensor_codec.cache: what a coded case's reads keep between them lies in the DecodeCache its caller opened,
shared with no other, bounded as before, and dropped when the caller's block ends."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from qualify.store import TensorFile
from qualify.tensor_codec import DecodeCache, decoding, open_cache
from qualify.tensor_codec.decode import _fell_back
from tests.unit.tensor_codec.test_decode import adamw_steps, same_bits, write_case


def read_case(case, num_steps: int) -> dict:
    """Every logical tensor of a coded case's updates and moments, by (step, group, name)."""
    out = {}
    for k in range(num_steps):
        for group in ("updates", "moments"):
            f = TensorFile(case / f"step{k}" / f"{group}.safetensors")
            out |= {(k, group, n): f[n] for n in f}
    return out


def test_two_scopes_share_no_decoded_tensor_and_closing_one_drops_its_own(tmp_path):
    """A case read in one block keeps its decoded moments and new parameters in that block's cache; a second block
    opened beside it starts empty and decodes again (the same bits); the end of a block drops what it held, and no
    cache is open outside the blocks."""
    model, records, starts, final = adamw_steps(tmp_path, steps=2)
    write_case(tmp_path / "case", model, records, starts, final)
    with decoding() as first:
        assert open_cache() is first
        read = read_case(tmp_path / "case", 2)
        kept = first.held("cpu")
        assert kept > 0 and first.held() == kept
        with decoding() as second:
            assert open_cache() is second and second.held() == 0
            again = read_case(tmp_path / "case", 2)
            assert second.held() == kept  # decoded again, into its own cache
        assert second.held() == 0 and first.held() == kept  # the inner block's end dropped its own alone
        assert open_cache() is first
    assert first.held() == 0 and open_cache() is None
    assert read.keys() == again.keys() and all(same_bits(read[k], again[k]) for k in read)
    for k, step in enumerate(records):
        assert all(same_bits(read[(k, "moments", n)], t) for n, t in step["moments"].items())
        assert all(same_bits(read[(k, "updates", n)], t) for n, t in step["updates"].items())


def test_a_read_outside_any_scope_keeps_nothing_after_it(tmp_path):
    """Without a block, a read decodes its chain in a cache of its own (the same bits) and none stays open."""
    model, records, starts, final = adamw_steps(tmp_path, steps=2)
    write_case(tmp_path / "case", model, records, starts, final)
    read = read_case(tmp_path / "case", 2)
    assert open_cache() is None
    assert all(same_bits(read[(1, "updates", n)], t) for n, t in records[1]["updates"].items())


def test_a_given_cache_is_left_to_its_owner(tmp_path):
    """decoding(cache) reads into a cache its caller made and closes: the block's end keeps it; close() drops it."""
    model, records, starts, final = adamw_steps(tmp_path, steps=1)
    write_case(tmp_path / "case", model, records, starts, final)
    owned = DecodeCache()
    with decoding(owned):
        read_case(tmp_path / "case", 1)
    assert owned.held() > 0
    with owned:
        pass
    assert owned.held() == 0


def test_release_drops_one_device_and_the_oldest_go_first(monkeypatch):
    """release(device) drops that device's tensors alone; a device's held bytes stay within DECODED_BYTES, the least
    recently used dropped first, and a tensor over a quarter of it is never kept."""
    from qualify.tensor_codec import cache as cache_module

    monkeypatch.setattr(cache_module, "DECODED_BYTES", 4000)
    computed = []

    def value(n: int, device: str):
        def compute():
            computed.append((n, device))
            return torch.zeros(250, device=device)  # 1000 bytes
        return compute

    path = Path(__file__)  # a file the keys name (its path, time and size)
    cache = DecodeCache()
    for n in range(4):
        for device in ("cpu", "meta"):
            cache.cached(path, "moment", str(n), torch.device(device), value(n, device))
    assert cache.held("cpu") == cache.held("meta") == 4000
    cache.cached(path, "moment", "0", torch.device("cpu"), value(0, "cpu"))  # used again: now the newest
    cache.cached(path, "moment", "4", torch.device("cpu"), value(4, "cpu"))  # drops "1", the oldest
    assert cache.held("cpu") == 4000
    computed.clear()
    cache.cached(path, "moment", "0", torch.device("cpu"), value(0, "cpu"))
    cache.cached(path, "moment", "1", torch.device("cpu"), value(1, "cpu"))
    assert computed == [(1, "cpu")]
    cache.cached(path, "moment", "big", torch.device("cpu"), lambda: torch.zeros(251))  # 1004 > 4000 // 4
    assert cache.held("cpu") == 4000
    cache.release("cpu")
    assert cache.held("cpu") == 0 and cache.held("meta") == 4000
    cache.close()
    assert cache.held() == 0


def test_a_fallback_is_noted_in_its_scope_and_warned_once_there():
    """A tensor a GPU decoded otherwise than its check is noted in the cache it was read into, with one warning per
    cache: a second cache warns again and notes its own."""
    first, second = DecodeCache(), DecodeCache()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in ("a", "b"):
            _fell_back(first, name, torch.zeros(2), torch.device("cpu"))
        _fell_back(second, "c", torch.zeros(2), torch.device("cpu"))
    assert first.fell_back == ["a", "b"] and second.fell_back == ["c"]
    assert [str(w.message).split(":")[0] for w in caught] == ["a", "c"]
    assert "decoded on the CPU instead" in str(caught[0].message)
