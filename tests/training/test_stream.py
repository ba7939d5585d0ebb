"""train-head on a store larger than its memory budget: the plan, the streamed epochs, the splits read on use,
rows read in place, and a streamed run against the same run in memory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from tvrpipe.errors import ConfigError
from tvrpipe.files import gb


@pytest.fixture(scope="module")
def opened(store):
    from tvrpipe.features.store import open_store
    from tvrpipe.training.data import store_split_rows

    s = open_store(store)
    return s, store_split_rows(s)


def reserve(s, rows, tokens: bool, method: str | None = None) -> int:
    """What a plan keeps out of the buffer's share of the budget: one evaluation and the store's tables (with
    ``method``: its head's embeddings, as train-head measures them)."""
    from tvrpipe.heads.base import create_head
    from tvrpipe.training.stream import plan_data

    head = create_head(method, embed_dim=int(s.provenance["embed_dim"])) if method else None
    plan = plan_data(s, rows, tokens, 1, budget=10**12, head=head)
    return plan.evaluation + plan.tables


def run_reserve(store, method: str) -> int:
    """:func:`reserve` of a train-head run of ``method`` on ``store``."""
    from tvrpipe.features.store import open_store
    from tvrpipe.heads.base import head_class
    from tvrpipe.training.data import store_split_rows

    s = open_store(store)
    return reserve(s, store_split_rows(s), head_class(method).uses_tokens, method)


def test_rows_read_in_place_equal_zarr_reads(tmp_path):
    """Raw chunk reads (the store's uncompressed chunks) give what Zarr gives, for any rows, repeats and widths,
    including the last, partial chunk; a compressed array is read through Zarr."""
    import zarr

    from tvrpipe.features.arrays import raw_chunks, read_rows

    g = zarr.open_group(tmp_path, mode="w", zarr_format=3)
    values = np.random.default_rng(0).standard_normal((203, 5, 3)).astype(np.float16)
    raw = g.create_array("raw", shape=values.shape, chunks=(16, 5, 3), dtype="float16", compressors=None,
                         fill_value=0)
    packed = g.create_array("packed", shape=values.shape, chunks=(16, 5, 3), dtype="float16", fill_value=0)
    raw[:], packed[:] = values, values
    assert raw_chunks(raw) is not None and raw_chunks(packed) is None
    for rows in (np.arange(203), np.array([0, 0, 15, 16, 17, 202, 202]), np.sort(np.random.default_rng(1).choice(203, 40))):
        for array in (raw, packed):
            np.testing.assert_array_equal(read_rows(array, rows), values[rows])
            np.testing.assert_array_equal(read_rows(array, rows, width=2), values[rows, :2])


def test_plan_in_memory_when_it_fits_and_its_bytes(opened):
    """The bytes a plan counts are the in-memory splits' (frames, masks, sentences, real token columns)."""
    from tvrpipe.training.data import load_split
    from tvrpipe.training.stream import plan_data

    s, rows = opened
    plan = plan_data(s, rows, True, 16, budget=10**9)
    loaded = [load_split(s, name, rows) for name in ("train", "val", "test")]
    held = sum(a.nbytes for sp in loaded for a in (sp.frames, sp.frame_mask, sp.sentence, sp.tokens, sp.token_mask))
    # each split trims tokens to its own real width; the plan counts the widest: at least what is held
    width = max(sp.tokens.shape[1] for sp in loaded)
    n_t = sum(sp.n_texts for sp in loaded)
    assert held <= plan.needs == held + sum((width - sp.tokens.shape[1]) * sp.n_texts * (32 * 2 + 1) for sp in loaded)
    assert n_t == len(rows.train_texts) + len(rows.val_texts) + len(rows.test_texts)
    assert not plan.streamed and plan.record()["mode"] == "in memory"
    # one evaluation (the larger split's embeddings, without a head the features in float32, and two float32 score
    # matrices) and the store's tables count too
    F, D = 4, 32
    assert plan.evaluation == max(len(t) * (D * 4 + width * (D * 4 + 1)) + len(v) * F * (D * 4 + 1) + 8 * len(t) * len(v)
                                  for t, v in ((rows.val_texts, rows.val_videos), (rows.test_texts, rows.test_videos)))
    assert plan.tables == s.videos.memory_usage(deep=True).sum() + s.texts.memory_usage(deep=True).sum() > 0
    assert plan.record()["evaluation"] == gb(plan.evaluation) and plan.record()["tables"] == gb(plan.tables)
    every = plan.needs + plan.evaluation + plan.tables
    assert plan_data(s, rows, True, 16, budget=every).streamed is False  # fitting exactly is fitting
    assert plan_data(s, rows, True, 16, budget=every - 1).streamed


def test_the_evaluation_is_counted_with_the_heads_own_embeddings(opened):
    """With a head, an evaluation's embeddings are the head's: per item, what it holds for a batch of the store's
    own captions and videos (tokenwise: its masked word and frame vectors, exactly)."""
    import torch

    from tvrpipe.heads.base import create_head
    from tvrpipe.training.data import load_split
    from tvrpipe.training.stream import item_bytes, plan_data

    s, rows = opened
    val = load_split(s, "val", rows)
    width = val.tokens.shape[1]
    for method in ("xpool", "tokenwise", "uatvr", "prota"):
        head = create_head(method, embed_dim=32).eval()
        with torch.inference_mode():
            held = [sum(v.numel() * v.element_size() for v in emb.values() if isinstance(v, torch.Tensor)) / 5
                    for emb in (head.encode_texts(val.text_batch(np.arange(5), head.uses_tokens)),
                                head.encode_videos(val.video_batch(np.arange(5))))]
        assert item_bytes(head, 4, width) == tuple(held), method
    assert item_bytes(create_head("tokenwise", embed_dim=32), 4, 8) == (8 * (32 * 4 + 1), 4 * (32 * 4 + 1))
    uatvr = create_head("uatvr", embed_dim=32)
    per_text, per_video = item_bytes(uatvr, 4, width)
    plan = plan_data(s, rows, True, 16, budget=10**9, head=uatvr)
    assert plan.evaluation == max(len(t) * per_text + len(v) * per_video + 8 * len(t) * len(v)
                                  for t, v in ((rows.val_texts, rows.val_videos), (rows.test_texts, rows.test_videos)))


def test_plan_streams_above_the_budget_and_sizes_the_buffer(opened):
    from tvrpipe.training.stream import BUFFER_SHARE, block_size, pair_bytes, plan_data, split_width

    s, rows = opened
    needs = plan_data(s, rows, False, 16, budget=10**9).needs
    kept = reserve(s, rows, False)
    plan = plan_data(s, rows, False, 16, budget=needs + kept - 1)
    each = pair_bytes(s, 0)
    assert each == 4 * 32 * 2 + 4 + 32 * 2  # F x D float16 frames, F mask bytes, a D float16 sentence
    # the buffer's share is of what the budget leaves beside the evaluation and the tables
    assert plan.streamed and plan.buffer_videos == int((needs - 1) * BUFFER_SHARE) // each
    assert plan.block_videos == block_size(32, plan.buffer_videos)
    # whole store chunks (32 videos) that fit 1/16 of the buffer, or part of one chunk
    assert (block_size(64, 46459), block_size(64, 1024), block_size(64, 100), block_size(32, 10)) == (2880, 64, 6, 1)
    rec = plan.record()
    assert rec["mode"] == "streamed" and rec["buffer_videos"] == plan.buffer_videos and "--memory-budget" in rec["budget"]
    assert pair_bytes(s, split_width(s, rows.train_texts)) > each
    # each split's token width is read once, for the plan, and handed to the splits read on use
    tokens = plan_data(s, rows, True, 16, budget=reserve(s, rows, True) + 60_000)
    assert tokens.streamed
    assert tokens.widths == {n: split_width(s, getattr(rows, f"{n}_texts")) for n in ("train", "val", "test")}
    assert plan.widths == {}
    from tvrpipe.training.stream import open_splits

    splits = open_splits(s, rows, tokens, True)
    assert [sp._width for sp in (splits.train, splits.val, splits.test)] == [tokens.widths[n] for n in
                                                                              ("train", "val", "test")]


def test_plan_refuses_a_budget_below_a_batch_and_a_block(opened):
    from tvrpipe.training.stream import plan_data

    s, rows = opened
    kept = reserve(s, rows, True)
    with pytest.raises(ConfigError, match=r"--memory-budget .*evaluating the validation or test split holds .* and the "
                                          r"store's tables .*streaming the training split beside them needs a shuffle "
                                          r"buffer of at least a batch"):
        plan_data(s, rows, True, 16, budget=kept + 4000)
    with pytest.raises(ConfigError, match="shuffle buffer of at least a batch"):
        plan_data(s, rows, True, 16, budget=kept // 2)  # not even the evaluation fits


def test_default_budget_is_half_the_memory_limit(opened, monkeypatch):
    from tvrpipe.training import stream

    s, rows = opened
    monkeypatch.setattr(stream, "memory_limit", lambda: (2 * 10**9, "cgroup limit"))
    plan = stream.plan_data(s, rows, True, 16)
    assert plan.budget == 10**9 and "cgroup limit" in plan.budget_source


def test_cgroup_limits_are_read_at_the_process_cgroup_and_above(tmp_path):
    """v2: memory.max of the process's own cgroup and its parents ("max" is none); v1: the memory controller's
    memory.limit_in_bytes, its no-limit value ignored."""
    from tvrpipe.training.stream import cgroup_limits

    v2 = tmp_path / "v2"
    (v2 / "user.slice" / "run.scope").mkdir(parents=True)
    (v2 / "memory.max").write_text("max\n")
    (v2 / "user.slice" / "memory.max").write_text("3000000000\n")
    (v2 / "user.slice" / "run.scope" / "memory.max").write_text("max\n")
    membership = tmp_path / "cgroup"
    membership.write_text("0::/user.slice/run.scope\n")
    assert cgroup_limits(v2, membership) == [(3_000_000_000, v2 / "user.slice" / "memory.max")]
    v1 = tmp_path / "v1"
    (v1 / "memory" / "job").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "memory" / "job" / "memory.limit_in_bytes").write_text("2000000000\n")
    membership.write_text("4:memory:/job\n3:cpuset:/\n0::/\n")
    assert cgroup_limits(v1, membership) == [(2_000_000_000, v1 / "memory" / "job" / "memory.limit_in_bytes")]


def test_memory_limit_takes_the_lowest(monkeypatch, tmp_path):
    from tvrpipe.training import stream

    monkeypatch.setattr(stream, "cgroup_limits", lambda: [(123456789, Path("/x/memory.max"))])
    assert stream.memory_limit() == (123456789, "cgroup limit (/x/memory.max)")
    monkeypatch.setattr(stream, "cgroup_limits", lambda: [])
    assert stream.memory_limit()[1] in ("RAM", "ulimit -v")


def test_store_split_batches_equal_the_loaded_split(opened):
    """Evaluation reads the same batches either way, so validation and test scores do not depend on the mode."""
    from tvrpipe.training.data import load_split
    from tvrpipe.training.stream import StoreSplit

    s, rows = opened
    for name in ("train", "val", "test"):
        mem = load_split(s, name, rows)
        lazy = StoreSplit(s, name, getattr(rows, f"{name}_videos"), getattr(rows, f"{name}_texts"))
        np.testing.assert_array_equal(lazy.text_video, mem.text_video)
        np.testing.assert_array_equal(lazy.caption_ids, mem.caption_ids)
        for a, b in zip(lazy.text_batches(7), mem.text_batches(7), strict=True):
            for x, y in ((a.tokens, b.tokens), (a.token_mask, b.token_mask), (a.sentence, b.sentence)):
                assert x.shape == y.shape and x.dtype == y.dtype and bool((x == y).all())
        for a, b in zip(lazy.video_batches(5), mem.video_batches(5), strict=True):
            assert bool((a.frames == b.frames).all()) and bool((a.frame_mask == b.frame_mask).all())
        idx = np.array([3, 0, 2])
        t1, t2 = lazy.text_batch(idx, trim=True), mem.text_batch(idx, trim=True)
        assert t1.tokens.shape == t2.tokens.shape and bool((t1.tokens == t2.tokens).all())
        assert lazy.text_batch(idx, tokens=False).tokens.shape == (3, 0, 32)


def test_streamed_epoch_visits_every_video_once_with_its_own_caption(opened):
    from tvrpipe.training.data import load_split
    from tvrpipe.training.stream import StreamedPairs, open_splits, plan_data

    s, rows = opened
    plan = plan_data(s, rows, True, 8, budget=reserve(s, rows, True) + 30_000)
    assert plan.streamed and plan.buffer_videos < len(rows.train_videos)
    train = open_splits(s, rows, plan, True).train
    mem = load_split(s, "train", rows)
    pairs = StreamedPairs(train, plan, True)
    steps = train.n_videos // 8
    seen = []
    for vids, caps, texts, videos in pairs.epoch(0, 3, steps, 8):
        assert len(set(vids.tolist())) == 8  # no video twice in a batch
        np.testing.assert_array_equal(mem.text_video[caps], vids)  # each caption is its video's
        np.testing.assert_array_equal(videos.frames.numpy(), mem.frames[vids].astype(np.float32))
        np.testing.assert_array_equal(videos.frame_mask.numpy(), mem.frame_mask[vids])
        np.testing.assert_array_equal(texts.sentence.numpy(), mem.sentence[caps].astype(np.float32))
        ref = mem.text_batch(caps, trim=True)  # trimmed to the batch's real tokens, as in memory
        assert texts.tokens.shape == ref.tokens.shape and bool((texts.tokens == ref.tokens).all())
        seen += vids.tolist()
    assert len(seen) == steps * 8 and len(set(seen)) == len(seen)  # each video at most once an epoch
    again = [v.tolist() for v, *_ in pairs.epoch(0, 3, steps, 8)]
    assert sum(again, []) == seen  # (seed, epoch) decide the draws: a resumed run draws the same
    other = sum([v.tolist() for v, *_ in pairs.epoch(0, 4, steps, 8)], [])
    assert other != seen
    # shuffled: the order is far from the store's (a rank correlation well below 1)
    ranks = np.argsort(np.argsort(seen))
    assert abs(np.corrcoef(ranks, np.sort(seen))[0, 1]) < 0.9


def test_streamed_epoch_holds_a_buffer_not_the_split(opened):
    """The buffer is what the plan sized, whatever the split's size: the epoch never gathers the split."""
    from tvrpipe.training.stream import StreamedPairs, open_splits, plan_data

    s, rows = opened
    plan = plan_data(s, rows, False, 4, budget=reserve(s, rows, False) + 12_000)
    pairs = StreamedPairs(open_splits(s, rows, plan, False).train, plan, False)
    reads = []
    real = pairs._read
    pairs._read = lambda vids, rng: reads.append(len(vids)) or real(vids, rng)
    batches = pairs.epoch(0, 0, 3, 4)
    next(batches)  # the first batch: the buffer filled, no more
    assert plan.buffer_videos <= sum(reads) < plan.buffer_videos + plan.block_videos
    assert max(reads) <= plan.block_videos


def test_fit_streamed_against_in_memory(store, tmp_path):
    """A run whose budget is below its splits streams them and says so, and the in-memory run records its
    permutation (that the streamed run trains: the test below)."""
    from tvrpipe.training.fit import fit
    from tvrpipe.training.settings import TrainConfig

    runs = {}
    for name, budget in (("memory", None), ("streamed", run_reserve(store, "xpool") + 20_000)):
        fit(store, "xpool", tmp_path / name, TrainConfig(epochs=3, batch_size=8, memory_budget=budget), progress=False)
        runs[name] = yaml.safe_load((tmp_path / name / "config.yaml").read_text())
    c_mem, c_str = runs["memory"], runs["streamed"]
    assert c_mem["data"]["mode"] == "in memory" and c_str["data"]["mode"] == "streamed"
    assert c_mem["data"]["order"] == "every training video once an epoch, in a random permutation"
    assert "shuffle buffer" in c_str["data"]["order"] and c_str["train"]["memory_budget"] == run_reserve(store, "xpool") + 20_000
    # untrained (--epochs 0), both modes score the same: evaluation reads the same batches
    zero = [fit(store, "xpool", tmp_path / f"zero-{b}", TrainConfig(epochs=0, memory_budget=b), progress=False)
            for b in (None, run_reserve(store, "xpool") + 20_000)]
    assert zero[0]["test"] == zero[1]["test"] and zero[0]["val"] == zero[1]["val"]


def test_streamed_training_trains_as_in_memory_training_does(tmp_path):
    """On a world where training moves xpool's ranking (the calibrated world's learnable share), a streamed run's
    trained epochs lower the loss and raise validation as the in-memory run's do: judged on the epochs trained,
    not on the selected one (epoch 0 competes in selection, so a trainer that never trains would still select)."""
    import pandas as pd

    from tvrpipe.training.fit import fit
    from tvrpipe.training.settings import TrainConfig
    from tvrpipe.worlds.features import CALIBRATED, GenSpec, generate_store

    store = generate_store(tmp_path / "store", GenSpec(
        train_videos=512, val_videos=400, test_videos=20, captions_per_train_video=4, embed_dim=64, intrinsic_dim=64,
        frames=4, seed=0, **CALIBRATED), progress=False)
    runs = {}
    for name, budget in (("memory", None), ("streamed", run_reserve(store, "xpool") + 200_000)):
        m = fit(store, "xpool", tmp_path / name, TrainConfig(epochs=30, memory_budget=budget), progress=False)
        mode = yaml.safe_load((tmp_path / name / "config.yaml").read_text())["data"]["mode"]
        epochs = pd.read_csv(tmp_path / name / "epochs.csv")
        runs[name] = (mode, m["untrained_val"]["t2v"]["R@1"], epochs["loss"].to_numpy(),
                      epochs["val_t2v_R@1"].to_numpy())
    assert [r[0] for r in runs.values()] == ["in memory", "streamed"]
    for mode, untrained, loss, val in runs.values():
        # measured: loss 3.2 -> 2.2, validation 36.75 -> 40-42 over the last 10 epochs (400 videos: paired sd ~2)
        assert loss[-10:].mean() < loss[0] - 0.6, (mode, loss)
        assert val[-10:].mean() >= untrained + 2, (mode, untrained, val)
    (_, _, loss_m, val_m), (_, _, loss_s, val_s) = runs["memory"], runs["streamed"]
    # another draw order (a shuffle buffer, not a permutation), the same training
    assert abs(loss_s[-10:].mean() - loss_m[-10:].mean()) < 0.15 and abs(val_s[-10:].mean() - val_m[-10:].mean()) < 3


@pytest.mark.parametrize("size", ["lots", "0", "-1GB", "2XB"])
def test_cli_refuses_a_budget_that_is_not_a_size(cli, store, tmp_path, size):
    r = cli("train-head", "--features", store, "--method", "meanpool", "--epochs", 1, "--out", tmp_path / "run",
            "--memory-budget", size)
    assert r.exit_code != 0 and f"--memory-budget {size!r}: give a size above 0" in r.output
    assert not (tmp_path / "run").exists()


def test_cli_streams_under_a_small_budget_and_says_so(cli, store, tmp_path):
    budget = run_reserve(store, "meanpool") + 20_000
    r = cli("train-head", "--features", store, "--method", "meanpool", "--epochs", 1, "--batch-size", 8,
            "--out", tmp_path / "run", "--memory-budget", f"{budget}B")
    assert r.exit_code == 0, r.output
    data = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["data"]
    assert data["mode"] == "streamed" and data["budget"] == f"{gb(budget)} (--memory-budget)"
    assert "streamed from the store: its splits need" in " ".join(r.output.split())
    tiny = cli("train-head", "--features", store, "--method", "meanpool", "--epochs", 1, "--out", tmp_path / "r2",
               "--memory-budget", "2kB")
    assert tiny.exit_code == 1 and "needs a shuffle buffer of at least a batch" in " ".join(tiny.output.split())
    assert not (tmp_path / "r2").exists()


def test_streamed_rows_are_checked_finite_once_each(opened, monkeypatch):
    """Every row a streamed epoch reads is checked for NaN and infinity the first time it is read, and only then:
    frames per video, sentences and tokens per caption."""
    from tvrpipe.training.stream import StreamedPairs, open_splits, plan_data

    s, rows = opened
    plan = plan_data(s, rows, True, 8, budget=reserve(s, rows, True) + 30_000)
    pairs = StreamedPairs(open_splits(s, rows, plan, True).train, plan, True)
    checked: dict[str, list[int]] = {}
    real = type(s).check_finite

    def spy(self, name, data, rows, block=4096):
        checked.setdefault(name, []).extend(np.asarray(rows).tolist())
        return real(self, name, data, rows, block)

    monkeypatch.setattr(type(s), "check_finite", spy)
    steps = pairs.split.n_videos // 8
    read_videos, read_captions = [], []
    for epoch in (0, 1, 2):
        for vids, caps, *_ in pairs.epoch(0, epoch, steps, 8):
            read_videos += pairs.split.video_rows[vids].tolist()
            read_captions += pairs.split.text_rows[caps].tolist()
    assert sorted(checked["videos/frames"]) == sorted(set(checked["videos/frames"]))  # once each
    assert set(read_videos) <= set(checked["videos/frames"])
    for name in ("texts/sentence", "texts/tokens"):
        assert sorted(checked[name]) == sorted(set(checked[name])) and set(read_captions) <= set(checked[name])
    # 3 epochs of 2 captions a video: the captions drawn differ between epochs, and each was checked
    assert len(set(read_captions)) > len(set(read_videos))


def test_a_run_recorded_before_the_data_record_resumes_in_memory_only(store, tmp_path):
    """A run directory whose config.yaml has no data section (written before it existed) read its splits in memory:
    it resumes in memory, and a budget that would stream it is refused, naming --memory-budget."""
    from tvrpipe.training.fit import fit
    from tvrpipe.training.settings import TrainConfig

    run = tmp_path / "run"
    fit(store, "meanpool", run, TrainConfig(epochs=1, batch_size=8), progress=False)
    config = yaml.safe_load((run / "config.yaml").read_text())
    del config["data"], config["train"]["memory_budget"]
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    (run / "metrics.json").unlink()  # unfinished: a rerun resumes it
    fit(store, "meanpool", run, TrainConfig(epochs=1, batch_size=8), progress=False)
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["mode"] == "in memory"
    with pytest.raises(ConfigError, match=r"was trained with its data in memory .* would read it streamed .*"
                                          r"give the --memory-budget that reads it as before"):
        fit(store, "meanpool", run, TrainConfig(epochs=1, batch_size=8,
                                                memory_budget=run_reserve(store, "meanpool") + 20_000), progress=False)
