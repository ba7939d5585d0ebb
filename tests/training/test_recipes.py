"""Recipes: every shipped one parses with a source for every value; `--recipe` trains as written, an
explicit option wins, `--dry-run` writes nothing; the report prints the paper's row; the data root."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from tvrpipe.errors import ConfigError
from tvrpipe.rundir import METRICS
from tvrpipe.training.recipes import IMPLEMENTED, SETTINGS, list_recipes, load_recipe, resolve

PAPERS = {"uatvr", "duq", "prota", "tmass"}
BASELINES = {"meanpool", "seqtransf", "xpool"}

# a complete recipe for the tiny test CLIP: T-MASS's groups, Adam, distinct learning rates
TINY_TMASS = {
    "paper": "test", "method": "tmass", "dataset": "synthetic",
    "split_set": {"value": "synthetic", "source": "choice: test"},
    "settings": {k: {"value": v, "source": f"choice: test {k}"} for k, v in {
        "model": "tvrpipe-tiny", "pretrained": "none", "end_to_end": True, "frames": 4, "max_words": 8,
        "frame_sampling": "uniform", "epoch_pairs": "videos", "batch_size": 8, "epochs": 1, "optimizer": "adam",
        "clip_lr": 2.0e-6, "head_lr": 1.0e-5, "group_lr": {"radius": 3.0e-5}, "weight_decay": 0.1,
        "warmup_fraction": 0.1, "schedule": "cosine", "grad_clip": 1.0, "precision": "fp32",
        "init_from_clip": False}.items()},
    "head": {"num_samples": {"value": 3, "source": "choice: test"}, "num_frames": {"value": 4, "source": "choice"}},
    "published": {"source": "Table 9", "backbone": "tiny",
                  "t2v": {"R@1": 50.2, "R@5": 75.3, "R@10": 85.1, "MdR": 1.0, "MnR": 11.9}, "v2t": None},
}


def write_recipe(path: Path, doc: dict) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def changed(doc: dict, where: str, value) -> dict:
    """A deep copy of ``doc`` with the dotted key ``where`` set to ``value`` (None: removed)."""
    doc = json.loads(json.dumps(doc))
    *parents, last = where.split(".")
    node = doc
    for p in parents:
        node = node[p]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return doc


# ------------------------------------------------------------------------------ the shipped recipes


def test_every_shipped_recipe_parses_and_every_value_has_a_source():
    names = list_recipes()
    recipes = [load_recipe(n) for n in names]
    assert {r.method for r in recipes} >= PAPERS | BASELINES  # every paper, and the baselines
    for r in recipes:
        assert list(r.settings) == list(SETTINGS), r.name
        for key, s in [*r.settings.items(), *r.head.items(), ("split_set", r.split_set)]:
            assert isinstance(s.source, str) and len(s.source) > 5, (r.name, key)
        assert r.settings["end_to_end"].value is True, r.name  # the papers finetune CLIP
        for k, allowed in IMPLEMENTED.items():
            assert r.settings[k].value in allowed
        if r.published is not None:
            for direction, row in r.published.metrics.items():
                recalls = [row[m] for m in ("R@1", "R@5", "R@10") if row[m] is not None]
                assert recalls == sorted(recalls) and all(0 < x <= 100 for x in recalls), (r.name, direction)
                assert row["MdR"] is None or row["MdR"] >= 1
    # each of the four papers ships its MSR-VTT row with the numbers it publishes
    for paper in PAPERS:
        r = load_recipe(f"{paper}-msrvtt")
        assert r.dataset == "msrvtt" and r.published is not None and r.published.metrics["t2v"]["R@1"] > 40


def test_paper_protocols_as_the_papers_state_them():
    """The settings the papers state in words (Sec. 4.1 of each; ProTA Supp. B)."""
    uatvr, prota, tmass = (load_recipe(f"{p}-msrvtt").values() for p in ("uatvr", "prota", "tmass"))
    assert (uatvr["optimizer"], uatvr["batch_size"], uatvr["head_lr"], uatvr["epochs"]) == ("adam", 64, 5e-5, 5)
    assert (prota["batch_size"], prota["clip_lr"], prota["head_lr"], prota["init_from_clip"]) == (128, 1e-7, 1e-3, True)
    assert load_recipe("prota-didemo").values()["epochs"] == 10
    assert (load_recipe("prota-didemo").values()["frames"], load_recipe("prota-didemo").values()["max_words"]) == (64, 64)
    assert (tmass["optimizer"], tmass["batch_size"], tmass["clip_lr"], tmass["frames"]) == ("adamw", 32, 1e-6, 12)
    assert tmass["group_lr"]["radius"] == 3e-5
    assert load_recipe("tmass-msrvtt").head_overrides().get("num_samples", 20) == 20


@pytest.mark.parametrize("where, value, message", [
    ("settings.batch_size", None, "settings missing batch_size"),
    ("settings.head_lr", {"value": "3e-5", "source": "x"}, "YAML reads 3e-5 as text"),
    ("settings.clip_lr", {"value": 1.0e-6}, "expected {value: ..., source"),
    ("settings.epochs", {"value": 5, "source": " "}, "the source must be"),
    ("settings.optimizer", {"value": "sgd", "source": "x"}, "--optimizer must be one of adamw, adam"),
    ("settings.schedule", {"value": "linear", "source": "x"}, "tvrpipe implements cosine"),
    ("head.no_such_field", {"value": 1, "source": "x"}, "head.no_such_field is not a field of tmass's config"),
    ("published.t2v", {"R@1": 1.0}, "expected the metrics R@1, R@5, R@10, MdR, MnR"),
    ("method", "nohead", "method 'nohead' is not a head"),
    ("dataset", None, "a recipe has the keys"),
])
def test_a_broken_recipe_is_one_error_naming_the_file_and_key(tmp_path, where, value, message):
    path = write_recipe(tmp_path / "broken.yaml", changed(TINY_TMASS, where, value))
    with pytest.raises(ConfigError, match="broken.yaml") as e:
        load_recipe(path)
    assert message in str(e.value)


def test_unknown_recipe_lists_the_shipped_ones():
    with pytest.raises(ConfigError, match="no such recipe.*tmass-msrvtt"):
        load_recipe("tmass-nowhere")
    with pytest.raises(ConfigError, match="a recipe file is YAML ending in .yaml"):
        load_recipe(__file__)


def test_train_head_names_a_bad_option_before_looking_for_a_store(tmp_path, monkeypatch, cli):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TVRPIPE_FEATURES", raising=False)
    result = cli("train-head", "--recipe", "tmass-msrvtt", "--optimizer", "sgd")
    assert result.exit_code == 1 and "--optimizer must be one of adamw, adam" in result.output
    assert "no feature store" not in result.output


def test_resolve_takes_the_recipe_unless_an_option_is_explicit(tmp_path):
    r = load_recipe(write_recipe(tmp_path / "r.yaml", TINY_TMASS))
    values, overridden = resolve(r, {})
    assert values["head_lr"] == 1e-5 and values["group_lr"] == {"radius": 3e-5} and overridden == []
    values, overridden = resolve(r, {"head_lr": 2e-5, "group_lr": {"head": 4e-5}, "epochs": 1})
    assert values["head_lr"] == 2e-5  # the explicit option wins
    assert values["group_lr"] == {"radius": 3e-5, "head": 4e-5}  # groups merge
    assert sorted(overridden) == ["group_lr.head", "head_lr"]  # per group; epochs=1 is the recipe's own value


# ------------------------------------------------------------------------------ finetune --recipe


@pytest.fixture(scope="module")
def recipe_run(synth, tmp_path_factory):
    """finetune --recipe (the tiny T-MASS one) with --head-lr given explicitly, one epoch."""
    from typer.testing import CliRunner

    from tvrpipe.cli.main import app

    tmp = tmp_path_factory.mktemp("recipe-run")
    recipe = write_recipe(tmp / "tiny-tmass.yaml", TINY_TMASS)
    out = tmp / "run"
    result = CliRunner().invoke(app, ["finetune", "--recipe", str(recipe), "--manifest", str(synth / "manifest"),
                                      "--video-root", str(synth / "videos"), "--out", str(out), "--head-lr", "2e-5",
                                      "--loader-workers", "0"])
    assert result.exit_code == 0, result.output
    return out, result.output


def test_recipe_run_records_the_recipe_and_every_resolved_value(recipe_run):
    out, output = recipe_run
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["recipe"]["name"] == "tiny-tmass" and config["recipe"]["overridden"] == ["head_lr"]
    assert len(config["recipe"]["sha256"]) == 64
    ft = config["finetune"]
    assert (ft["optimizer"], ft["batch_size"], ft["clip_lr"], ft["head_lr"], ft["group_lr"], ft["weight_decay"]) == (
        "adam", 8, 2e-6, 2e-5, {"radius": 3e-5}, 0.1)
    assert (config["head"]["num_samples"], config["provenance"]["frames"]) == (3, 4)
    assert "overridden: head_lr" in output


def test_recipe_sets_the_optimizer_groups_as_written(recipe_run):
    """The optimiser state of the run: Adam (not AdamW), CLIP at clip_lr, T-MASS's radius module at its own
    rate, the rest of the head at the explicit --head-lr; decay on weight matrices only."""
    from tvrpipe.rundir import load_head

    out, _ = recipe_run
    state = torch.load(out / "checkpoints" / "state.pt", weights_only=False)
    groups = state["optimizer"]["param_groups"]
    assert all(g["decoupled_weight_decay"] is False for g in groups)  # torch's Adam: decay in the gradient
    by_lr = {}
    for g in groups:
        by_lr.setdefault(g["base_lr"], 0)
        by_lr[g["base_lr"]] += len(g["params"])
        assert g["weight_decay"] in (0.0, 0.1)
    assert set(by_lr) == {2e-6, 2e-5, 3e-5}
    head = load_head(out / "checkpoints" / "last.safetensors")
    radius = sum(1 for p in head.param_groups()["radius"])
    assert by_lr[3e-5] == radius  # exactly the radius module's parameters


def test_dry_run_writes_nothing_and_says_what_the_run_will_do(synth, tmp_path, cli):
    recipe = write_recipe(tmp_path / "tiny-tmass.yaml", TINY_TMASS)
    before = sorted(p for p in Path(synth).rglob("*")) + sorted(tmp_path.rglob("*"))
    result = cli("finetune", "--recipe", recipe, "--manifest", synth / "manifest", "--video-root", synth / "videos",
                 "--out", tmp_path / "run", "--dry-run", "--batch-size", "4")
    assert result.exit_code == 0, result.output
    after = sorted(p for p in Path(synth).rglob("*")) + sorted(tmp_path.rglob("*"))
    assert after == before and not (tmp_path / "run").exists()
    text = " ".join(result.output.split())
    from tvrpipe.data.manifest import read_manifest

    counts = read_manifest(synth / "manifest").videos["split"].value_counts()
    assert f"train {counts['train']} videos" in text and f"test {counts['test']} videos" in text
    steps = counts["train"] // 4  # epoch_pairs videos: one caption per training video, 4 a step
    assert f"steps: {steps} an epoch x 1 epochs = {steps}" in text
    assert "4 pairs, 16 images a step" in text  # 4 pairs x 4 frames
    assert "estimated peak memory per worker" in text and "an estimate" in text
    assert "optimizer=adam" in text and "batch_size=4" in text


def test_a_recipe_switch_can_be_turned_off(synth, tmp_path, cli):
    doc = changed(TINY_TMASS, "settings.init_from_clip", {"value": True, "source": "x"})
    recipe = write_recipe(tmp_path / "r.yaml", doc)
    result = cli("finetune", "--recipe", recipe, "--manifest", synth / "manifest", "--video-root", synth / "videos",
                 "--out", tmp_path / "run", "--dry-run", "--frozen-clip", "--no-init-from-clip")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "end_to_end=False" in text and "init_from_clip=False" in text
    assert "overridden: end_to_end, init_from_clip" in text


def test_dry_run_checks_what_a_run_checks(synth, tmp_path, cli):
    recipe = write_recipe(tmp_path / "r.yaml", TINY_TMASS)
    result = cli("finetune", "--recipe", recipe, "--manifest", synth / "manifest", "--video-root", tmp_path,
                 "--out", tmp_path / "run", "--dry-run")
    assert result.exit_code == 1 and "not files under --video-root" in result.output
    result = cli("finetune", "--recipe", recipe, "--manifest", synth / "manifest", "--video-root", synth / "videos",
                 "--out", tmp_path / "run", "--dry-run", "--group-lr", "fusion=1e-4")
    assert result.exit_code == 1 and "--group-lr fusion: tmass has the parameter groups head, radius" in result.output
    assert not (tmp_path / "run").exists()


def test_recipe_finds_its_dataset_under_the_data_root(synth, tmp_path, cli, monkeypatch):
    """Without --manifest and --video-root a recipe's dataset comes from the data root, and --out defaults
    to runs/<recipe>."""
    shutil.copytree(synth, tmp_path / "data" / "synthetic")
    recipe = write_recipe(tmp_path / "tiny-tmass.yaml", TINY_TMASS)
    monkeypatch.chdir(tmp_path)
    result = cli("finetune", "--recipe", recipe, "--data-root", tmp_path / "data", "--dry-run")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert f"the run would write {tmp_path / 'runs' / 'tiny-tmass'}" in text and not (tmp_path / "runs").exists()


def test_recipe_and_method_must_agree(synth, tmp_path, cli):
    result = cli("finetune", "--recipe", "tmass-msrvtt", "--method", "xpool", "--dry-run")
    assert result.exit_code == 1 and "recipe tmass-msrvtt trains tmass" in result.output


# ------------------------------------------------------------------------------ the memory estimate


def test_saved_activation_bytes_counts_what_autograd_keeps():
    """A bias-free linear layer keeps its input for the weight's gradient (weights excluded), a ReLU its output."""
    from tvrpipe.training.plan import saved_activation_bytes

    lin = torch.nn.Linear(16, 8, bias=False)
    x = torch.randn(5, 16)

    def step():
        torch.relu(lin(x)).sum().backward()
    exclude = {p.untyped_storage().data_ptr() for p in lin.parameters()}
    assert saved_activation_bytes(step, exclude) == 5 * 16 * 4 + 5 * 8 * 4


