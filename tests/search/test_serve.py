"""``tvrpipe serve``: the JSON API against ``tvrpipe search``'s own ranking, the media route's safety (ids only,
nothing outside the video root is read, Range requests), what a client sends that is refused (a Host of another
site, a picture over the cap while it streams in, a picture with a sentence) and what it can never make (a path
from an upload's name), the host warning and the socket bound before anything loads, and the page in a real
headless Chromium driven by Playwright (a hit's player loads and seeks to the hit's moment; a minimum score typed
in its field cuts the hits shown, and one outside the head's scores is refused on the page)."""

from __future__ import annotations

import dataclasses
import shutil
import signal
import socket
import subprocess
import sys
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

from tvrpipe.errors import ConfigError  # noqa: E402
from tvrpipe.search import serve as serve_mod  # noqa: E402
from tvrpipe.search.engine import DEFAULT_TOP_K, open_searcher, search  # noqa: E402
from tvrpipe.search.serve import (  # noqa: E402
    allowed_hosts,
    check_allowed_hosts,
    exposure_warning,
    listen,
    make_app,
    open_server,
)

CHROMIUM = "/usr/bin/chromium"
BASE = "http://127.0.0.1:8000"  # the address make_app's server answers by default (the CLI's default --host, --port)
N_FILES = 3
SECRET = b"outside the video root: never served"


def _mp4(path: Path, seconds: float = 4.0, fps: int = 10) -> None:
    """A small H.264 mp4 (Chromium plays it), a colour ramp so frames differ. Written with tvrpipe's own writer:
    libvpx (WebM) cannot be opened once decord's bundled libavcodec is loaded in the process, as it is when the
    whole suite runs."""
    from tvrpipe.worlds.videos import write_mp4

    n = int(seconds * fps)
    frames = np.stack([np.full((48, 64, 3), (i * 6) % 256, np.uint8) for i in range(n)])
    write_mp4(path, frames, fps)


def _tiny_clip_store(path: Path, seed: int, train: int = 8, test: int = 4) -> Path:
    """A generated store of the tiny CLIP's width (the world of ``seed``), relabelled as extracted with it."""
    from tvrpipe.worlds.features import GenSpec, generate_store

    spec = GenSpec(train_videos=train, test_videos=test, captions_per_train_video=1, frames=4, max_words=8,
                   embed_dim=64, seed=seed)
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
    return TestClient(make_app(server), base_url=BASE)


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
    assert r.status_code == 400 and r.json()["error"].startswith("k=100000 is more than the")  # what was typed
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


def test_a_hit_whose_file_media_does_not_serve_has_no_player(site, server, client, monkeypatch):
    """Where /media/ID answers 404 (a symlink or a path leading out of the root, a missing file, no video root),
    the JSON's ``media`` is null and the page says ``no file`` instead of a player that cannot load; each video's
    path is resolved once per request."""
    from urllib.parse import quote

    _, root, videos = site
    n = len(videos)
    away = {videos.video_id[n - 2], videos.video_id[n - 1]}  # link.mp4 (a symlink out), ../secret.mp4
    resolved = []
    real = serve_mod.Server.media_file
    monkeypatch.setattr(serve_mod.Server, "media_file", lambda self, vid: resolved.append(vid) or real(self, vid))
    hits = client.get("/search", params={"q": "a dog", "k": n}).json()["hits"]
    assert len(hits) == n and {h["video_id"] for h in hits if h["media"] is None} == away
    assert sorted(resolved) == sorted(videos.video_id)  # once each
    for h in hits:
        url = h["media"].partition("#")[0] if h["media"] else "/media/" + quote(h["video_id"], safe="")
        assert client.get(url).status_code == (404 if h["media"] is None else 200), h
    resolved.clear()
    page = client.get("/", params={"q": "a dog", "k": n}).text
    rows = {vid: row for row in page.split('<tr class="hit">')[1:] for vid in videos.video_id
            if f"<td>{vid}</td>" in row}
    assert len(rows) == n and sorted(resolved) == sorted(videos.video_id)
    for vid, row in rows.items():
        assert ("<video" not in row and "<td>no file</td>" in row) if vid in away else "<video" in row, vid
    # a file removed after start, and a server with no video root: no player either
    (root / "v2.mp4").rename(root / "v2.bak")
    try:
        gone = {v for v, p in zip(videos.video_id, videos.path) if p == "v2.mp4"}
        hits = client.get("/search", params={"q": "a dog", "k": n}).json()["hits"]
        assert {h["video_id"] for h in hits if h["media"] is None} == away | gone
    finally:
        (root / "v2.bak").rename(root / "v2.mp4")
    bare = TestClient(make_app(dataclasses.replace(server, current=dataclasses.replace(
        server.current, searcher=dataclasses.replace(server.searcher, video_root=None)))), base_url=BASE)
    assert all(h["media"] is None for h in bare.get("/search", params={"q": "a dog", "k": 3}).json()["hits"])
    assert bare.get("/", params={"q": "a dog", "k": 3}).text.count("<td>no file</td>") == 3


