"""The first-stage registry: every registered first stage through the same interface (built on random unit
vectors, its top k against the exact one, a save/load round trip), the exact stage against a NumPy argsort,
what `auto` and the aliases resolve to, and the cache in <store>/search-index/ across first stages and
settings (an index.json written before the registry included)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tvrpipe.errors import ConfigError
from tvrpipe.features.store import open_store
from tvrpipe.search import index as index_mod
from tvrpipe.search.first_stages import (
    FirstStageIndex,
    first_stage_class,
    first_stage_help,
    list_first_stages,
    register_first_stage,
    resolve_first_stage,
    stage_config,
)
from tvrpipe.search.first_stages.base import stage_settings
from tvrpipe.search.first_stages.faiss_hnsw import faiss_available
from tvrpipe.search.index import INDEX_DIR, export_faiss, exported_stage, first_stage

pytestmark = pytest.mark.numerics

NEEDS_FAISS = pytest.mark.skipif(not faiss_available(), reason="faiss-cpu is not installed (pip install faiss-cpu)")


def unit(n: int, d: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def argsort_top(emb: np.ndarray, q: np.ndarray, k: int) -> np.ndarray:
    """The reference: a full stable argsort of the negated scores (equal scores by row)."""
    return np.argsort(-(q @ emb.T), axis=1, kind="stable")[:, :k]


def overlap(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean([len(set(x.tolist()) & set(y.tolist())) / len(y) for x, y in zip(a, b)]))


@pytest.mark.parametrize("name", [n for n in list_first_stages() if not first_stage_class(n).head_aware])
def test_every_first_stage_builds_ranks_saves_and_loads(name, tmp_path):
    """Every first stage over pooled embeddings (a head-aware one is built from a head: tests/search/
    test_distilled.py)."""
    cls = first_stage_class(name)
    if not cls.available():
        pytest.skip(f"{name} needs {cls.install}")
    emb, q = unit(2000, 32, 0), unit(7, 32, 1)
    index = cls.build(emb)
    assert index.name == name and len(index) == 2000 and index.describe().strip()
    idx, s = index.top(q, 20)
    assert idx.shape == s.shape == (7, 20) and idx.dtype == np.int64
    assert ((idx >= 0) & (idx < 2000)).all() and all(len(set(r)) == 20 for r in idx)
    assert (np.diff(s, axis=1) <= 1e-6).all()  # best first
    # the scores are the cosines of the rows returned, up to the index's own rounding
    np.testing.assert_allclose(s, np.take_along_axis(q @ emb.T, idx, 1), atol=0.05)
    assert overlap(idx, argsort_top(emb, q, 20)) >= (1.0 if cls.exact else 0.5)
    index.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(cls.files)
    again = cls.load(tmp_path, emb)
    assert again.describe() == index.describe()
    idx2, s2 = again.top(q, 20)
    np.testing.assert_array_equal(idx2, idx)
    np.testing.assert_array_equal(s2, s)
    # the config: the registered defaults, search-time fields left out of what an index is built with
    config = stage_config(name)
    assert isinstance(config, cls.Config) and config.owner == name
    assert not set(cls.search_fields) & set(cls.build_settings(config))


def test_the_exact_stage_is_numpys_argsort_ties_by_row():
    emb, q = unit(300, 8, 2), unit(5, 8, 3)
    emb[[10, 150, 299]] = emb[42]  # ties: the lower rows first
    q[0] = emb[42]
    idx, s = first_stage_class("exact").build(emb).top(q, 12)
    np.testing.assert_array_equal(idx, argsort_top(emb, q, 12))
    assert idx[0, :4].tolist() == [10, 42, 150, 299]
    np.testing.assert_allclose(s, np.take_along_axis(q @ emb.T, idx, 1), rtol=1e-6)


def test_names_aliases_and_auto_come_from_the_registry(monkeypatch):
    names = list_first_stages()
    assert "exact" in names and "faiss-hnsw" in names and "auto" not in names
    text = first_stage_help()
    assert all(f"{n}" in text for n in names) and text.startswith("auto: ")
    assert resolve_first_stage("faiss") == "faiss-hnsw" == first_stage_class("faiss").name
    hnsw = first_stage_class("faiss-hnsw")
    monkeypatch.setattr(hnsw, "available", classmethod(lambda cls: True))
    assert resolve_first_stage("auto") == "faiss-hnsw"
    monkeypatch.setattr(hnsw, "available", classmethod(lambda cls: False))
    assert resolve_first_stage("auto") == "exact"
    with pytest.raises(ConfigError, match="--first-stage faiss-hnsw needs faiss-cpu .* or use --first-stage exact"):
        resolve_first_stage("faiss-hnsw")
    with pytest.raises(ConfigError, match="choose one of auto, head, distilled, exact, "):
        resolve_first_stage("annoy")
    with pytest.raises(ConfigError, match="--first-stage head is fitted to a run's head: give --run"):
        resolve_first_stage("head")  # zero-shot: no head to build one for
    assert "head: the first stage made for the run's head" in text
    with pytest.raises(ConfigError, match=r"--first-stage 'auto': choose one of distilled, exact, faiss-hnsw \(or faiss\), "):
        first_stage_class("auto")  # where auto is not taken (export), it is not offered
    with pytest.raises(ConfigError, match="has no setting 'nprobes'"):
        stage_config("exact", {"nprobes": 3})
    with pytest.raises(ConfigError, match="faiss-hnsw has no setting 'nprobe'; known: ef_construction"):
        stage_settings("faiss-hnsw", {"nprobe": 3})  # a mapping is checked as KEY=VALUE items are
    with pytest.raises(ConfigError, match="faiss-hnsw has no setting 'nprobe'"):
        stage_settings("faiss-hnsw", ["nprobe=3"])


def test_a_name_is_registered_once_and_a_config_is_frozen():
    with pytest.raises(ValueError, match="registered twice"):
        register_first_stage("exact")(type("Again", (FirstStageIndex,), {}))
    with pytest.raises(ValueError, match="registered twice"):
        register_first_stage("auto")(type("Auto", (FirstStageIndex,), {}))

    class Loose:  # settings in a plain class: neither checked nor recorded
        pass

    with pytest.raises(TypeError, match="must be a frozen dataclass"):
        register_first_stage("loose")(type("Loose", (FirstStageIndex,), {"Config": Loose, "__module__": __name__}))


def test_the_cli_help_lists_every_registered_first_stage(cli, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    for command in (("search",), ("bench", "search")):
        text = " ".join(cli(*command, "--help").output.split())
        assert all(n in text for n in list_first_stages()), command


# ----------------------------------------------------------------------------------- the cache


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    from tvrpipe.worlds.features import GenSpec, generate_store

    spec = GenSpec(train_videos=48, test_videos=40, captions_per_train_video=1, frames=4, max_words=8,
                   embed_dim=32, seed=3, min_frames=2)
    return generate_store(tmp_path_factory.mktemp("gen") / "store", spec, video_shard=16, text_shard=64)


@pytest.fixture
def store(gen, tmp_path):
    shutil.copytree(gen, tmp_path / "store")
    return open_store(tmp_path / "store")


def _meta(store) -> dict:
    return json.loads((store.dir / INDEX_DIR / "index.json").read_text())


@NEEDS_FAISS
def test_a_cached_index_of_another_first_stage_or_build_setting_is_rebuilt(store, monkeypatch):
    hnsw = first_stage_class("faiss-hnsw")
    builds = []
    real = hnsw.build.__func__
    monkeypatch.setattr(hnsw, "build", classmethod(lambda cls, p, c=None: builds.append(c) or real(cls, p, c)))
    first_stage(store, "faiss")
    assert len(builds) == 1 and _meta(store)["first_stage"]["name"] == "faiss-hnsw"
    assert _meta(store)["describe"].startswith("faiss-hnsw: IndexFlatIP")
    first_stage(store, "faiss-hnsw", settings={"ef_search": 200})  # a search-time setting: the same index
    assert len(builds) == 1
    exact = first_stage(store, "exact")  # the exact stage needs no index: the cache is used as it is
    assert exact.index.name == "exact" and _meta(store)["first_stage"]["name"] == "faiss-hnsw"
    stage = first_stage(store, "faiss", settings={"hnsw_from": 10})  # another build setting: built again, kept
    assert len(builds) == 2 and "IndexHNSWFlat" in stage.describe()
    assert _meta(store)["first_stage"]["settings"]["hnsw_from"] == 10
    first_stage(store, "faiss")  # and back: the kept one is not the defaults'
    assert len(builds) == 3


@NEEDS_FAISS
def test_an_index_json_written_before_the_registry_is_read_as_faiss_hnsw(store, tmp_path, monkeypatch):
    """Stores and exports whose index.json says {"faiss": "IndexFlatIP"} (no "first_stage") keep working:
    the cache is reused without a rebuild, and an export loads as faiss-hnsw."""
    first_stage(store, "faiss")
    folder = store.dir / INDEX_DIR
    meta = _meta(store)
    old = {"store_key": meta["store_key"], "videos": meta["videos"], "dim": meta["dim"], "faiss": "IndexFlatIP"}
    (folder / "index.json").write_text(json.dumps(old))
    monkeypatch.setattr(first_stage_class("faiss-hnsw"), "build", None)  # any build would fail
    q = unit(3, 32, 4)
    assert first_stage(store, "faiss").top(q, 5)[0].shape == (3, 5)
    monkeypatch.undo()
    out, _ = export_faiss(store.dir, tmp_path / "idx")
    (out / "index.json").write_text(json.dumps(old))
    exported = exported_stage(out, store)
    assert exported.index.name == "faiss-hnsw"
    np.testing.assert_array_equal(exported.top(q, 5)[0], first_stage(store, "exact", cache=False).top(q, 5)[0])
    with pytest.raises(ConfigError, match="hnsw_from is a build setting of faiss-hnsw; set only ef_search"):
        exported_stage(out, store, {"hnsw_from": 3})


def test_an_index_of_the_exact_stage_cannot_be_exported(store, tmp_path):
    with pytest.raises(ConfigError, match="--first-stage exact has no index to export: choose one of faiss-hnsw"):
        export_faiss(store.dir, tmp_path / "idx", "exact")
    assert not (tmp_path / "idx").exists()


def test_a_memory_mapped_cache_ranks_as_the_computed_one(store):
    computed = first_stage(store, "exact", cache=False)  # in RAM
    built = first_stage(store, "exact")  # written to disk block by block, then read back as a memory map
    cached = first_stage(store, "exact")
    assert not isinstance(computed.pooled, np.memmap)
    assert isinstance(built.pooled, np.memmap) and isinstance(cached.pooled, np.memmap)
    np.testing.assert_array_equal(built.pooled, computed.pooled)
    np.testing.assert_array_equal(built.rows, computed.rows)
    q = unit(4, 32, 5)
    for stage in (built, cached):
        for a, b in zip(computed.top(q, 9), stage.top(q, 9)):
            np.testing.assert_array_equal(a, b)
    assert index_mod.recorded_stage(_meta(store)) == {"name": "exact", "settings": {}}


# ----------------------------------------------------------------------------------- faiss-ivfpq


def clustered(n: int, d: int, clusters: int, seed: int) -> np.ndarray:
    """Unit vectors around ``clusters`` random centres: dense neighbourhoods, as CLIP embeddings have."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, d)).astype(np.float32)
    x = centres[rng.integers(0, clusters, n)] + 0.5 * rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