def test_fit_quadratic_is_exact_and_drops_a_negative_curvature():
    from tvrpipe.training.plan import fit_quadratic

    points = [(n, 100 + 30 * n + 7 * n * n) for n in (2, 3, 4)]
    np.testing.assert_allclose(fit_quadratic(points), [100, 30, 7], rtol=1e-9)
    a, b, c = fit_quadratic([(2, 10), (3, 20), (4, 24)])  # concave: the line through the ends
    assert c == 0 and b == 7 and a == -4


def test_estimate_grows_with_the_batch_and_counts_the_optimizer(synth):
    """The estimate's parts: Adam keeps two fp32 moments per trainable weight; frozen CLIP has no gradient."""
    from tvrpipe.features.clip import load_clip
    from tvrpipe.heads.base import clip_head_config, head_class
    from tvrpipe.training.live import LiveModel
    from tvrpipe.training.plan import estimate_step_memory

    bundle = load_clip("tvrpipe-tiny", "none")
    head = head_class("xpool")(clip_head_config("xpool", bundle.embed_dim, bundle.logit_scale, {}))
    model = LiveModel(bundle, head, True, "fp32")
    bundle.model.requires_grad_(True)  # end-to-end, as finetune sets it
    small = estimate_step_memory(model, ["a red ball", "a blue square"], 4, 8, 8)
    big = estimate_step_memory(model, ["a red ball", "a blue square"], 4, 8, 32)
    n_params = sum(p.numel() for p in model.parameters())
    assert small.optimizer == 2 * 4 * n_params and small.gradients == 4 * n_params
    assert big.activations > 3 * small.activations > 0 and big.total > small.total
    frozen = LiveModel(bundle, head, False, "fp32")
    bundle.model.requires_grad_(False)
    f = estimate_step_memory(frozen, ["a red ball"], 4, 8, 8)
    assert f.gradients == 4 * sum(p.numel() for p in head.parameters()) < small.gradients
    assert f.activations < small.activations