def test_loopback_binds_quietly_and_another_address_is_warned_about():
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert exposure_warning(host) is None
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.org"):
        assert "anyone who can reach" in exposure_warning(host)


def test_the_cli_warns_for_another_host_and_serves_what_it_loaded(site, cli, monkeypatch):
    store, root, _ = site
    called = {}

    def serve(server, listener, allow):
        called.update(host=listener.host, port=listener.port, allow=allow, hosts=listener.hosts(allow))

    monkeypatch.setattr(serve_mod, "serve", serve)
    r = cli("serve", "--features", store, "--video-root", root, "--host", "0.0.0.0", "--port", "0",
            "--allow-host", "MyBox.lan", "--allow-host", "[::1]")
    assert r.exit_code == 0, r.output
    assert "anyone who can reach" in r.output and "--allow-host" in r.output
    # port 0: the free port the system chose, printed and served
    assert called["host"] == "0.0.0.0" and 0 < called["port"] and f"http://0.0.0.0:{called['port']}/" in r.output
    assert called["allow"] == ("mybox.lan", "::1") and called["hosts"].refusal([f"mybox.lan:{called['port']}"]) is None
    r = cli("serve", "--features", store, "--video-root", root, "--port", "0")
    assert r.exit_code == 0 and "warning" not in r.output and called["host"] == "127.0.0.1"


# ------------------------------------------------------------------------------------------ a real browser


def test_a_browser_searches_and_the_player_seeks_to_the_hits_moment(server):
    from tvrpipe.errors import ConfigError
    from tvrpipe.search.engine import check_min_score

    if not Path(CHROMIUM).exists() and not shutil.which("chromium"):
        pytest.skip(f"no Chromium at {CHROMIUM} or on PATH (apt-get install chromium; .ci/run installs it)")
    playwright = pytest.importorskip("playwright.sync_api", reason="the playwright package (the 'dev' extra)")
    import uvicorn

    listener = listen("127.0.0.1", 0)
    port = listener.port
    uv = uvicorn.Server(uvicorn.Config(make_app(server, listener.hosts()), host="127.0.0.1", port=port,
                                       log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [listener.sock]}, daemon=True)
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
                                                               f"hits scored below min_score={x:.10g} and were cut")
                assert page.input_value("form[method=get] input[name=min_score]") == f"{x:.10g}"  # kept for the next
                # one outside the head's scores: the page says why, with the message search prints
                with pytest.raises(ConfigError) as want:
                    check_min_score(server.searcher, 2.0, "min_score")
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
        listener.close()


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
    assert bad.status_code == 400 and "min_score=2 is outside the scores" in bad.text and "--min-score" not in bad.text


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
    # search's note, naming the cut as the request gave it
    assert want.note(q) == f"4 of the top 6 hits scored below --min-score {x:.10g} and were cut"
    assert body["note"] == f"4 of the top 6 hits scored below min_score={x:.10g} and were cut"
    assert client.get("/search", params={"q": q, "k": 6}).json()["note"] is None
    page = client.get("/", params={"q": q, "k": 6, "min_score": x})
    assert page.text.count('<tr class="hit">') == 2
    assert f"4 of the top 6 hits scored below min_score={x:.10g}" in page.text


def test_a_min_score_outside_the_heads_scores_is_400_with_searchs_message(site, server, client):
    from tvrpipe.errors import ConfigError
    from tvrpipe.search.engine import check_min_score

    with pytest.raises(ConfigError) as want:
        check_min_score(server.searcher, 2.0, "min_score")
    r = client.get("/search", params={"q": "a cat", "min_score": 2.0})
    assert r.status_code == 400 and r.json()["error"] == str(want.value)
    assert str(want.value).startswith("min_score=2 is outside the scores of")
    with pytest.raises(ConfigError, match=r"^--min-score 2 is outside the scores of"):  # search's words, unchanged
        check_min_score(server.searcher, 2.0)
    assert client.get("/", params={"q": "a cat", "min_score": 2.0}).status_code == 400
    # what the request sent is named, never an option of the command line nor a number it was read as
    for sent, said in [("x", "min_score='x': a number is needed"), ("nan", "min_score=nan: a finite number"),
                       ("1e999", "min_score=1e999: a finite number"), ("-inf", "min_score=-inf: a finite number")]:
        r = client.get("/search", params={"q": "a cat", "min_score": sent})
        assert r.status_code == 400 and r.json()["error"].startswith(said), (sent, r.text)
        page = client.get("/", params={"q": "a cat", "min_score": sent})
        assert page.status_code == 400 and said.replace("'", "&#x27;") in page.text and "--min-score" not in page.text
        pic = client.post("/search", data={"min_score": sent}, files={"image": ("p.png", _png(), "image/png")})
        assert pic.status_code == 400 and pic.json()["error"].startswith(said), (sent, pic.text)