class Reads:
    """An (n, D) array that records how many rows each read takes (what building holds at once)."""

    def __init__(self, a: np.ndarray) -> None:
        self.a, self.shape, self.reads = a, a.shape, []

    def __len__(self) -> int:
        return len(self.a)

    def __getitem__(self, key):
        out = self.a[key]
        self.reads.append(len(out))
        return out


@NEEDS_FAISS
def test_ivfpq_recalls_the_exact_top_k_from_a_memory_mapped_index(tmp_path):
    """5,000 clustered unit vectors, D = 64 (IVF-PQ from 2,000 videos, so the index is IVF-PQ, not flat): with
    the defaults (refine 4, nprobe 32) recall@10 and recall@100 against the exact stage measured 0.998 and
    0.998 (seeds 0-2 and 20,000 vectors: 0.997-1.000 and 0.987-0.998); the index's own order (refine 1)
    measured 0.68-0.74 at k = 10, so the exact re-scoring is what the threshold tests."""
    cls = first_stage_class("faiss-ivfpq")
    emb = clustered(5000, 64, 100, 0)
    rng = np.random.default_rng(10)
    q = emb[rng.choice(5000, 100, replace=False)] + 0.3 * rng.standard_normal((100, 64)).astype(np.float32) / 8
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    reads = Reads(emb)
    index = cls.build(reads, stage_config("faiss-ivfpq", {"ivf_from": 2000, "block": 1000}))
    index.pooled = emb
    assert "IndexIVFPQ nlist=128 m=16 nbits=8" in index.describe()
    # building held the sample (every row here: 5,000 < 256 x nlist) or one block at a time
    assert max(reads.reads) == 5000 and reads.reads[1:] == [1000] * 5
    for k in (10, 100):
        assert overlap(index.top(q, k)[0], argsort_top(emb, q, k)) >= 0.95, k
    own = cls(emb, stage_config("faiss-ivfpq", {"ivf_from": 2000, "refine": 1}), index.index)
    assert overlap(own.top(q, 10)[0], argsort_top(emb, q, 10)) < overlap(index.top(q, 10)[0], argsort_top(emb, q, 10))
    index.save(tmp_path)
    loaded = cls.load(tmp_path, emb, index.config)
    import faiss

    assert type(faiss.downcast_InvertedLists(loaded.index.invlists)).__name__ == "OnDiskInvertedLists"  # mmap
    for a, b in zip(loaded.top(q, 10), index.top(q, 10)):
        np.testing.assert_array_equal(a, b)