def test_with_several_workers_the_head_share_is_read_at_the_gathered_batch():
    """Ray Train gathers every worker's pairs before the head's loss: a head whose loss holds n x n terms
    (prota) costs more at 4 pairs of a 16-pair global batch than at 4 pairs alone; meanpool barely."""
    from tvrpipe.features.clip import load_clip
    from tvrpipe.heads.base import clip_head_config, head_class
    from tvrpipe.training.live import LiveModel
    from tvrpipe.training.plan import estimate_step_memory, head_activation_bytes

    bundle = load_clip("tvrpipe-tiny", "none")
    bundle.model.requires_grad_(True)
    extra = {}
    for method, overrides in (("prota", {"num_heads": 2}), ("meanpool", {})):
        head = head_class(method)(clip_head_config(method, bundle.embed_dim, bundle.logit_scale, overrides))
        model = LiveModel(bundle, head, True, "fp32")
        alone = estimate_step_memory(model, ["a red ball"], 4, 8, 4)
        assert estimate_step_memory(model, ["a red ball"], 4, 8, 4, gathered=4).activations == alone.activations
        extra[method] = estimate_step_memory(model, ["a red ball"], 4, 8, 4, gathered=16).activations - alone.activations
        share = [head_activation_bytes(head, n, 4, 8, bundle.embed_dim, set()) for n in (4, 16)]
        assert share[1] > share[0]
    assert extra["prota"] > 10 * extra["meanpool"] > 0