def test_serve_min_score_is_the_default_cut_and_is_checked_at_start(site, cli, monkeypatch):
    store, root, _ = site
    got = {}
    monkeypatch.setattr(serve_mod, "serve", lambda server, listener, allow: got.update(server=server))
    r = cli("serve", "--features", store, "--video-root", root, "--min-score", "0.01", "--port", "0")
    assert r.exit_code == 0, r.output
    found = got["server"].search(["a dog"], 5)
    assert found.min_score == 0.01 and all(h.score >= 0.01 for h in found.hits)
    r = cli("serve", "--features", store, "--video-root", root, "--min-score", "5", "--port", "0")
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
    client = TestClient(make_app(server), base_url=BASE)
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
    client = TestClient(make_app(server), base_url=BASE)
    for _ in range(5):
        _ids(client)
    assert len(calls) <= 1


# ------------------------------------------------------------------------------- pages of other sites (Host)


def test_a_host_of_another_site_is_refused_on_every_route(site, server, client):
    """A page that points its own name at 127.0.0.1 (DNS rebinding) sends that name as the Host: the page, the
    JSON, the pictures' POST and the media files are all refused, and no byte of a hit or a video goes back."""
    _, root, videos = site
    vid = videos.video_id[0]
    video = (root / "v0.mp4").read_bytes()
    evil = TestClient(make_app(server), base_url="http://evil.example:8000")
    for r in (evil.get("/"), evil.get("/", params={"q": "a dog"}), evil.get("/search", params={"q": "a dog"}),
              evil.get(f"/media/{vid}"), evil.get(f"/media/{vid}", headers={"Range": "bytes=0-99"}),
              evil.head(f"/media/{vid}"), evil.post("/search", files={"image": ("x.png", b"x", "image/png")}),
              evil.get("/no-such-route")):
        assert r.status_code == 421, r.request.url
        assert vid not in r.text and video[:100] not in r.content
    assert "evil.example:8000" in evil.get("/").text and "--allow-host" in evil.get("/").text
    for host in ("evil.example", "EVIL.EXAMPLE:8000", "127.0.0.1.evil.example:8000", "localhost.evil.example",
                 "127.0.0.1:9999", "localhost:80", "[::1]:8001", "0.0.0.0:8000", "192.168.1.5:8000"):
        assert client.get(f"/media/{vid}", headers={"host": host}).status_code == 421, host
    for host in ("", "[::1", "127.0.0.1:80:80", "127.0.0.1:x", "::1", "a b", "127.0.0.1:8000/x"):
        assert client.get(f"/media/{vid}", headers={"host": host}).status_code == 400, host
    # the loopback names of a server on 127.0.0.1, in any case, with its port or none
    for host in ("127.0.0.1:8000", "LOCALHOST:8000", "localhost", "[::1]:8000", "[0:0::1]:8000", "127.0.0.1"):
        r = client.get(f"/media/{vid}", headers={"host": host})
        assert r.status_code == 200 and r.content == video, host


def test_a_name_the_user_allows_is_answered():
    """A server on 0.0.0.0 answers its addresses (a rebinding page always sends a name) and the loopback names;
    a name only where --allow-host allows it. One on a LAN address answers that address and the names allowed."""
    wild = allowed_hosts("0.0.0.0", 8000, check_allowed_hosts(["MyBox.lan"]))
    for ok in ("192.168.1.5:8000", "10.1.2.3", "[fe80::1]:8000", "localhost:8000", "mybox.lan:8000", "MYBOX.LAN"):
        assert wild.refusal([ok]) is None, ok
    for bad in ("evil.example:8000", "mybox:8000", "mybox.lan.evil.example", "192.168.1.5:8001"):
        assert wild.refusal([bad])[0] == 421, bad
    lan = allowed_hosts("192.168.1.5", 8080, ["mybox.lan"])
    assert lan.refusal(["192.168.1.5:8080"]) is None and lan.refusal(["mybox.lan:8080"]) is None
    for bad in ("localhost:8080", "127.0.0.1:8080", "10.1.2.3:8080", "evil.example:8080"):
        assert lan.refusal([bad])[0] == 421, bad
    assert allowed_hosts("::1", 8000).refusal(["[::1]:8000"]) is None
    assert allowed_hosts("127.0.0.1", 8000).refusal([])[0] == 400
    assert allowed_hosts("127.0.0.1", 8000).refusal(["127.0.0.1:8000", "evil.example"])[0] == 400
    for bad in ("mybox.lan:8080", "http://mybox.lan", "*", "*.lan", "a/b", "", "mybox.lan..", "192.168.1.5."):
        with pytest.raises(ConfigError, match="--allow-host"):
            check_allowed_hosts([bad])
    assert check_allowed_hosts(["MyBox.lan.", "mybox.lan"]) == ("mybox.lan",)  # a name's fully qualified form


