"""What a search's numbers mean: every registered head states its score (which way ranks first), its score range
and its uncertainty (which way is less certain) on its class; registration refuses one that does not; the
scores stay in the stated range; `search --help`, the page's legend and docs/search.md read the heads' words."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from tvrpipe.heads.base import Head, HeadConfig, TextBatch, VideoBatch, create_head, head_class, list_heads
from tvrpipe.search.meanings import SCALE, ZERO_SHOT_ROW, head_meanings, markdown_table

D, L, F = 16, 6, 5
ROOT = Path(__file__).resolve().parents[2]


def _flat(text: str) -> str:
    """White space made single, and none after a hyphen (--help wraps lines at hyphens)."""
    return re.sub(r"-\s+", "-", " ".join(text.split()))


@pytest.mark.parametrize("name", list_heads())
def test_every_registered_head_states_what_its_score_and_uncertainty_mean(name):
    cls = head_class(name)
    assert "score_meaning" in cls.__dict__, f"{name} inherits its score_meaning"
    assert "higher" in cls.score_meaning and "ranks first" in cls.score_meaning
    if cls.pair_uncertainty is not Head.pair_uncertainty:  # it reports an uncertainty: what it is, and which way
        assert "larger, less certain" in cls.uncertainty_meaning or "less certain" in cls.uncertainty_meaning
    else:
        assert cls.uncertainty_meaning is None


def _batches(n_t: int, n_v: int, seed: int) -> tuple[TextBatch, VideoBatch]:
    """Random features, padded, with text 0 and video 0 the same direction everywhere (a cosine of 1)."""
    g = torch.Generator().manual_seed(seed)
    n_tok = torch.randint(3, L + 1, (n_t,), generator=g)
    n_frm = torch.randint(1, F + 1, (n_v,), generator=g)
    texts = TextBatch(torch.randn(n_t, L, D, generator=g), torch.arange(L) < n_tok[:, None],
                      torch.randn(n_t, D, generator=g))
    videos = VideoBatch(torch.randn(n_v, F, D, generator=g), torch.arange(F) < n_frm[:, None])
    u = torch.randn(D, generator=g)
    texts.tokens[0], texts.sentence[0], videos.frames[0] = u, 2 * u, 3 * u
    return texts, videos


@pytest.mark.parametrize("overrides", [{}, {"zero_shot_start": True}], ids=["plain", "zero-shot-start"])
@pytest.mark.parametrize("name", list_heads() + ["prota-deterministic"])
def test_scores_stay_within_the_range_the_head_states(name, overrides):
    """Trained-like weights (moved off their initial values) on random features: every score within
    ``score_bounds()`` (with --zero-shot-start: [-1, 1] + g x the head's range, g of either sign)."""
    if name == "prota-deterministic":
        name, overrides = "prota", {**overrides, "probabilistic": False, "kl_weight": 0, "margin_weight": 0}
    torch.manual_seed(0)
    head = create_head(name, embed_dim=D, **overrides).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.3 * torch.randn_like(p))
    texts, videos = _batches(7, 9, seed=1)
    for gate in ((0.7, -1.3) if overrides.get("zero_shot_start") else (None,)):
        if gate is not None:
            head.zero_shot_gate.data.fill_(gate)
        with torch.no_grad():
            s = head.similarity(head.encode_texts(texts), head.encode_videos(videos))
        low, high = head.score_bounds()
        assert low is None or s.min() >= low - 1e-5, (name, gate, float(s.min()), low)
        assert high is None or s.max() <= high + 1e-5, (name, gate, float(s.max()), high)


def test_prota_states_the_variant_its_config_runs():
    prob = create_head("prota", embed_dim=D)
    det = create_head("prota", embed_dim=D, probabilistic=False, kl_weight=0, margin_weight=0)
    assert prob.score_bounds() == (None, 0.0) and det.score_bounds() == (-1.0, 1.0)
    assert prob.meaning().startswith("ProTA Eq. 11:") and "2-Wasserstein" in prob.meaning()
    assert det.meaning().startswith("ProTA Eq. 8:") and "from -1 to 1" in det.meaning()
    assert "token variance" in prob.uncertainty_text() and det.uncertainty_text() is None
    mixed = create_head("meanpool", embed_dim=D, zero_shot_start=True)
    mixed.zero_shot_gate.data.fill_(0.5)
    assert mixed.score_bounds() == (-1.5, 1.5)


def _head(**attrs) -> type[Head]:
    class Bad(Head):
        Config = HeadConfig

    for k, v in attrs.items():
        setattr(Bad, k, v)
    return Bad


@pytest.mark.parametrize("attrs, message", [
    ({}, "Bad.score_meaning must say, in one sentence of its own, what the head's score of a (text, video) pair is "
         "and which way ranks first"),
    ({"score_meaning": "  "}, "Bad.score_meaning must say"),
    ({"score_meaning": "a cosine (higher ranks first)", "score_range": (1.0, -1.0)},
     "Bad.score_range must be (low, high), low < high, None for an unbounded side, not (1.0, -1.0)"),
    ({"score_meaning": "a cosine (higher ranks first)", "score_range": (float("-inf"), 0.0)},
     "Bad.score_range must be (low, high)"),
    ({"score_meaning": "a cosine (higher ranks first)", "pair_uncertainty": lambda self, t, v: None},
     "Bad reports a pair_uncertainty: its uncertainty_meaning must say what it is and which way is less certain"),
])
def test_a_head_that_does_not_say_what_its_numbers_mean_is_refused_at_registration(attrs, message):
    from tvrpipe.heads.base import register_head

    with pytest.raises(TypeError, match=re.escape(message)):
        register_head("bad_meaning")(_head(**attrs))
    assert "bad_meaning" not in list_heads()


def test_the_docs_hold_every_heads_words_as_the_heads_say_them_now():
    path = ROOT / "scripts" / "score_table.py"
    spec = importlib.util.spec_from_file_location("score_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = module.DOC.read_text()
    assert text == module.document(text), "docs/search.md is behind the heads: python scripts/score_table.py --write"
    table = markdown_table()
    for name in list_heads():
        assert f"| `{name}` | {head_class(name).score_meaning.replace('|', chr(92) + '|')} |" in table
    assert f"| {ZERO_SHOT_ROW} | zero-shot CLIP, the meanpool head untrained: " in table
    assert "\\|R\\|_1" in table  # a | inside a cell is escaped, so the row keeps its columns
    assert all(line.count(" | ") == 3 for line in table.splitlines()[2:]), table
    for name in list_heads():  # a head takes a picture where it reads the sentence alone
        row = next(line for line in table.splitlines() if line.startswith(f"| `{name}` |"))
        assert row.endswith("| yes |" if not head_class(name).uses_tokens else "| no: reads word tokens |"), row
    assert _flat(SCALE) in _flat(text)


def test_search_help_says_what_every_heads_score_and_uncertainty_mean(cli):
    r = cli("search", "--help")
    assert r.exit_code == 0, r.output
    text = _flat(r.output)
    assert "What a score means, by head (higher always ranks first):" in text
    for name, score, unc, image in head_meanings():
        words = (f"{name} {score}." + (f" Uncertainty: {unc}." if unc else " No uncertainty.")
                 + (" Takes --image." if image else " Not --image (it reads word tokens)."))
        assert _flat(words) in text, name
    assert _flat(SCALE) in text