def _step(vision=(0.0, 50.0), text=(0.0, 20.0), precision="fp32", checkpointing=False):
    """A step's memory with round numbers: 8 pairs of 2 frames (10-byte images), 4 words, D = 2; 400 bytes of
    weights, gradients and moments; the head's loss 10 n + n^2 at the gathered 8 pairs (144)."""
    from tvrpipe.training.plan import StepMemory

    return StepMemory(precision=precision, grad_checkpointing=checkpointing, pairs=8, gathered=8, frames=2, max_words=4,
                      embed_dim=2, image_bytes=10, weights=100, gradients=100, optimizer=200, vision=vision, text=text,
                      head=(0.0, 10.0, 1.0))


def test_the_chunked_estimate_holds_clip_s_activations_for_one_chunk():
    step = _step()
    whole = step.at(None)  # CLIP 50 x 16 images + 20 x 8 captions; uint8 frames 160 + their float copy 640
    assert (whole.chunk, whole.clip_activations, whole.head_activations, whole.cached) == (8, 960, 144, 0)
    assert whole.inputs == 800 and whole.total == 400 + 800 + 960 + 144 == step.at(8).total == step.at(99).total
    two = step.at(2)  # CLIP for 2 pairs; the cached features' gradients: 8 pairs x (2 + 4 + 1) x 2 x 4 bytes
    assert (two.clip_activations, two.cached, two.inputs) == (240, 448, 160 + 160)
    assert two.total == 400 + 320 + 240 + 144 + 448 == 1552
    assert step.at(1).total == 1352 and step.at(3).total == 1752
    assert step.largest_chunk(1600) == 2 and step.largest_chunk(10**6) == 8 and step.largest_chunk(1351) is None