def test_a_fully_qualified_name_is_the_name_and_an_address_with_a_dot_is_refused_as_what_it_is():
    """``localhost.`` and ``mybox.lan.`` (a trailing dot: the DNS root) name what ``localhost`` and ``mybox.lan``
    name, and are answered where those are; ``127.0.0.1.`` is a name of digits, not the address: refused with 421
    saying so, not as a malformed Host; two dots, or a dot alone, stay malformed."""
    loop = allowed_hosts("127.0.0.1", 8000, check_allowed_hosts(["mybox.lan"]))
    for ok in ("localhost.", "localhost.:8000", "LOCALHOST.:8000", "mybox.lan.", "mybox.lan.:8000"):
        assert loop.refusal([ok]) is None, ok
    for host in ("127.0.0.1.", "127.0.0.1.:8000"):
        assert loop.refusal([host]) == (421, f"the Host header {host!r} is the address 127.0.0.1 followed by a dot: "
                                             "a DNS name of digits, not that address; name this server by the "
                                             "address alone (127.0.0.1)")
    wild = allowed_hosts("0.0.0.0", 8000)
    assert wild.refusal(["192.168.1.5:8000"]) is None and wild.refusal(["192.168.1.5.:8000"])[0] == 421
    for bad in ("localhost..", ".", "..:8000", "mybox.lan.:80:80"):
        assert loop.refusal([bad]) == (400, f"the Host header {bad!r} is not HOST[:PORT]"), bad
    for other in ("evil.example.", "localhost.evil.example.", "mybox.lan.evil.example."):
        assert loop.refusal([other])[0] == 421, other


def test_an_allowed_name_reaches_every_route(site, server):
    _, root, videos = site
    app = make_app(server, allowed_hosts("127.0.0.1", 8000, check_allowed_hosts(["mybox.lan"])))
    mine = TestClient(app, base_url="http://mybox.lan:8000")
    assert mine.get("/search", params={"q": "a dog", "k": 2}).status_code == 200
    assert mine.get(f"/media/{videos.video_id[0]}").content == (root / "v0.mp4").read_bytes()
    assert TestClient(app, base_url="http://other.lan:8000").get("/").status_code == 421


# ------------------------------------------------------------------------------------------------ uploads


def _png(colour=(20, 30, 200)) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (40, 30), colour).save(buf, format="PNG")
    return buf.getvalue()


def test_an_uploads_name_never_becomes_a_path(client, monkeypatch):
    """Names a client may send (``..``, a path, 300 characters, markup): each searched as the picture it
    is, written to the same fixed name, and shown as escaped text (a long one cut)."""
    written = []
    real = Path.write_bytes
    monkeypatch.setattr(Path, "write_bytes", lambda self, data: written.append(self) or real(self, data))
    long = "a" * 300 + ".png"
    for name in ("..", ".", "../../etc/passwd", "/tmp/x.png", long, '<img src=x onerror="alert(1)">.png'):
        r = client.post("/", params={"k": 2}, files={"image": (name, _png(), "image/png")})
        assert r.status_code == 200, (name, r.text[-500:])
        assert r.text.count('<tr class="hit">') == 2
        assert "<img src=x" not in r.text
        j = client.post("/search", params={"k": 2}, files={"image": (name, _png(), "image/png")})
        assert j.status_code == 200, (name, j.text)
        shown = {h["query"] for h in j.json()["hits"]}
        assert len(shown) == 1 and len(shown.pop()) <= serve_mod.NAME_CHARS
    assert {p.name for p in written} == {"picture"} and all(p.parent.name.startswith("tvrpipe-serve-")
                                                            for p in written)
    page = client.post("/", files={"image": (long, _png(), "image/png")}).text
    assert "a" * (serve_mod.NAME_CHARS - 1) + "\u2026" in page and "a" * 300 not in page
    page = client.post("/", files={"image": ("<b>x</b>.png", _png(), "image/png")}).text
    assert "&lt;b&gt;x&lt;/b&gt;.png" in page
    # an unreadable upload is named by its name, not by the server's temporary file
    bad = client.post("/search", files={"image": ("notes.png", b"not a picture", "image/png")})
    assert bad.status_code == 400 and "'notes.png'" in bad.json()["error"] and "tvrpipe-serve-" not in bad.text


