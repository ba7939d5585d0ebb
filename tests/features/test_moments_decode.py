"""A long file's moments decoded in one pass (one open, time order, through keyframes instead of seeking):
the same frames as each moment decoded alone, and the file opened once across calls."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tvrpipe.bench.moments import long_video
from tvrpipe.features.collection import Cutting
from tvrpipe.features.decode import DecodeFailure, decode_video, readers
from tvrpipe.features.decode.readers import OpenFile, decode_moments, read_order

S = 112


@pytest.mark.parametrize("frames, position, want", [
    ([2, 9, 30], 0, [2, 7, 9, 30]),  # 9: the next group, read through its keyframe; 30: two groups on, sought
    ([7, 8, 9], 0, [7, 8, 9]),  # 7 is the last frame before the keyframe: decord decodes on from it
    ([3, 9], 5, [3, 7, 9]),  # 3 is behind where decord stands: sought; then on through keyframe 8
    ([12, 20], 10, [12, 15, 20]),
    ([17], 3, [17]),  # two groups on
    ([9], 7, [7, 9]),  # decord stands at 7, the frame before the keyframe: asked for it, it decodes on from it
])
def test_read_order_decodes_through_the_next_keyframe_and_seeks_further(frames, position, want):
    assert read_order(np.array(frames), np.array([0, 8, 16, 24, 32]), position).tolist() == want


def test_read_order_without_keyframes_is_the_frames():
    assert read_order(np.array([3, 40]), np.zeros(0, np.int64), 0).tolist() == [3, 40]


@pytest.fixture(scope="module")
def long_file(tmp_path_factory) -> Path:
    # 8 fps, a keyframe every 8 frames, B-frames (x264's default), every frame different
    return long_video(tmp_path_factory.mktemp("moments") / "long.mp4", 40.0)


def test_moments_in_one_pass_are_each_moment_alone_and_open_the_file_once(long_file, monkeypatch):
    bounds = Cutting(3.0, 2.0).bounds(40.0)  # 20 moments, 12 frames of 24: sampled closer than a keyframe apart
    opens = []
    real = readers._decord_reader
    monkeypatch.setattr(readers, "_decord_reader", lambda *a: opens.append(a) or real(*a))
    reader = OpenFile()
    together = []
    for a in range(0, len(bounds), 6):  # calls of 6 in time order, as a decoder process gets them
        together += decode_moments(long_file, 12, S, bounds[a:a + 6], reader)
    assert len(opens) == 1 and reader.position > 300  # one open, then on to the last sampled frame
    # a call behind where the reader stands seeks back; the frames are still each moment's own
    again = decode_moments(long_file, 12, S, [bounds[1], bounds[0]], reader)
    assert len(opens) == 1
    monkeypatch.undo()
    for (start, end), got in zip([*bounds, bounds[1], bounds[0]], [*together, *again]):
        alone = decode_video(long_file, 12, S, start, end)
        assert got.reader == alone.reader == "decord"
        np.testing.assert_array_equal(got.frames, alone.frames)
        np.testing.assert_array_equal(got.mask, alone.mask)
        np.testing.assert_array_equal(got.timestamps, alone.timestamps)
    assert [round(float(v.timestamps[0]), 3) for v in together[:3]] == [0.125, 2.125, 4.125]
    assert int(together[-1].mask.sum()) == 12


def test_a_changed_file_is_opened_again(tmp_path, monkeypatch):
    path = long_video(tmp_path / "a.mp4", 6.0)
    reader = OpenFile()
    first = decode_moments(path, 4, S, [(0.0, 3.0)], reader)[0]
    long_video(tmp_path / "b.mp4", 9.0, fps=10).replace(path)  # another file under the same name
    opens = []
    real = readers._decord_reader
    monkeypatch.setattr(readers, "_decord_reader", lambda *a: opens.append(a) or real(*a))
    second = decode_moments(path, 4, S, [(0.0, 3.0), (7.0, 9.0)], reader)
    assert len(opens) == 1 and len(reader.times) == 90
    assert not np.array_equal(first.frames, second[0].frames)
    np.testing.assert_array_equal(second[1].frames, decode_video(path, 4, S, 7.0, 9.0).frames)


def test_a_failed_call_closes_the_file_and_decodes_each_moment_alone(long_file, monkeypatch):
    reader = OpenFile()
    decode_moments(long_file, 12, S, [(0.0, 3.0)], reader)

    def broken(*args, **kwargs):
        raise RuntimeError("a frame that does not decode")

    monkeypatch.setattr(OpenFile, "read", broken)
    got = decode_moments(long_file, 12, S, [(4.0, 6.0), (50.0, 60.0)], reader)
    assert reader.vr is None and reader.position == 0
    np.testing.assert_array_equal(got[0].frames, decode_video(long_file, 12, S, 4.0, 6.0).frames)
    assert isinstance(got[1], DecodeFailure) and got[1].kind == "no_frames"


def test_the_decoder_process_decodes_on_across_calls(long_file):
    """The decoder process keeps the file open between moments calls, and closes it for another request: every
    moment still gets its own frames."""
    from tvrpipe.features.decode import DecodeWorker

    bounds = Cutting(3.0, 2.0).bounds(40.0)
    with DecodeWorker(30) as w:
        got = w.decode_moments(long_file, 12, S, bounds[:8]) + w.decode_moments(long_file, 12, S, bounds[8:14])
        whole = w.decode(long_file, 12, S)
        got += w.decode_moments(long_file, 12, S, bounds[14:])
    np.testing.assert_array_equal(whole.frames, decode_video(long_file, 12, S).frames)
    assert len(got) == len(bounds) == 20
    for (start, end), v in zip(bounds, got):
        np.testing.assert_array_equal(v.frames, decode_video(long_file, 12, S, start, end).frames)