def test_the_advice_names_the_fewest_changes_that_fit():
    from tvrpipe.training.plan import advise

    steps = {("fp32", False): _step(), ("fp32", True): _step((0.0, 5.0), (0.0, 2.0), checkpointing=True),
             ("bf16", False): _step((0.0, 25.0), (0.0, 10.0), "bf16"),
             ("bf16", True): _step((0.0, 2.0), (0.0, 1.0), "bf16", True)}
    fits = advise(steps, "fp32", False, None, 4000)
    assert fits == {"budget": 4000, "fits": True, "total": 2304, "largest_chunk": 8, "needs": []}
    assert advise(steps, "fp32", False, None, 1600)["needs"] == ["--chunk-size 2"]  # chunking alone does it
    assert advise(steps, "fp32", False, 2, 1600)["fits"]
    # not one pair at a time as set (1352); checkpointing a pair at a time: 400 + 240 + 12 + 144 + 448 = 1244
    tight = advise(steps, "fp32", False, None, 1300)
    assert tight["largest_chunk"] is None and tight["needs"] == ["--grad-checkpointing", "--chunk-size 1"]
    assert advise(steps, "fp32", False, None, 1400)["needs"] == ["--chunk-size 1"]  # 1352
    steps[("fp32", True)] = _step(checkpointing=True)  # checkpointing that saves nothing: half precision it is,
    # a pair at a time: 400 + 240 + 50 + 10 + 144 + 448 = 1292 (bf16 with checkpointing would fit too, a change more)
    assert advise(steps, "fp32", False, None, 1300, half="fp16")["needs"] == ["--precision fp16", "--chunk-size 1"]
    assert advise(steps, "bf16", True, None, 1300)["needs"] == ["--chunk-size 1"]  # 1235; 1318 at 2
    assert advise(steps, "fp32", False, None, 500)["needs"] is None  # nothing fits the weights and the moments