def _raw_upload(client, route: str, disposition: bytes, data: bytes, **kw):
    """POST ``data`` as the form's picture part with the ``Content-Disposition`` value ``disposition``, byte for
    byte: httpx would percent-encode a name's control characters, a client need not."""
    boundary = b"b0undary"
    body = (b"--" + boundary + b"\r\nContent-Disposition: " + disposition + b"\r\nContent-Type: image/png\r\n\r\n"
            + data + b"\r\n--" + boundary + b"--\r\n")
    return client.post(route, content=body, headers={"content-type": "multipart/form-data; boundary=b0undary"}, **kw)


def _controls(text: str) -> list[str]:
    import unicodedata

    return [c for c in text if unicodedata.category(c) in ("Cc", "Zl", "Zp") or "\u202a" <= c <= "\u202e"]


def test_an_uploads_name_is_shown_without_control_characters(client):
    """A name with a NUL, CR/LF (raw, or RFC 5987 percent-encoded), an escape, a line separator or a
    bidirectional override is shown with each replaced by U+FFFD, in the JSON's ``query`` and on the page."""
    cases = [
        (b'form-data; name="image"; filename="a\x00b.png"', "a\ufffdb.png"),
        (b'form-data; name="image"; filename="a\x1b[31mred.png"', "a\ufffd[31mred.png"),
        ('form-data; name="image"; filename="a\u2028b\u202egnp.exe"'.encode(), "a\ufffdb\ufffdgnp.exe"),
        (b"form-data; name=\"image\"; filename*=UTF-8''a%0D%0AX-Evil%3A%201.png", "a\ufffd\ufffdX-Evil: 1.png"),
        (b"form-data; name=\"image\"; filename*=UTF-8''a%00b%C2%85.png", "a\ufffdb\ufffd.png"),
    ]
    for disposition, shown in cases:
        r = _raw_upload(client, "/search", disposition, _png(), params={"k": 2})
        assert r.status_code == 200, (disposition, r.text)
        assert {h["query"] for h in r.json()["hits"]} == {shown}, disposition
        page = _raw_upload(client, "/", disposition, _png(), params={"k": 2})
        assert page.status_code == 200 and f"Picture: &ldquo;{shown}&rdquo;" in page.text, disposition
        heading = page.text.partition("<h2>")[2].partition("</h2>")[0]
        assert heading and not _controls(heading), (disposition, heading)
    assert serve_mod.upload_name("\u202e" * 300).startswith("\ufffd") and len(serve_mod.upload_name("\x00" * 300)) \
        == serve_mod.NAME_CHARS


def test_a_picture_named_only_by_rfc_5987_is_searched(client):
    """``filename*=UTF-8''...`` alone (RFC 7578 forbids it in forms; some clients send it): the part is the
    picture, named by it, or ``picture`` where it names nothing; the hits are those of the same picture sent
    plainly."""
    want = client.post("/search", params={"k": 3}, files={"image": ("x.png", _png(), "image/png")}).json()["hits"]
    for disposition, shown in [(b"form-data; name=\"image\"; filename*=UTF-8''na%C3%AFve%20photo.png",
                                "na\u00efve photo.png"),
                               (b"form-data; name=\"image\"; FILENAME*=utf-8'en'b.png", "b.png"),
                               (b"form-data; name=\"image\"; filename*=UTF-8''", "picture")]:
        r = _raw_upload(client, "/search", disposition, _png(), params={"k": 3})
        assert r.status_code == 200, (disposition, r.text)
        hits = r.json()["hits"]
        assert [h["video_id"] for h in hits] == [h["video_id"] for h in want] and {h["query"] for h in hits} == {shown}
        page = _raw_upload(client, "/", disposition, _png(), params={"k": 3})
        assert page.status_code == 200 and page.text.count('<tr class="hit">') == 3, disposition
    # a field named image without any file name is still no picture
    r = client.post("/search", data={"image": "not a file"})
    assert r.status_code == 400 and r.json()["error"].startswith("no picture: POST one as the form field 'image'")


def test_an_upload_whose_headers_are_too_long_is_refused_saying_so(client):
    long = "a" * 5000 + ".png"
    for route in ("/search", "/"):
        r = client.post(route, files={"image": (long, _png(), "image/png")})
        assert r.status_code == 400, route
        said = r.json()["error"] if route == "/search" else r.text
        assert ("the form cannot be read: a header of one of its parts is over 4,224 bytes (a file name that long?); "
                "send the picture under a shorter name") in said, said
    # other damage keeps python-multipart's own reason beside Starlette's
    r = _raw_upload(client, "/search", b'form-data; name="image"; filename="x.png"\r\nbroken header', _png())
    assert r.status_code == 400 and r.json()["error"].startswith("the form cannot be read: Invalid multipart data."), \
        r.text


