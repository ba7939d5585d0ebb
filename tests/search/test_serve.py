"""``tvrpipe serve``: the JSON API against ``tvrpipe search``'s own ranking, the media route's safety (ids only,
nothing outside the video root is read, Range requests), the host warning, and the page in a real headless
Chromium driven by Playwright (a hit's player loads and seeks to the hit's moment; a minimum score typed in its
field cuts the hits shown, and one outside the head's scores is refused on the page)."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("starlette", reason="tvrpipe serve needs the 'serve' extra (make install installs it)")
pytest.importorskip("httpx", reason="Starlette's TestClient needs httpx (the 'dev' extra)")

from starlette.testclient import TestClient  # noqa: E402
from tiny_clip import as_tiny_clip_store  # noqa: E402

from tvrpipe.search import serve as serve_mod  # noqa: E402
from tvrpipe.search.engine import DEFAULT_TOP_K, open_searcher, search  # noqa: E402
from tvrpipe.search.serve import exposure_warning, make_app, open_server  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
N_FILES = 3
SECRET = b"outside the video root: never served"


def _mp4(path: Path, seconds: float = 4.0, fps: int = 10) -> None:
    """A small H.264 mp4 (Chromium plays it), a colour ramp so frames differ. Written with tvrpipe's own writer:
    libvpx (WebM) cannot be opened once decord's bundled libavcodec is loaded in the process, as it is when the
    whole suite runs."""
    from tvrpipe.data.synth import write_mp4

    n = int(seconds * fps)
    frames = np.stack([np.full((48, 64, 3), (i * 6) % 256, np.uint8) for i in range(n)])
    write_mp4(path, frames, fps)


def _tiny_clip_store(path: Path, seed: int) -> Path:
    """A generated store of the tiny CLIP's width (the world of ``seed``), relabelled as extracted with it."""
    from tvrpipe.features.genstore import GenSpec, generate_store

    spec = GenSpec(train_videos=8, test_videos=4, captions_per_train_video=1, frames=4, max_words=8, embed_dim=64,
                   seed=seed)
    return as_tiny_clip_store(generate_store(path, spec, video_shard=8, text_shard=16))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A store of the tiny CLIP's width relabelled as extracted with it (as test_search does), its videos pointed
    at real WebM files under a video root, each a moment of a file; beside the root, a secret file, reached from
    the store by a symlink inside the root and by a ``../`` path."""
    base = tmp_path_factory.mktemp("serve")
    store = _tiny_clip_store(base / "store", seed=3)
    root = base / "videos"
    root.mkdir()
    for i in range(N_FILES):
        _mp4(root / f"v{i}.mp4")
    (base / "secret.mp4").write_bytes(SECRET)
    (root / "link.mp4").symlink_to(base / "secret.mp4")
    videos = pd.read_parquet(store / "videos.parquet")
    n = len(videos)
    videos["path"] = [f"v{i % N_FILES}.mp4" for i in range(n)]
    videos["start_s"] = [1.0 + 0.5 * (i % 3) for i in range(n)]
    videos["end_s"] = videos["start_s"] + 1.0
    videos.loc[n - 2, "path"] = "link.mp4"  # a symlink inside the root to a file outside it
    videos.loc[n - 1, "path"] = "../secret.mp4"  # a path that leaves the root
    videos.to_parquet(store / "videos.parquet")
    return store, root, videos


@pytest.fixture(scope="module")
def server(site):
    store, root, _ = site
    return open_server(store, video_root=root)


@pytest.fixture(scope="module")
def client(server):
    return TestClient(make_app(server))


def test_the_defaults_agree_with_the_engines():
    assert serve_mod.DEFAULT_TOP_K == DEFAULT_TOP_K


def test_the_json_hits_are_tvrpipe_searchs(site, server, client):
    store, root, _ = site
    r = client.get("/search", params={"q": "a dog runs on a beach", "k": 5})
    assert r.status_code == 200
    body = r.json()
    want = search(open_searcher(store, video_root=root), ["a dog runs on a beach"], 5).hits
    assert [h["video_id"] for h in body["hits"]] == [h.video_id for h in want]
    assert [h["score"] for h in body["hits"]] == pytest.approx([h.score for h in want], abs=1e-6)
    assert body["ranked_by"] == server.searcher.label and body["score"] == server.searcher.head.meaning()
    first = body["hits"][0]
    assert first["media"].startswith("/media/") and first["media"].endswith(f"#t={first['start_s']:.2f},"
                                                                           f"{first['end_s']:.2f}")


def test_bad_queries_are_400_with_the_reason(client):
    assert client.get("/search", params={"q": "  "}).status_code == 400
    r = client.get("/search", params={"q": "a cat", "k": 100000})
    assert r.status_code == 400 and "--top-k 100000" in r.json()["error"]
    assert client.get("/search", params={"q": "a cat", "k": "x"}).status_code == 400
    assert client.post("/search").status_code == 400


def test_a_picture_is_searched_as_search_image_searches_it(site, client, tmp_path):
    from PIL import Image

    store, root, _ = site
    pic = tmp_path / "red.png"
    Image.new("RGB", (40, 30), (200, 30, 30)).save(pic)
    r = client.post("/search", params={"k": 3}, files={"image": ("red.png", pic.read_bytes(), "image/png")})
    assert r.status_code == 200, r.text
    want = search(open_searcher(store, video_root=root), [str(pic)], 3, images=True).hits
    assert [h["video_id"] for h in r.json()["hits"]] == [h.video_id for h in want]
    assert {h["query"] for h in r.json()["hits"]} == {"red.png"}
    bad = client.post("/search", files={"image": ("x.png", b"not a picture", "image/png")})
    assert bad.status_code == 400


def test_the_page_shows_hits_with_thumbnails_meanings_and_players(client, server):
    r = client.get("/", params={"q": "a dog"})
    assert r.status_code == 200
    page = r.text
    assert page.count('<tr class="hit">') == DEFAULT_TOP_K
    assert "data:image/jpeg;base64," in page and '<video controls preload="metadata"' in page
    assert server.searcher.head.meaning() in page.replace("&#x27;", "'")
    assert client.get("/").status_code == 200 and '<tr class="hit">' not in client.get("/").text


def test_media_is_served_by_id_with_range_requests(site, client):
    _, root, videos = site
    vid = videos.video_id[0]
    whole = client.get(f"/media/{vid}")
    assert whole.status_code == 200 and whole.content == (root / "v0.mp4").read_bytes()
    part = client.get(f"/media/{vid}", headers={"Range": "bytes=10-19"})
    assert part.status_code == 206 and part.content == whole.content[10:20]
    assert part.headers["content-range"] == f"bytes 10-19/{len(whole.content)}"


def test_media_never_reads_outside_the_root(site, client, tmp_path, monkeypatch):
    """Unknown ids, paths in the request (plain and encoded ``..``), a symlink out of the root, a ``../`` path in
    the store and an id of another store: all 404, and no file outside the root is opened."""
    from starlette import responses

    _, root, videos = site
    served = []
    real = responses.FileResponse.__init__

    def spy(self, path, *a, **kw):
        served.append(Path(path))
        real(self, path, *a, **kw)

    monkeypatch.setattr(responses.FileResponse, "__init__", spy)
    n = len(videos)
    secret = str(root.parent / "secret.mp4")
    for url in ["/media/no-such-video", "/media/v0.mp4", "/media/..%2Fsecret.mp4", "/media/%2E%2E/secret.mp4",
                "/media/..%2F..%2F..%2Fetc%2Fpasswd", f"/media/{secret}", f"/media/{secret.lstrip('/')}",
                f"/media/{videos.video_id[n - 2]}", f"/media/{videos.video_id[n - 1]}", "/media/other_store_0001",
                "/media/", "/media/%00"]:
        r = client.get(url)
        assert r.status_code in (400, 404), url
        assert SECRET not in r.content
    assert served == []
    client.get(f"/media/{videos.video_id[0]}")
    assert served == [(root / "v0.mp4").resolve()]


def test_loopback_binds_quietly_and_another_address_is_warned_about():
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert exposure_warning(host) is None
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.org"):
        assert "anyone who can reach" in exposure_warning(host)


def test_the_cli_warns_for_another_host_and_serves_what_it_loaded(site, cli, monkeypatch):
    store, root, _ = site
    called = {}
    monkeypatch.setattr(serve_mod, "serve", lambda server, host, port: called.update(host=host, port=port))
    r = cli("serve", "--features", store, "--video-root", root, "--host", "0.0.0.0", "--port", "8123")
    assert r.exit_code == 0, r.output
    assert "anyone who can reach" in r.output and called == {"host": "0.0.0.0", "port": 8123}
    r = cli("serve", "--features", store, "--video-root", root)
    assert r.exit_code == 0 and "warning" not in r.output and called["host"] == "127.0.0.1"


# ------------------------------------------------------------------------------------------ a real browser


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_browser_searches_and_the_player_seeks_to_the_hits_moment(server):
    from tvrpipe.errors import ConfigError
    from tvrpipe.search.engine import check_min_score

    if not Path(CHROMIUM).exists() and not shutil.which("chromium"):
        pytest.skip(f"no Chromium at {CHROMIUM} or on PATH (apt-get install chromium; .ci/run installs it)")
    playwright = pytest.importorskip("playwright.sync_api", reason="the playwright package (the 'dev' extra)")
    import uvicorn

    port = _free_port()
    uv = uvicorn.Server(uvicorn.Config(make_app(server), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not uv.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        exe = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--autoplay-policy="
                                                                   "no-user-gesture-required"])
            try:
                page = browser.new_page()
                page.goto(f"http://127.0.0.1:{port}/", timeout=15000)
                q = "a dog runs on a beach"
                page.fill("input[name=q]", q)
                page.click("form[method=get] button")
                page.wait_for_selector("tr.hit", timeout=15000)
                assert page.locator("tr.hit").count() == DEFAULT_TOP_K
                video = page.locator("tr.hit video").first
                start = float(video.get_attribute("data-start"))
                assert start > 0
                # the player loads the file and seeks to the fragment's start (#t=start,end)
                page.wait_for_function("v => v.readyState >= 1 && !v.error", arg=video.element_handle(),
                                       timeout=15000)
                page.wait_for_function("([v, t]) => Math.abs(v.currentTime - t) < 0.15",
                                       arg=[video.element_handle(), start], timeout=15000)
                assert video.evaluate("v => v.duration") == pytest.approx(4.0, abs=0.2)
                assert page.evaluate("Array.from(document.images).every(i => i.complete && i.naturalWidth > 0)")

                # a minimum score typed in the page's field cuts the hits below it, as search --min-score does
                scores = [h.score for h in server.search([q], DEFAULT_TOP_K).hits]
                x = (scores[1] + scores[2]) / 2  # the top 2 kept
                page.fill("form[method=get] input[name=min_score]", f"{x:.10g}")
                page.click("form[method=get] button")
                page.wait_for_selector("p.note", timeout=15000)
                assert page.locator("tr.hit").count() == 2
                shown = [float(c) for c in page.locator("tr.hit td.num:nth-child(4)").all_inner_texts()]
                assert shown == pytest.approx(scores[:2], abs=1e-4) and min(shown) >= x - 1e-4
                assert page.locator("p.note").inner_text() == (f"{DEFAULT_TOP_K - 2} of the top {DEFAULT_TOP_K} "
                                                               f"hits scored below --min-score {x:.10g} and were cut")
                assert page.input_value("form[method=get] input[name=min_score]") == f"{x:.10g}"  # kept for the next
                # one outside the head's scores: the page says why, with the message search prints
                with pytest.raises(ConfigError) as want:
                    check_min_score(server.searcher, 2.0)
                page.fill("form[method=get] input[name=min_score]", "2")
                page.click("form[method=get] button")
                page.wait_for_selector("p.error", timeout=15000)
                assert page.locator("p.error").inner_text() == f"error: {want.value}"
                assert page.locator("tr.hit").count() == 0
            finally:
                browser.close()
    finally:
        uv.should_exit = True
        thread.join(10)


def test_a_picture_posted_to_the_page_shows_its_hits(client, tmp_path):
    from PIL import Image

    pic = tmp_path / "blue.png"
    Image.new("RGB", (40, 30), (20, 30, 200)).save(pic)
    r = client.post("/", params={"k": 2}, files={"image": ("blue.png", pic.read_bytes(), "image/png")})
    assert r.status_code == 200 and r.text.count('<tr class="hit">') == 2 and "Picture: &ldquo;blue.png" in r.text
    assert client.post("/").status_code == 400
    # the picture form's own min score field cuts as the query form's does
    scores = [h["score"] for h in client.post("/search", params={"k": 2}, files={
        "image": ("blue.png", pic.read_bytes(), "image/png")}).json()["hits"]]
    cut = client.post("/", params={"k": 2}, data={"min_score": f"{(scores[0] + scores[1]) / 2:.10g}"},
                      files={"image": ("blue.png", pic.read_bytes(), "image/png")})
    assert cut.status_code == 200 and cut.text.count('<tr class="hit">') == 1 and "1 of the top 2 hits" in cut.text
    bad = client.post("/", data={"min_score": "2"}, files={"image": ("blue.png", pic.read_bytes(), "image/png")})
    assert bad.status_code == 400 and "--min-score 2 is outside the scores" in bad.text


# ------------------------------------------------------------------------------------------------ min_score


def test_min_score_cuts_as_search_min_score_cuts(site, client):
    store, root, _ = site
    q = "a dog runs on a beach"
    full = search(open_searcher(store, video_root=root), [q], 6).hits
    x = (full[1].score + full[2].score) / 2  # the top 2 kept, 4 cut
    want = search(open_searcher(store, video_root=root), [q], 6, min_score=x)
    r = client.get("/search", params={"q": q, "k": 6, "min_score": x})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [h["video_id"] for h in body["hits"]] == [h.video_id for h in want.hits] == [h.video_id for h in full[:2]]
    assert body["note"] == want.note(q) == f"4 of the top 6 hits scored below --min-score {x:.10g} and were cut"
    assert client.get("/search", params={"q": q, "k": 6}).json()["note"] is None
    page = client.get("/", params={"q": q, "k": 6, "min_score": x})
    assert page.text.count('<tr class="hit">') == 2 and "4 of the top 6 hits scored below" in page.text


def test_a_min_score_outside_the_heads_scores_is_400_with_searchs_message(site, server, client):
    from tvrpipe.errors import ConfigError
    from tvrpipe.search.engine import check_min_score

    with pytest.raises(ConfigError) as want:
        check_min_score(server.searcher, 2.0)
    r = client.get("/search", params={"q": "a cat", "min_score": 2.0})
    assert r.status_code == 400 and r.json()["error"] == str(want.value)
    assert client.get("/search", params={"q": "a cat", "min_score": "x"}).status_code == 400
    assert client.get("/search", params={"q": "a cat", "min_score": "nan"}).status_code == 400
    assert client.get("/", params={"q": "a cat", "min_score": 2.0}).status_code == 400


def test_serve_min_score_is_the_default_cut_and_is_checked_at_start(site, cli, monkeypatch):
    store, root, _ = site
    got = {}
    monkeypatch.setattr(serve_mod, "serve", lambda server, host, port: got.update(server=server))
    r = cli("serve", "--features", store, "--video-root", root, "--min-score", "0.01")
    assert r.exit_code == 0, r.output
    found = got["server"].search(["a dog"], 5)
    assert found.min_score == 0.01 and all(h.score >= 0.01 for h in found.hits)
    r = cli("serve", "--features", store, "--video-root", root, "--min-score", "5")
    assert r.exit_code == 1 and "--min-score 5 is outside the scores" in r.output


# ---------------------------------------------------------------------------------- a store updated while serving


def _replace(store: Path, new: Path) -> None:
    """``new`` where ``store`` was, as an extract writing a new store there leaves it."""
    shutil.rmtree(store)
    new.rename(store)


def _ids(client, q: str = "a dog runs on a beach", k: int = 5) -> list[str]:
    r = client.get("/search", params={"q": q, "k": k})
    assert r.status_code == 200, r.text
    return [h["video_id"] for h in r.json()["hits"]]


def _want(store: Path, q: str = "a dog runs on a beach", k: int = 5) -> list[str]:
    return [h.video_id for h in search(open_searcher(store), [q], k).hits]


def test_a_store_written_again_is_served_once_complete_and_unlocked(tmp_path, caplog):
    import zarr

    from tvrpipe.lock import DirLock

    store = _tiny_clip_store(tmp_path / "store", seed=3)
    server = open_server(store)
    server.check_seconds = 0.0
    client = TestClient(make_app(server))
    old = _want(store)
    assert _ids(client) == old
    first = server.current

    # being written (an extract resuming in place): its lock held, then released with the store incomplete; the
    # store's files are those served, so the answers are the old ones
    attrs = zarr.open_group(str(store / "features.zarr"), mode="a").attrs
    lock = DirLock(store)
    try:
        attrs["complete"] = False
        assert _ids(client) == old and server.current is first
    finally:
        lock.release()
    assert _ids(client) == old and server.current is first

    # another store written in its place, still locked: not picked up (the head then reads the new files under
    # the old ids, the hazard docs/search.md names); once unlocked and complete, the next request serves it
    new = _tiny_clip_store(tmp_path / "new", seed=11)
    lock = DirLock(new)
    try:
        _replace(store, new)
        _ids(client)
        assert server.current is first
    finally:
        lock.release()
    now = _want(store)
    assert now != old
    assert _ids(client) == now and server.current is not first
    assert server.searcher._bundle is first.searcher._bundle  # the query CLIP kept, not loaded again

    # a new store that cannot be opened (its table damaged) keeps the last one, logged once
    second = server.current
    (store / "videos.parquet").write_bytes(b"not parquet")
    with caplog.at_level("WARNING", logger="tvrpipe.search.serve"):
        assert _ids(client) == now and _ids(client) == now
    assert server.current is second
    assert sum("opening it again failed" in r.message for r in caplog.records) == 1


def test_the_store_is_checked_at_most_once_per_interval(tmp_path, monkeypatch):
    store = _tiny_clip_store(tmp_path / "store", seed=3)
    server = open_server(store)
    calls = []
    monkeypatch.setattr(serve_mod, "store_signature", lambda d: calls.append(d) or server.current.signature)
    client = TestClient(make_app(server))
    for _ in range(5):
        _ids(client)
    assert len(calls) <= 1