def test_memory_sizes_parse_with_their_units():
    from tvrpipe.config import parse_memory

    assert parse_memory("24GiB") == 24 * 2**30 == parse_memory("24") == parse_memory(" 24 gib ")
    assert parse_memory("40GB") == 40 * 10**9 and parse_memory("81559MiB") == 81559 * 2**20
    assert parse_memory("0.5TiB") == 2**39
    for bad in ("", "0GiB", "-3GiB", "24 parsecs", "GiB", "nan"):
        with pytest.raises(ConfigError, match="--gpu-memory .*: give a size above 0 such as 24GiB"):
            parse_memory(bad)


def test_dry_run_plans_chunks_and_a_gpu_s_memory(synth, tmp_path, cli):
    """A recipe's chunk size reaches the plan and the run's record; --gpu-memory says what fits."""
    from tvrpipe.config import load_yaml

    doc = changed(TINY_TMASS, "settings.chunk_size", {"value": 2, "source": "choice: a small GPU"})
    recipe = write_recipe(tmp_path / "r.yaml", doc)
    args = ("finetune", "--recipe", recipe, "--manifest", synth / "manifest", "--video-root", synth / "videos",
            "--batch-size", "4")
    result = cli(*args, "--out", tmp_path / "dry", "--dry-run", "--gpu-memory", "80GiB")
    text = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert "chunk_size=2" in text and "CLIP encoding 2 of its 4 pairs at a time; the batch at once:" in text
    assert "GPU memory: the step fits 80.00 GiB per worker; the largest --chunk-size that fits: 4 (the batch at once)" in text
    result = cli(*args, "--out", tmp_path / "dry", "--dry-run", "--gpu-memory", "1MiB")
    text = " ".join(result.output.split())
    assert "does not fit 0.00 GiB per worker with any precision, gradient checkpointing or chunk size" in text
    result = cli(*args, "--out", tmp_path / "run", "--epochs", "1", "--gpu-memory", "24GiB")
    assert result.exit_code == 1 and "--gpu-memory is the dry run's question" in result.output
    assert not (tmp_path / "run").exists() and not (tmp_path / "dry").exists()
    result = cli(*args, "--out", tmp_path / "run", "--epochs", "1")
    assert result.exit_code == 0, result.output
    config = load_yaml((tmp_path / "run" / "config.yaml").read_bytes(), "config.yaml")
    assert config["execution"]["chunk_size"] == 2 and config["recipe"]["settings"]["chunk_size"] == 2
    assert "chunk_size" not in config["recipe"]["differs"] and config["recipe"]["overridden"] == ["batch_size"]
    # an explicit --chunk-size wins, and is no difference from the recipe either
    result = cli(*args, "--out", tmp_path / "run1", "--epochs", "1", "--chunk-size", "1")
    assert result.exit_code == 0, result.output
    config = load_yaml((tmp_path / "run1" / "config.yaml").read_bytes(), "config.yaml")
    assert config["execution"]["chunk_size"] == 1 and "chunk_size" not in config["recipe"]["differs"]