def test_a_picture_tvrpipe_refuses_is_400_naming_the_upload(client):
    """The refusals of ``search --image`` (a strip too long for its width, an animation, a 32-bit TIFF), each
    400 with its line, naming the upload as the client called it (not the server's temporary file)."""
    import io

    from PIL import Image

    def saved(image, fmt, **kw) -> bytes:
        buf = io.BytesIO()
        image.save(buf, format=fmt, **kw)
        return buf.getvalue()

    frames = [Image.new("RGB", (8, 8), (i * 90, 0, 0)) for i in range(3)]
    for name, data, said in [
        ("wide.png", saved(Image.new("RGB", (60000, 1)), "PNG"),
         "'wide.png': a picture of 60000 x 1 px, 60,000 times as long as it is wide (at most 64)"),
        ("anim.gif", saved(frames[0], "GIF", save_all=True, append_images=frames[1:]),
         "'anim.gif': 3 frames (an animation or pages, GIF), not one picture: give a still picture"),
        ("deep.tif", saved(Image.fromarray(np.full((4, 4), 128, np.int32), "I"), "TIFF"),
         "'deep.tif': a signed 32-bit integer TIFF (Pillow mode 'I'), whose white is unknown"),
    ]:
        r = client.post("/search", files={"image": (name, data, "image/png")})
        assert r.status_code == 400 and said in r.json()["error"], r.text
        assert "tvrpipe-serve-" not in r.text and "Traceback" not in r.text
        page = client.post("/", files={"image": (name, data, "image/png")})
        assert page.status_code == 400 and said.replace("'", "&#x27;") in page.text


def test_a_picture_and_a_sentence_together_are_refused(client):
    pic = {"image": ("blue.png", _png(), "image/png")}
    for route in ("/", "/search"):
        for r in (client.post(route, params={"q": "a dog"}, files=pic),
                  client.post(route, data={"q": "a dog"}, files=pic),
                  client.post(route, params={"q": ""}, files=pic)):
            assert r.status_code == 400, route
            assert "a picture and a sentence (q) were both given" in r.text


# -------------------------------------------------------------------------------------- the upload's size cap


def _asgi(app, headers: list[tuple[bytes, bytes]], chunks: list[bytes], path: str = "/search"):
    """POST ``chunks`` to ``app`` as a server would stream them in; (status, body, chunks read)."""
    import asyncio

    read, sent = [0], []

    async def receive():
        if read[0] < len(chunks):
            read[0] += 1
            return {"type": "http.request", "body": chunks[read[0] - 1], "more_body": read[0] < len(chunks)}
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"k=2", "root_path": "",
             "headers": [(b"host", b"127.0.0.1:8000"), *headers], "client": ("127.0.0.1", 5000),
             "server": ("127.0.0.1", 8000)}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body, read[0]


def _multipart(data: bytes, boundary: str = "b0undary") -> tuple[bytes, bytes]:
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"big.png\"\r\n"
            f"Content-Type: image/png\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    return f"multipart/form-data; boundary={boundary}".encode(), body


def test_a_picture_over_the_cap_is_refused_while_it_streams_in(server, client, monkeypatch):
    monkeypatch.setattr(serve_mod, "MAX_IMAGE_BYTES", 4096)
    monkeypatch.setattr(serve_mod, "FORM_BYTES", 1024)
    cap = 4096 + 1024
    app = make_app(server)
    kind, body = _multipart(b"\x89PNG" + bytes(64 * 1024))
    chunks = [body[i:i + 1000] for i in range(0, len(body), 1000)]
    # with a Content-Length over the cap: 413 before a byte is read
    status, said, read = _asgi(app, [(b"content-type", kind), (b"content-length", str(len(body)).encode())], chunks)
    assert (status, read) == (413, 0) and b"the picture is over 4,096 bytes" in said
    # chunked, no Content-Length: read up to the cap, then 413, the rest never read
    for route in ("/search", "/"):
        status, said, read = _asgi(app, [(b"content-type", kind)], chunks, route)
        assert status == 413 and cap <= read * 1000 < cap + 1000 < len(body), route
        assert b"the picture is over 4,096 bytes" in said
    # a Content-Length that lies low: still stopped at the cap
    status, _, read = _asgi(app, [(b"content-type", kind), (b"content-length", b"100")], chunks)
    assert status == 413 and read * 1000 < cap + 1000
    # a file over the cap inside a body under it (the form's room): 413 too, as for the client's own requests
    small_kind, small = _multipart(_png() + bytes(4096 - len(_png()) + 1))
    assert len(small) < cap
    status, _, _ = _asgi(app, [(b"content-type", small_kind), (b"content-length", str(len(small)).encode())],
                         [small])
    assert status == 413
    r = client.post("/search", files={"image": ("big.png", bytes(100_000), "image/png")})
    assert r.status_code == 413 and "over 4,096 bytes" in r.json()["error"]
    r = client.post("/", files={"image": ("big.png", bytes(100_000), "image/png")})
    assert r.status_code == 413 and "over 4,096 bytes" in r.text
    # at the cap: searched
    r = client.post("/search", params={"k": 2}, files={"image": ("ok.png", _png() + bytes(4096 - len(_png())),
                                                                 "image/png")})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------------------------- thumbnails, k, listening