@NEEDS_FAISS
@pytest.mark.numerics
def test_ivfpq_probes_a_share_of_its_lists_for_sentence_queries_across_the_modality_gap(tmp_path):
    """Sentence queries against video lists, on the calibrated generated world (CLIP's modality gap: the queries
    lie outside the videos' distribution, so the lists nearest to them hold few of their best videos): the
    exact top 10 held in a shortlist of 100. Probing only the lists the average rule asks for (probe_share ~ 0)
    (and a floor of one list) keeps much less of it than the default share of 0.3, and probing every list keeps
    all of it."""
    from dataclasses import replace

    from tvrpipe.bench.search import collection_spec
    from tvrpipe.search.index import pooled_rows
    from tvrpipe.worlds.features import generate_store

    store = open_store(generate_store(tmp_path / "s", replace(collection_spec(6000, 64), frames=4, max_words=4)))
    pooled, _ = pooled_rows(store)
    q = store.read("texts/sentence", np.arange(0, 6000, 60)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    exact = argsort_top(pooled, q, 10)
    cls = first_stage_class("faiss-ivfpq")
    index = cls.build(pooled, stage_config("faiss-ivfpq", {"ivf_from": 2000}))
    assert "nprobe=max(32, 0.3 x nlist, lists holding 2 x refine x k)" in index.describe()
    # docs/search.md's figure: 4 sqrt(6,000) = 310 lists wanted, capped at the 6,000-vector sample / 39
    assert index.index.nlist == 153

    def kept(**settings):
        index.config = stage_config("faiss-ivfpq", {"ivf_from": 2000, **settings})
        return overlap(index.top(q, 100)[0], exact)

    rule, default, every = kept(nprobe=1, probe_share=0.001), kept(), kept(probe_share=1.0)
    assert every >= 0.99 and default >= rule + 0.1, (rule, default, every)


@NEEDS_FAISS
def test_ivfpq_checks_its_settings_and_is_flat_below_ivf_from():
    cls = first_stage_class("faiss-ivfpq")
    emb = unit(500, 12, 6)
    with pytest.raises(ConfigError, match="m=5 does not divide D=12"):
        cls.build(emb, stage_config("faiss-ivfpq", ["ivf_from=100", "m=5"]))
    with pytest.raises(ConfigError, match="--first-stage-set of faiss-ivfpq: nprobe must be >= 1, got 0"):
        stage_config("faiss-ivfpq", ["nprobe=0"])
    flat = cls.build(emb)
    assert flat.describe() == "faiss-ivfpq: IndexFlatIP (exact below 10,000 videos)"
    q = unit(3, 12, 7)
    np.testing.assert_array_equal(flat.top(q, 8)[0], argsort_top(emb, q, 8))


@NEEDS_FAISS
def test_an_ivfpq_export_is_searched_with_its_search_settings_only(store, tmp_path):
    out, _ = export_faiss(store.dir, tmp_path / "idx", "faiss-ivfpq", ["ivf_from=50"])
    assert json.loads((out / "index.json").read_text())["first_stage"]["name"] == "faiss-ivfpq"
    stage = exported_stage(out, store, ["nprobe=2", "refine=88"])  # refine x k >= the store: every video
    assert stage.index.name == "faiss-ivfpq" and "IndexIVFPQ" in stage.describe()
    q = unit(4, 32, 8)
    for a, b in zip(stage.top(q, 5), first_stage(store, "exact", cache=False).top(q, 5)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    with pytest.raises(ConfigError, match="nlist is a build setting of faiss-ivfpq; set only nprobe, probe_share, refine"):
        exported_stage(out, store, ["nlist=3"])


def test_head_resolves_to_the_first_stage_made_for_each_head():
    """``--first-stage head``: a head's own embedding where its score is one (meanpool, seqtransf), the token-wise
    interaction where it scores word by frame (tokenwise, uatvr), else a distilled scorer."""
    from tvrpipe.heads.base import create_head, list_heads

    want = {"meanpool": "head-embedding", "seqtransf": "head-embedding", "tokenwise": "late-interaction",
            "uatvr": "late-interaction", "xpool": "distilled", "tmass": "distilled", "duq": "distilled",
            "prota": "distilled"}
    got = {m: resolve_first_stage("head", create_head(m, embed_dim=16)) for m in list_heads()}
    assert {m: got[m] for m in want} == want