def test_recipes_memory_estimates_what_the_dry_run_estimates(synth, tmp_path, cli, monkeypatch):
    """`recipes memory` needs no dataset: its figure for a recipe is the dry run's on data of that recipe."""
    import re

    recipe = write_recipe(tmp_path / "r.yaml", TINY_TMASS)
    dry = cli("finetune", "--recipe", recipe, "--manifest", synth / "manifest", "--video-root", synth / "videos",
              "--out", tmp_path / "run", "--dry-run")
    assert dry.exit_code == 0, dry.output
    peak = re.search(r"estimated peak memory per worker: ([0-9.]+) GiB", " ".join(dry.output.split())).group(1)
    monkeypatch.setenv("COLUMNS", "200")  # the table's cells unwrapped
    result = cli("recipes", "memory", recipe, "--gpu-memory", "80GiB", "--gpu-memory", "1MiB")
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if line.strip("│ ").startswith("r "))
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert cells == ["r", "8 x 4", "fp32", f"{float(peak):.1f} GiB", "all", "none"]
    result = cli("recipes", "memory", recipe, "--num-workers", "3")  # 8 pairs do not split in 3
    assert result.exit_code == 1 and "--num-workers 3: recipe r's batch of 8 pairs is the global batch" in result.output


# ------------------------------------------------------------------------------ train-head --recipe


def test_train_head_recipe_trains_the_head_as_written(store, tmp_path, cli):
    recipe = write_recipe(tmp_path / "tiny-tmass.yaml", TINY_TMASS)
    out = tmp_path / "run"
    result = cli("train-head", "--recipe", recipe, "--features", store, "--out", out, "--epochs", "2",
                 "--no-prefetch")
    assert result.exit_code == 0, result.output
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["recipe"]["name"] == "tiny-tmass" and config["recipe"]["overridden"] == ["epochs"]
    train = config["train"]
    assert (train["optimizer"], train["batch_size"], train["lr"], train["group_lr"], train["epochs"]) == (
        "adam", 8, 1e-5, {"radius": 3e-5}, 2)
    assert config["resolved"]["lr_source"] == "recipe tiny-tmass" and config["head"]["num_samples"] == 3
    groups = torch.load(out / "checkpoints" / "state.pt", weights_only=False)["optimizer"]["param_groups"]
    assert sorted(g["base_lr"] for g in groups) == [1e-5, 3e-5]
    assert not any(g["decoupled_weight_decay"] for g in groups)


def test_train_head_group_lr_without_a_recipe(store, tmp_path, cli):
    result = cli("train-head", "--method", "tmass", "--features", store, "--out", tmp_path / "r", "--epochs", "1",
                 "--lr", "1e-3", "--group-lr", "radius=1e-2", "--no-prefetch")
    assert result.exit_code == 0, result.output
    groups = torch.load(tmp_path / "r" / "checkpoints" / "state.pt", weights_only=False)["optimizer"]["param_groups"]
    assert sorted(g["base_lr"] for g in groups) == [1e-3, 1e-2]
    result = cli("train-head", "--method", "xpool", "--features", store, "--out", tmp_path / "x", "--epochs", "1",
                 "--group-lr", "radius=1e-2")
    assert result.exit_code == 1 and "--group-lr radius: xpool has the parameter groups head" in result.output
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------ report


