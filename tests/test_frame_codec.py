"""int8 flow-cache frames: the native codec (service.engine.native.FrameCodec) and numpy give the same bits, a cache
narrows and widens through whichever is there, and "auto" stores int8 only where the graph reads float16 caches."""

from __future__ import annotations

import numpy as np
import pytest

from service.engine import native
from service.layers import frame_cache
from service.layers.frame_cache import CachePrecision, FrameCache, stored_precision

needs_library = pytest.mark.skipif(native.frame_codec() is None, reason="native library not built (make native)")


def _frames(dtype: type[np.floating], blocks: int = 3, frames: int = 9, heads: int = 4, dim: int = 64) -> np.ndarray:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((blocks, 1, frames, heads, dim)) * rng.uniform(1e-3, 40, (blocks, 1, frames, heads, 1))
    x[0, 0, 0, 0] = 0.0  # a row of zeros: scale 1
    return x.astype(dtype)


def _filled(dtype: type[np.floating], new: np.ndarray) -> FrameCache:
    cache = FrameCache.empty(new.shape[0], new.shape[3], new.shape[4], dtype, 4, "int8")  # grows past 4 frames
    cache.append(new[:, :, :5])
    cache.append(new[:, :, 5:])
    return cache


@needs_library
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_native_codec_equals_numpy(dtype: type[np.floating], monkeypatch: pytest.MonkeyPatch) -> None:
    new = _frames(dtype)
    fast = _filled(dtype, new)
    monkeypatch.setattr(frame_cache.native, "frame_codec", lambda: None)
    slow = _filled(dtype, new)
    assert fast.scales is not None and slow.scales is not None
    np.testing.assert_array_equal(fast.buffer[:, : fast.frames], slow.buffer[:, : slow.frames])
    np.testing.assert_array_equal(fast.scales[:, : fast.frames], slow.scales[:, : slow.frames])
    wide_slow = [slow.view(b) for b in range(new.shape[0])]
    monkeypatch.undo()
    for b in range(new.shape[0]):
        wide = fast.view(b)
        assert wide.dtype == dtype and wide.shape == (1, 9, 4, 64)
        np.testing.assert_array_equal(wide.view(np.uint8), wide_slow[b].view(np.uint8))
        original = new[b, 0].astype(np.float32)
        rel = np.abs(wide[0].astype(np.float32) - original).max(axis=-1) / np.abs(original).max(axis=-1).clip(1e-30)
        assert rel.max() < 1 / 127 + 2e-3  # half a step of 127 per row, plus float16's own rounding


@pytest.mark.parametrize("codec", [True, False])
@pytest.mark.parametrize("precision", ["int8", "float16"])
def test_views_of_every_block_equal_each_block_alone(
    codec: bool, precision: CachePrecision, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy of a frozen cache (a voice's prompt state) reads its head's frames and then its own: `views` writes every
    block's out in one call (the codec or numpy) and gives what each block's frames are, head first."""
    if not codec:
        monkeypatch.setattr(frame_cache.native, "frame_codec", lambda: None)
    elif native.frame_codec() is None:
        pytest.skip("native library not built (make native)")
    new = _frames(np.float16, blocks=5, frames=11)
    prompt = FrameCache.empty(5, 4, 64, np.float16, 8, precision)
    prompt.append(new[:, :, :6])
    request = prompt.freeze().copy(20)
    request.append(new[:, :, 6:])
    views = request.views()
    assert len(views) == 5 and all(v.shape == (1, 11, 4, 64) and v.dtype == np.float16 for v in views)
    for b, view in enumerate(views):
        head = np.asarray(prompt.buffer[b, :6], dtype=np.float32)
        own = np.asarray(request.buffer[b, :5], dtype=np.float32)
        if precision == "int8":
            assert prompt.scales is not None and request.scales is not None
            head, own = head * prompt.scales[b, :6, :, None], own * request.scales[b, :5, :, None]
        expected = np.concatenate([head, own]).astype(np.float16)
        np.testing.assert_array_equal(view[0].view(np.uint16), expected.view(np.uint16))
        np.testing.assert_array_equal(request.view(b), view)


@needs_library
def test_codec_refuses_mismatched_arrays() -> None:
    codec = native.frame_codec()
    assert codec is not None
    x = np.zeros((2, 8), np.float16)
    with pytest.raises(ValueError):
        codec.narrow(x, np.zeros((2, 8), np.int8), np.zeros(3, np.float32))
    with pytest.raises(ValueError):
        codec.widen(np.zeros((2, 16), np.int8)[:, ::2], np.zeros(2, np.float32), np.zeros((2, 8), np.float16))
    with pytest.raises(ValueError):  # a block that is not contiguous
        strided = np.zeros((2, 3, 16), np.int8)[:, :, ::2]
        codec.widen_blocks(strided, np.zeros((2, 3), np.float32), np.zeros((2, 3, 8), np.float16))
    with pytest.raises(ValueError):  # scales that do not match the rows
        codec.widen_blocks(np.zeros((2, 3, 8), np.int8), np.zeros((2, 4), np.float32), np.zeros((2, 3, 8), np.float16))


def test_auto_precision_is_int8_only_for_float16_caches() -> None:
    assert stored_precision("auto", np.float16) == "int8"
    assert stored_precision("auto", np.float32) == "graph"  # an fp32 bundle: the official computation
    assert stored_precision("graph", np.float16) == "graph" and stored_precision("float16", np.float32) == "float16"


def test_a_graph_that_reads_int8_frames_takes_them_as_kept() -> None:
    """A native twin that reads int8 caches (export/native_twin.int8_block_caches) gets each block's int8 frames and
    scales: a cache's own in place (no copy per call), with a frozen head (a voice's prompt) one copy, head first."""
    new = _frames(np.float16, blocks=3, frames=10)
    prompt = FrameCache.empty(3, 4, 64, np.float16, 8, "int8", reads_int8=True)
    prompt.append(new[:, :, :4])
    own_frames, own_scales = prompt.feeds()
    assert len(own_frames) == len(own_scales) == 3
    assert own_frames[1].dtype == np.int8 and own_frames[1].shape == (1, 4, 4, 64) and own_scales[1].shape == (1, 4, 4)
    assert np.shares_memory(own_frames[1], prompt.buffer) and np.shares_memory(own_scales[1], prompt.scales)
    request = prompt.freeze().copy(20)
    request.append(new[:, :, 4:])
    frames, scales = request.feeds()
    assert request.scales is not None and prompt.scales is not None
    for b in range(3):
        np.testing.assert_array_equal(frames[b][0], np.concatenate([prompt.buffer[b, :4], request.buffer[b, :6]]))
        np.testing.assert_array_equal(scales[b][0], np.concatenate([prompt.scales[b, :4], request.scales[b, :6]]))
        widened = frames[b][0].astype(np.float32) * scales[b][0][..., None]  # the values a float16 graph would read
        np.testing.assert_allclose(widened, request.view(b)[0].astype(np.float32), rtol=1e-3, atol=1e-6)
    float_frames, no_scales = FrameCache.empty(3, 4, 64, np.float16, 8, "int8").feeds()
    assert no_scales == [] and float_frames[0].dtype == np.float16  # a float16 graph: widened, no scales


def test_int8_reading_graphs_store_int8() -> None:
    for asked in ("auto", "graph", "int8"):
        assert stored_precision(asked, np.float16, reads_int8=True) == "int8"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reads its caches in int8"):
        stored_precision("float16", np.float16, reads_int8=True)
    with pytest.raises(ValueError):
        FrameCache.empty(2, 4, 64, np.float16, 8, "float16", reads_int8=True)