def test_the_pages_thumbnails_never_read_outside_the_root(site, server, client, monkeypatch):
    """A hit whose store path leaves the root (a symlink out of it, ``../``) gets a placeholder saying so, and
    its file is never opened, as /media never serves it."""
    from tvrpipe.search import html as search_html

    _, root, videos = site
    opened = []
    real = search_html.frames_at
    monkeypatch.setattr(search_html, "frames_at", lambda path, *a: opened.append(Path(path)) or real(path, *a))
    r = client.get("/", params={"q": "a dog", "k": len(server.stage)})
    assert r.status_code == 200 and r.text.count('<tr class="hit">') == len(videos)
    assert opened and all(p.is_relative_to(root.resolve()) and p.name != "link.mp4" for p in opened)
    assert r.text.count("no thumbnails: outside the video root") == 2


def test_without_k_a_small_store_answers_as_search_does(tmp_path):
    """No k: every video of a store smaller than the default, as tvrpipe search without --top-k; a k over the
    store, or over the candidates: refused as search refuses its --top-k, naming the request's k."""
    from tvrpipe.errors import ConfigError

    store = _tiny_clip_store(tmp_path / "small", seed=5, train=2, test=1)
    client = TestClient(make_app(open_server(store)), base_url=BASE)
    q = "a dog runs on a beach"
    r = client.get("/search", params={"q": q})
    assert r.status_code == 200, r.text
    want = search(open_searcher(store), [q]).hits
    assert [h["video_id"] for h in r.json()["hits"]] == [h.video_id for h in want] and len(want) == 3
    page = client.get("/", params={"q": q})
    assert page.status_code == 200 and page.text.count('<tr class="hit">') == 3 and 'value="3"' in page.text
    for k in (4, 10, 0):
        with pytest.raises(ConfigError) as said:
            search(open_searcher(store), [q], k)
        r = client.get("/search", params={"q": q, "k": k})
        assert r.status_code == 400 and r.json()["error"] == str(said.value).replace(f"--top-k {k}", f"k={k}"), k
    assert client.get("/search", params={"q": q, "k": 3}).status_code == 200
    shortlist = TestClient(make_app(open_server(store, candidates=2)), base_url=BASE)
    with pytest.raises(ConfigError) as said:
        search(open_searcher(store), [q], 3, candidates=2)
    r = shortlist.get("/search", params={"q": q, "k": 3})
    assert r.status_code == 400 and r.json()["error"] == str(said.value).replace("--top-k 3", "k=3")
    assert shortlist.get("/search", params={"q": q, "k": 2}).status_code == 200
    r = shortlist.get("/search", params={"q": q})  # the default, not a k the user never gave, is named
    assert r.status_code == 400 and r.json()["error"] == ("--candidates 2 is fewer than the 3 hits a query returns "
                                                          "by default: give at least 3 candidates, or ask for fewer "
                                                          "hits (k=N)")