def test_report_prints_the_published_row_under_a_recipe_run(recipe_run, tmp_path, monkeypatch):
    from tvrpipe.report import write_report

    out, _ = recipe_run
    run = tmp_path / "runs" / "tiny"
    shutil.copytree(out, run)
    # the report reads the recipe by name: ship the test recipe where recipes are found
    from tvrpipe.training import recipes as recipes_module

    folder = tmp_path / "recipes"
    folder.mkdir()
    write_recipe(folder / "tiny-tmass.yaml", TINY_TMASS)
    monkeypatch.setattr(recipes_module, "recipes_dir", lambda: folder)
    path = write_report([tmp_path / "runs"], tmp_path / "report")
    text = path.read_text()
    line = next(x for x in text.splitlines() if x.startswith("| ↳ published"))
    assert "Table 9" in line and "| 50.2 | 75.3 | 85.1 | 1.0 | 11.9 |" in line
    rows = pd.read_csv(path.parent / "report.csv")
    pub = rows[rows["scores"] == "published"]
    assert len(pub) == 1 and pub.iloc[0]["direction"] == "t2v"
    assert [pub.iloc[0][m] for m in METRICS] == [50.2, 75.3, 85.1, 1.0, 11.9]


def test_recipes_command_lists_them_and_show_prints_every_source(cli):
    result = cli("recipes")
    assert result.exit_code == 0, result.output
    for name in list_recipes():
        assert name in result.output
    r = load_recipe("tmass-msrvtt")
    result = cli("recipes", "show", "tmass-msrvtt")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    for key in SETTINGS:
        assert key in text
    assert f"{r.published.metrics['t2v']['R@1']:.1f}" in text and "the head's default" in text


def test_reproduce_doc_holds_the_tables_of_the_shipped_recipes():
    """docs/reproduce.md lists every recipe with its settings and published row, as the recipes say now."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "scripts" / "recipe_tables.py"
    spec = importlib.util.spec_from_file_location("recipe_tables", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = module.DOC.read_text()
    assert text == module.document(text), "docs/reproduce.md is behind the recipes: python scripts/recipe_tables.py --write"
    assert all(f"`{n}`" in text for n in list_recipes())


def test_a_key_given_twice_in_a_recipe_file_is_refused_naming_its_line(tmp_path, cli):
    """yaml.safe_load keeps the last of two keys silently: a recipe read as batch_size 64 where it says 8 too."""
    text = yaml.safe_dump(TINY_TMASS, sort_keys=False)
    line = text.splitlines().index("  epochs:") + 1  # the second batch_size goes there
    path = tmp_path / "twice.yaml"
    path.write_text(text.replace("  epochs:\n", "  batch_size:\n    value: 64\n    source: x\n  epochs:\n", 1))
    result = cli("recipes", "show", path)
    assert result.exit_code == 1
    assert " ".join(result.output.split()) == f"error: {path} line {line}: key 'batch_size' is given twice; keep one"


@pytest.mark.parametrize("metric, value, message", [
    ("R@1", -5, "published.t2v.R@1 -5 is not a recall in [0, 100]"),
    ("R@5", 175.3, "published.t2v.R@5 175.3 is not a recall in [0, 100]"),
    ("MdR", 0.5, "published.t2v.MdR 0.5 is not a rank >= 1"),
    ("MnR", 0, "published.t2v.MnR 0 is not a rank >= 1"),
])
def test_a_published_number_out_of_its_range_is_refused(tmp_path, cli, metric, value, message):
    path = write_recipe(tmp_path / "r.yaml", changed(TINY_TMASS, f"published.t2v.{metric}", value))
    result = cli("recipes", "show", path)
    assert result.exit_code == 1 and " ".join(result.output.split()) == f"error: {path}: {message}"


def test_published_numbers_at_their_bounds_load(tmp_path):
    doc = changed(changed(TINY_TMASS, "published.t2v.R@1", 0), "published.t2v.R@10", 100)
    r = load_recipe(write_recipe(tmp_path / "r.yaml", changed(doc, "published.t2v.MnR", 1)))
    assert (r.published.metrics["t2v"]["R@1"], r.published.metrics["t2v"]["R@10"]) == (0.0, 100.0)
