"""Synthetic feature stores: the extract store's contract, determinism, and informative features."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from tvrpipe.errors import ConfigError
from tvrpipe.features.store import IDENTITY_KEYS, STORE_NAME, StoreError, open_store
from tvrpipe.worlds.features import (
    LATENT_TEXTS,
    LATENT_VIDEOS,
    GenSpec,
    _latents,
    _tables,
    caption_rotation,
    generate_store,
    provenance_for,
)

pytestmark = pytest.mark.numerics  # floats that depend on the CPU: `make test` runs these under other code paths

SMALL = GenSpec(train_videos=7, val_videos=3, test_videos=5, captions_per_train_video=3,
                captions_per_test_video=2, frames=6, max_words=10, embed_dim=16, scenes=2,
                caption_describes="scene", near_duplicates=0.3, min_frames=3, concepts=20, intrinsic_dim=8)
# Retrieval checks: only test videos matter, and 200 of them keep chance at 0.5%.
RETRIEVAL = GenSpec(train_videos=0, test_videos=200, captions_per_test_video=1)


def _arrays(d):
    s = open_store(d)
    return {k: s.array(k)[:] for k in ("videos/frames", "videos/frame_mask", "videos/timestamps",
                                       "texts/tokens", "texts/token_mask", "texts/sentence")}


def _meanpool_r1(d, split="test", sentences=None) -> tuple[float, float]:
    """R@1 of cosine(sentence, masked mean of frames) for t2v on ``split``, and chance; ``sentences``: the store's
    sentences replaced by these (all rows)."""
    s = open_store(d)
    vm = (s.videos["split"] == split).to_numpy()
    tm = (s.texts["split"] == split).to_numpy()
    f = s.array("videos/frames")[:][vm].astype(np.float64)
    m = s.array("videos/frame_mask")[:][vm]
    v = (f * m[..., None]).sum(1) / m.sum(1, keepdims=True)
    t = (s.array("texts/sentence")[:] if sentences is None else sentences)[tm].astype(np.float64)
    sim = (t / np.linalg.norm(t, axis=1, keepdims=True)) @ (v / np.linalg.norm(v, axis=1, keepdims=True)).T
    gt = s.texts["video_row"].to_numpy()[tm] - np.flatnonzero(vm)[0]
    rank = 1 + (sim > sim[np.arange(len(gt)), gt][:, None]).sum(1)  # ties count against
    return float((rank == 1).mean()), 1.0 / vm.sum()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    return generate_store(d, SMALL, video_shard=4, text_shard=8)


def test_layout_matches_an_extracted_store(small):
    s = open_store(small)
    F, L, D = SMALL.frames, SMALL.max_words, SMALL.embed_dim
    nv = SMALL.train_videos + SMALL.val_videos + SMALL.test_videos
    nt = SMALL.train_videos * 3 + (SMALL.val_videos + SMALL.test_videos) * 2
    expect = {
        "videos/frames": ((nv, F, D), (4, F, D), np.float16),
        "videos/frame_mask": ((nv, F), (4, F), np.bool_),
        "videos/timestamps": ((nv, F), (4, F), np.float32),
        "texts/tokens": ((nt, L, D), (8, L, D), np.float16),
        "texts/token_mask": ((nt, L), (8, L), np.bool_),
        "texts/sentence": ((nt, D), (8, D), np.float16),
    }
    for name, (shape, chunks, dtype) in expect.items():
        a = s.array(name)
        assert (a.shape, a.chunks, a.dtype) == (shape, chunks, dtype), name
        meta = json.loads((small / STORE_NAME / name / "zarr.json").read_text())
        assert [c["name"] for c in meta["codecs"]] == ["bytes"]  # uncompressed, as extract
    # sidecars exactly as extract builds them: columns, order, row mapping
    assert list(s.videos.columns) == ["video_id", "split", "path"]
    assert list(s.texts.columns) == ["caption_id", "video_id", "video_row", "split"]
    assert list(s.videos["split"]) == ["train"] * 7 + ["val"] * 3 + ["test"] * 5
    assert list(s.videos["video_id"]) == sorted(s.videos["video_id"])
    assert s.videos["video_id"][0] == "gv_00000"
    assert (s.videos["path"] == "").all()
    assert list(s.texts["caption_id"][:4]) == ["gv_00000#0", "gv_00000#1", "gv_00000#2", "gv_00001#0"]
    assert (s.videos["video_id"].to_numpy()[s.texts["video_row"]] == s.texts["video_id"].to_numpy()).all()
    assert (s.videos["split"].to_numpy()[s.texts["video_row"]] == s.texts["split"].to_numpy()).all()
    assert np.all(np.diff(s.texts["video_row"]) >= 0)
    assert len(s.failures) == 0 and list(s.failures.columns) == ["video_id", "stage", "error"]
    # every shard has its completion marker
    assert len(list((small / "_progress" / "videos").glob("*.json"))) == -(-nv // 4)
    assert len(list((small / "_progress" / "texts").glob("*.json"))) == -(-nt // 8)


def test_provenance(small):
    prov = open_store(small).provenance
    assert all(k in prov for k in IDENTITY_KEYS)
    assert prov == {**prov, **provenance_for(SMALL)}
    assert prov["model"] == "synthetic-features" and prov["pretrained"] == "none"
    assert (prov["frames"], prov["max_words"], prov["embed_dim"]) == (6, 10, 16)
    assert prov["generator"] == SMALL.to_dict() and prov["weights_sha256"] == SMALL.sha256()
    assert prov["dataset"] == "synthetic-features" and prov["split_set"] == "generated"
    other = provenance_for(GenSpec(**{**SMALL.to_dict(), "seed": 1}))
    assert other["weights_sha256"] != prov["weights_sha256"]
    # a head trained on one spec refuses the store of another
    with pytest.raises(StoreError, match="weights_sha256"):
        open_store(small, expect=other)
    with pytest.raises(StoreError, match="other settings"):
        generate_store(small, GenSpec(**{**SMALL.to_dict(), "seed": 1}), video_shard=4, text_shard=8)


def test_masks_padding_tokens_and_eos(small):
    a = _arrays(small)
    fm, tm = a["videos/frame_mask"], a["texts/token_mask"]
    # min_frames: some videos are short; the mask is a prefix; padding is zero, NaN timestamps
    n_frames = fm.sum(1)
    assert n_frames.min() >= SMALL.min_frames and (n_frames < SMALL.frames).any()
    assert (fm == (np.arange(SMALL.frames) < n_frames[:, None])).all()
    assert (a["videos/frames"][~fm] == 0).all() and np.isnan(a["videos/timestamps"][~fm]).all()
    assert (np.abs(a["videos/frames"][fm]).sum(-1) > 0).all()
    # tokens: a prefix mask with 2..L valid tokens, zero padding, a constant SOT, EOS == sentence
    n_tok = tm.sum(1)
    assert (tm == (np.arange(SMALL.max_words) < n_tok[:, None])).all() and n_tok.min() >= 2
    assert (n_tok < SMALL.max_words).any()
    tok = a["texts/tokens"]
    assert (tok[~tm] == 0).all()
    assert np.array_equal(tok[np.arange(len(tok)), n_tok - 1], a["texts/sentence"])
    assert (tok[:, 0] == tok[0, 0]).all()
    # CLIP-like: unnormalised, norms ~10, a shared mean offset
    norms = np.linalg.norm(a["videos/frames"][fm].astype(np.float32), axis=-1)
    assert 5 < norms.mean() < 20
    latent_v = pd.read_parquet(small / LATENT_VIDEOS)
    assert (latent_v["n_frames"].to_numpy() == n_frames).all()
    assert (latent_v["dup_group"] != latent_v["row"]).sum() == 2 + 1 + 2  # 30% of 7, 3, 5
    latent_t = pd.read_parquet(small / LATENT_TEXTS)
    assert latent_t["scene"].between(0, SMALL.scenes - 1).all()


def test_content_words_copy_the_described_concepts(tmp_path):
    spec = GenSpec(train_videos=0, test_videos=40, embed_dim=32, noise=0.1, concepts=50, seed=3)
    d = generate_store(tmp_path, spec)
    a = _arrays(d)
    lt = pd.read_parquet(d / LATENT_TEXTS)
    tok, tm = a["texts/tokens"].astype(np.float32), a["texts/token_mask"]
    # mean-centred words of captions that share a concept are closer than of those that do not
    words = tok[:, 1:-1][tm[:, 1:-1]]
    assert len(words) > 0
    c0 = set(lt["concepts"][0])
    share = [i for i in range(1, len(lt)) if c0 & set(lt["concepts"][i])]
    other = [i for i in range(1, len(lt)) if not c0 & set(lt["concepts"][i])]
    mu = tok[tm].mean(0)

    def best(i, j):
        wi = tok[i, 1 : tm[i].sum() - 1] - mu
        wj = tok[j, 1 : tm[j].sum() - 1] - mu
        wi /= np.linalg.norm(wi, axis=1, keepdims=True)
        wj /= np.linalg.norm(wj, axis=1, keepdims=True)
        return (wi @ wj.T).max()

    assert np.mean([best(0, j) for j in share]) > np.mean([best(0, j) for j in other]) + 0.1


def test_same_seed_same_arrays_any_shards_other_seed_differs(tmp_path, small):
    again = generate_store(tmp_path / "again", SMALL, video_shard=5, text_shard=3)  # other shard sizes
    a, b = _arrays(small), _arrays(again)
    for k in a:
        if a[k].dtype != np.float16:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        else:  # each shard's embeddings are one float32 matmul, whose rows depend on its size by a few ulps,
            # and the store's float16 rounding can turn that into one float16 ulp (2^-10 relative)
            np.testing.assert_allclose(a[k].astype(np.float32), b[k].astype(np.float32), rtol=2.0 ** -10,
                                       atol=2.0 ** -24, err_msg=k)
    c = _arrays(generate_store(tmp_path / "other", GenSpec(**{**SMALL.to_dict(), "seed": 1})))
    assert not np.array_equal(a["videos/frames"], c["videos/frames"])
    assert not np.array_equal(a["texts/sentence"], c["texts/sentence"])


def test_informative_and_harder_with_scenes_and_near_duplicates(tmp_path):
    def r1(name, **kw):
        return _meanpool_r1(generate_store(tmp_path / name, GenSpec(**{**RETRIEVAL.to_dict(), **kw})))[0]

    whole, chance = _meanpool_r1(generate_store(tmp_path / "whole", RETRIEVAL))
    assert whole > 20 * chance  # 0.5% chance; ~43% measured
    whole3 = r1("w3", scenes=3)
    scene3 = r1("s3", scenes=3, caption_describes="scene")  # a caption sees one scene of three
    assert 3 * chance < scene3 < whole3
    assert 5 * chance < r1("dup", near_duplicates=0.5) < whole
    assert r1("easy", noise=0.2) > whole


def test_resume_and_spec_validation(tmp_path, small):
    # rerunning on a complete store is a no-op that keeps it openable
    before = _arrays(small)
    generate_store(small, SMALL, video_shard=4, text_shard=8)
    after = _arrays(small)
    assert all(np.array_equal(before[k], after[k], equal_nan=True) for k in before)
    with pytest.raises(ConfigError, match="caption_describes"):
        generate_store(tmp_path, GenSpec(caption_describes="clip"))
    with pytest.raises(ConfigError, match="scenes .4. in a frame of its own, and min_frames is 2; set scenes=2"):
        generate_store(tmp_path, GenSpec(scenes=4, min_frames=2))
    with pytest.raises(ConfigError, match="min_frames .13. must be <= frames .12."):
        generate_store(tmp_path, GenSpec(min_frames=13))
    with pytest.raises(ConfigError, match="partial_captions must be in"):
        generate_store(tmp_path, GenSpec(partial_captions=1.5))
    with pytest.raises(ConfigError, match="near_duplicates"):
        generate_store(tmp_path, GenSpec(near_duplicates=1.0))
    with pytest.raises(ConfigError, match=r"caption_shift must be an angle in \[0, 90\] degrees, got 91"):
        generate_store(tmp_path, GenSpec(caption_shift=91))
    with pytest.raises(ConfigError, match=r"shared_sources must be in \[0, 1\], got -0.1"):
        generate_store(tmp_path, GenSpec(shared_sources=-0.1))


@pytest.mark.parametrize("d", [8, 9])
def test_caption_rotation_turns_every_vector_by_the_angle(d):
    T = caption_rotation(GenSpec(caption_shift=35.0, seed=3), d).astype(np.float64)
    np.testing.assert_allclose(T @ T.T, np.eye(d), atol=1e-6)  # orthogonal: captions keep their geometry
    z = np.random.default_rng(0).standard_normal((500, d))
    cos = ((z @ T.T) * z).sum(1) / (z * z).sum(1)
    if d % 2 == 0:  # every direction turns by exactly the angle
        np.testing.assert_allclose(cos, np.cos(np.deg2rad(35.0)), atol=1e-6)
    else:  # one direction stays: at least cos(angle), at most 1
        assert (cos >= np.cos(np.deg2rad(35.0)) - 1e-6).all() and (cos <= 1 + 1e-6).all()
        assert np.abs(np.linalg.eigvals(T) - 1).min() < 1e-6
    assert caption_rotation(GenSpec(), d) is None
    assert not np.allclose(caption_rotation(GenSpec(caption_shift=35.0, seed=4), d), T)


def test_caption_shift_is_lost_by_zero_shot_and_undone_by_a_linear_map(tmp_path):
    spec = GenSpec(**{**RETRIEVAL.to_dict(), "caption_shift": 60.0, "noise": 0.7, "seed": 5})
    plain, turned = (generate_store(tmp_path / n, s) for n, s in (("plain", replace(spec, caption_shift=0.0)),
                                                                  ("turned", spec)))
    a, b = _arrays(plain), _arrays(turned)
    for k in ("videos/frames", "videos/frame_mask", "videos/timestamps", "texts/token_mask"):
        assert np.array_equal(a[k], b[k], equal_nan=True), k  # only the captions move
    assert not np.allclose(a["texts/sentence"], b["texts/sentence"])
    r1_plain, chance = _meanpool_r1(plain)
    r1_turned = _meanpool_r1(turned)[0]
    assert r1_turned < 0.6 * r1_plain  # zero-shot loses what the turn takes: cos 60 degrees = 0.5 of the signal
    # The rotation's inverse, lifted to R^D around the text mean, brings the sentences back: a linear head can
    # learn it (the residual outside the content turns too, so not to the bit).
    videos, captions = _tables(spec)
    lat = _latents(spec, videos, captions)
    B = lat.basis.astype(np.float64)
    back = np.eye(spec.embed_dim) + B @ (lat.shift.T.astype(np.float64) - np.eye(B.shape[1])) @ B.T
    sent = (b["texts/sentence"] - lat.mu_t) @ back.T + lat.mu_t
    assert r1_plain > 20 * chance
    assert abs(_meanpool_r1(turned, sentences=sent)[0] - r1_plain) <= 0.05  # 200 queries: 10 of them


def test_shared_sources_copy_train_videos_into_val_and_test(tmp_path):
    spec = GenSpec(train_videos=40, val_videos=20, test_videos=50, frames=4, max_words=8, embed_dim=16, concepts=64,
                   near_duplicates=0.1, shared_sources=0.4, seed=6)
    lv = pd.read_parquet(generate_store(tmp_path / "s", spec) / LATENT_VIDEOS)
    split = np.repeat(["train", "val", "test"], [40, 20, 50])
    src = lv["dup_group"].to_numpy()
    for s, n in (("val", 20), ("test", 50)):
        rows = np.flatnonzero(split == s)
        from_train = rows[(src[rows] != rows) & (split[src[rows]] == "train")]
        assert len(from_train) == round(0.4 * n)  # 37 % in MSR-VTT 1k-A (MDMMT)
        within = rows[(src[rows] != rows) & (split[src[rows]] == s)]
        assert len(within) == round(0.1 * n)  # the split's own near-duplicates are kept
        assert not set(from_train) & set(src[within])  # a copied original is not also made a clip of train
        for r in from_train:  # a clip of the source: its concepts but one
            mine, theirs = lv["concepts"][r], lv["concepts"][src[r]]
            assert len(mine) == len(theirs) and (np.asarray(mine) != np.asarray(theirs)).sum() == 1
    train = np.flatnonzero(split == "train")
    assert (split[src[train]] == "train").all()  # train videos copy nothing outside their split
    # the rest of the world is the one drawn without shared sources (they have a stream of their own)
    plain = pd.read_parquet(generate_store(tmp_path / "p", replace(spec, shared_sources=0.0)) / LATENT_VIDEOS)
    moved = (src != np.arange(len(src))) & (split[src] == "train") & (split != "train")
    kept = np.flatnonzero(~moved)
    assert moved.sum() == round(0.4 * 20) + round(0.4 * 50)
    assert (plain["dup_group"].to_numpy()[kept] == src[kept]).all()
    assert all(np.array_equal(lv["concepts"][r], plain["concepts"][r]) for r in kept)


def test_synth_features_only_cli_writes_a_generated_store(cli, tmp_path):
    from tvrpipe.features.store import open_store

    out = tmp_path / "gen"
    r = cli("synth", "--features-only", "--out", out, "--seed", "3", "--set", "train_videos=40", "--set",
            "val_videos=10", "--set", "test_videos=12", "--set", "embed_dim=16", "--set", "near_duplicates=0.2",
            "--set", "min_frames=6")
    assert r.exit_code == 0, r.output
    store = open_store(out)
    assert store.videos["split"].value_counts().to_dict() == {"train": 40, "test": 12, "val": 10}
    assert store.provenance["embed_dim"] == 16 and store.array("videos/frames").shape[1:] == (12, 16)
    spec = store.provenance["generator"]
    assert spec["seed"] == 3 and spec["near_duplicates"] == 0.2 and spec["min_frames"] == 6
    assert "train 40 videos / 160 captions" in " ".join(r.output.split())  # small preset: 4 captions each
    assert "tvrpipe train-head --features" in r.output


@pytest.mark.parametrize("args, message", [
    (["--videos", "100"], "--videos sets rendered videos; with --features-only use --preset and --set"),
    (["--preset", "huge"], "--preset 'huge' is not one of: small, medium, msrvtt9k, onescene"),
    (["--set", "noize=1"], "unknown config key 'noize'"),
    (["--set", "noise=-1"], "--set noise must be >= 0"),  # the option typed, not the class behind it
])
def test_synth_features_only_rejects_bad_options(cli, tmp_path, args, message):
    r = cli("synth", "--features-only", "--out", tmp_path / "g", *args)
    assert r.exit_code == 1 and message in " ".join(r.output.split()), r.output
    assert not (tmp_path / "g").exists()


def test_synth_generator_options_need_features_only(cli, tmp_path):
    r = cli("synth", "--out", tmp_path / "s", "--set", "noise=1")
    assert r.exit_code == 1 and "apply with --features-only" in r.output


def test_a_collection_with_few_captioned_videos_keeps_the_same_videos(small, tmp_path):
    """captioned_test_videos: only the first N test videos have captions; the videos are the world's all the
    same (their frames are the fully captioned store's, exactly), the store holds fewer texts and says so in
    its spec; unset, the field is not recorded, so an older store keeps its identity."""
    few = replace(SMALL, captioned_test_videos=2)
    d = generate_store(tmp_path / "few", few, video_shard=4, text_shard=8)
    full, part = _arrays(small), _arrays(d)
    for k in ("videos/frames", "videos/frame_mask", "videos/timestamps"):
        np.testing.assert_array_equal(full[k], part[k], err_msg=k)
    s = open_store(d)
    test_ids = s.videos.loc[s.videos["split"] == "test", "video_id"].tolist()
    captioned = s.texts.loc[s.texts["split"] == "test", "video_id"]
    assert sorted(set(captioned)) == test_ids[:2] and len(captioned) == 2 * 2  # 2 captions per test video
    assert len(s.texts) == few.n_texts == 7 * 3 + 3 * 2 + 2 * 2 < SMALL.n_texts
    assert few.store_bytes() < SMALL.store_bytes()
    assert s.provenance["generator"]["captioned_test_videos"] == 2
    assert "captioned_test_videos" not in SMALL.to_dict() and "captioned_test_videos" not in open_store(
        small).provenance["generator"]
    with pytest.raises(ConfigError, match=r"GenSpec.captioned_test_videos must be between 0 and test_videos \(5\), "
                                          r"got 6"):
        replace(SMALL, captioned_test_videos=6).validate()