def test_a_port_in_use_or_a_host_that_cannot_be_bound_fails_before_anything_loads(site, cli, monkeypatch):
    store, root, _ = site
    opened = []
    monkeypatch.setattr(serve_mod, "open_server", lambda *a, **kw: opened.append(a))
    monkeypatch.setattr(serve_mod, "serve", lambda *a: pytest.fail("served"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = cli("serve", "--features", store, "--port", port)
    assert r.exit_code == 1 and f"--port {port}: already in use on 127.0.0.1" in r.output
    assert "Traceback" not in r.output and "serving" not in r.output
    r = cli("serve", "--features", store, "--host", "192.0.2.1", "--port", "0")  # TEST-NET: no machine's own
    assert r.exit_code == 1 and "--host 192.0.2.1: not an address of this machine" in r.output
    for port in ("70000", "-1"):
        r = cli("serve", "--features", store, "--port", port)
        assert r.exit_code == 1 and f"--port {port}: a port from 1 to 65535" in r.output
    r = cli("serve", "--features", store, "--allow-host", "mybox:8000")
    assert r.exit_code == 1 and "--allow-host 'mybox:8000'" in r.output

    def unresolved(*a, **kw):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unresolved)
    r = cli("serve", "--features", store, "--host", "no-such-host.invalid")
    assert r.exit_code == 1 and "--host no-such-host.invalid: not an address this machine can listen on" in r.output
    assert opened == []


# SIGTERM takes the same path as SIGINT with its own exit code and words: that half runs in `make test-all`
@pytest.mark.parametrize("sig, code, word", [pytest.param(signal.SIGTERM, 143, "terminated (SIGTERM)",
                                                          marks=pytest.mark.slow),
                                             (signal.SIGINT, 130, "interrupted")])
def test_a_server_stopped_by_a_signal_says_it_stopped(site, sig, code, word):
    """SIGTERM or Ctrl-C ends ``tvrpipe serve`` with the conventional code and a line saying the server stopped:
    it makes nothing to resume, so the other commands' "rerun the same command to resume" would mislead. The
    signal reaches the CLI as uvicorn passes it on once it has shut down."""
    import os
    import urllib.request

    store, root, _ = site
    cmd = [sys.executable, "-m", "tvrpipe", "serve", "--features", str(store), "--video-root", str(root), "--port", "0"]
    # SIGINT as a terminal delivers it (a suite started in the background has it ignored, and children inherit that)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        printed = ""
        while "(Ctrl-C stops)" not in printed and p.poll() is None:  # the line, however the console wraps it
            printed += p.stdout.readline()
        port = int(printed.rpartition("http://127.0.0.1:")[2].partition("/")[0])
        deadline = time.monotonic() + 60
        while True:  # serving: uvicorn has its signal handlers in place
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/search?q=a+dog&k=1", timeout=5) as r:
                    assert r.status == 200
                break
            except OSError:
                assert time.monotonic() < deadline and p.poll() is None, "the server did not start"
                time.sleep(0.1)
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    said = " ".join(err.split())
    assert p.returncode == code, (p.returncode, err)
    assert f"{word}: the server stopped" in said and "rerun" not in said and "Traceback" not in err, err


def test_listen_holds_the_port_it_reports():
    with listen("127.0.0.1", 0) as held:
        assert held.port > 0 and held.address == "127.0.0.1" and held.url == f"http://127.0.0.1:{held.port}/"
        with pytest.raises(ConfigError, match=f"--port {held.port}: already in use"):
            listen("127.0.0.1", held.port)
        assert held.hosts().refusal([f"localhost:{held.port}"]) is None
        assert held.hosts().refusal(["localhost:8000"])[0] == 421


def test_serve_refuses_a_head_built_first_stage_without_a_run_or_a_shortlist_before_loading_anything(site, cli):
    store, root, _ = site
    r = cli("serve", "--features", store, "--video-root", root, "--first-stage", "distilled", "--candidates", "5",
            "--port", "0")
    assert r.exit_code == 1 and "--first-stage distilled is fitted to a run's head: give --run" in r.output
    assert not (Path(store) / "search-distilled").exists()


def test_a_server_reads_the_heads_kept_encodings_and_answers_as_search(site, tmp_path, cli):
    """`--encoded-videos`: a prota run's encodings made at start and kept beside the store; a request's hits are
    tvrpipe search's from the frames; zero-shot is refused before anything loads."""
    from tvrpipe.training.fit import TrainConfig, fit

    store, root, _ = site
    own = tmp_path / "store"
    shutil.copytree(store, own, ignore=shutil.ignore_patterns(".tvrpipe.lock"))
    run = tmp_path / "run"
    fit(own, "prota", run, TrainConfig(epochs=1, batch_size=8), progress=False)
    server = open_server(own, run, video_root=root, candidates=10, encoded_videos=True)
    assert server.current.encoded is not None and len(list((own / "search-encoded").iterdir())) == 1
    q = "a dog runs on a beach"
    r = TestClient(make_app(server), base_url=BASE).get("/search", params={"q": q, "k": 3})
    assert r.status_code == 200, r.text
    want = search(open_searcher(own, run, video_root=root), [q], 3, candidates=10).hits
    assert [h["video_id"] for h in r.json()["hits"]] == [h.video_id for h in want] and len(want) == 3
    np.testing.assert_allclose([h["score"] for h in r.json()["hits"]], [h.score for h in want], rtol=1e-5, atol=1e-6)
    r = cli("serve", "--features", store, "--video-root", root, "--encoded-videos", "--port", "0")
    assert r.exit_code == 1 and "--encoded-videos keeps a trained head's encodings of the videos: give --run" in r.output
    assert not (Path(store) / "search-encoded").exists()
