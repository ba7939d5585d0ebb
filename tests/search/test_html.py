"""``tvrpipe search --html``: the page on a real extracted store (generated videos, the tiny CLIP),
read back with an HTML parser (every thumbnail an embedded image that decodes, text escaped, nothing
loaded from outside), and opened in a real headless Chromium, offline, where every image must render.
``frames_at``, which decodes the thumbnails, is checked against the extraction reader (decord)."""

from __future__ import annotations

import base64
import io
import re
import shutil
import subprocess
import time
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from tvrpipe.errors import ConfigError, WriteError
from tvrpipe.features.clip import TINY_MODEL
from tvrpipe.features.decode import DecodeFailure, decode_video, frames_at, sample_indices
from tvrpipe.features.extract import ExtractConfig, extract
from tvrpipe.features.store import FeatureStore, open_store
from tvrpipe.search import html as search_html
from tvrpipe.search.html import THUMB_HEIGHT, write_html
from tvrpipe.search.meanings import SCALE
from tvrpipe.search.results import Hit
from tvrpipe.worlds.videos import synthesize

N_VIDEOS = 6
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


# ----------------------------------------------------------------------------- a store, hits, a parser


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("data")
    synthesize(d, N_VIDEOS, seed=7, progress=False)
    return d


@pytest.fixture(scope="module")
def store(data, tmp_path_factory) -> FeatureStore:
    """The videos extracted with the tiny CLIP (Ray, started here once and stopped)."""
    import ray

    from tvrpipe.cluster import ray_init

    out = tmp_path_factory.mktemp("features")
    ray_init(None, num_cpus=2)
    try:
        cfg = ExtractConfig(model=TINY_MODEL, pretrained="none", frames=6, video_shard=4, text_shard=16,
                            batch_size=3, progress=False, timeout_s=30.0)
        summary = extract(data / "manifest", data / "videos", out, cfg)
    finally:
        ray.shutdown()
    assert (summary.videos_done, summary.failed) == (N_VIDEOS, 0)
    return open_store(out)


def hits_for(store: FeatureStore, query: str, rows: list[int], **kw) -> list[Hit]:
    """Hits of ``query`` for the store's ``rows``, best first."""
    v = store.videos
    return [Hit(query=query, rank=r + 1, video_id=kw.get("video_id", v.video_id[row]),
                path=kw.get("path", v.path[row]), start_s=None, end_s=None, score=0.9 - 0.1 * r,
                uncertainty=kw.get("uncertainty"), row=row)
            for r, row in enumerate(rows)]


class Page(HTMLParser):
    """What a test needs from a page: its images, every URL-bearing attribute, scripts, text."""

    URL_ATTRS = {"src", "href", "srcset", "action", "poster", "data", "background", "formaction", "xlink:href"}

    def __init__(self, text: str) -> None:
        super().__init__()
        self.images: list[dict[str, str]] = []
        self.urls: list[tuple[str, str, str]] = []  # (tag, attribute, value)
        self.tags: list[str] = []
        self.text: list[str] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        a = {k: v or "" for k, v in attrs}
        if tag == "img":
            self.images.append(a)
        self.urls += [(tag, k, v) for k, v in a.items() if k in self.URL_ATTRS]

    def handle_data(self, data):
        self.text.append(data)

    @property
    def plain(self) -> str:
        return " ".join(" ".join(self.text).split())


def decoded_size(uri: str) -> tuple[str, int, int]:
    """(format, width, height) of a data: URI image: JPEG through Pillow, SVG through an XML parser."""
    head, _, payload = uri.partition(",")
    assert head in ("data:image/jpeg;base64", "data:image/svg+xml;base64"), head
    raw = base64.b64decode(payload, validate=True)
    if head == "data:image/jpeg;base64":
        with Image.open(io.BytesIO(raw)) as im:
            im.load()
            return im.format, im.width, im.height
    svg = ET.fromstring(raw)
    assert svg.tag == "{http://www.w3.org/2000/svg}svg"
    return "SVG", int(svg.get("width")), int(svg.get("height"))


def valid_times(store: FeatureStore, row: int) -> np.ndarray:
    t = store.array("videos/timestamps")[row]
    return t[store.array("videos/frame_mask")[row] & np.isfinite(t)]


# ----------------------------------------------------------------------------- the page


def test_every_thumbnail_is_an_embedded_image_at_a_recorded_frame_time(store, data, tmp_path):
    hits = hits_for(store, "a red circle moves left", [2, 0, 5]) + hits_for(store, "a blue square", [4, 1])
    out = write_html(tmp_path / "page.html", hits, store, data / "videos", thumbs=4)
    page = Page(out.read_text())
    # per hit, in query then rank order: 4 of its recorded frames, spread as extraction spreads them
    want = []
    for h in hits:
        t = valid_times(store, h.row)
        want += [f"{x:.2f} s" for x in t[sample_indices(len(t), 4)]]
    assert len(want) == len(hits) * 4  # 6 frames recorded per video
    assert [im["title"] for im in page.images] == want
    for im in page.images:
        fmt, width, height = decoded_size(im["src"])
        assert (fmt, height) == ("JPEG", THUMB_HEIGHT) and width == THUMB_HEIGHT  # the videos are square
    # the thumbnails are the frames, not grey boxes: neighbouring frames of a moving scene differ
    first = [np.asarray(Image.open(io.BytesIO(base64.b64decode(im["src"].partition(",")[2]))))
             for im in page.images[:4]]
    assert first[0].std() > 5 and any(np.abs(a.astype(int) - first[0]).mean() > 1 for a in first[1:])
    # hits grouped by query, ranks ascending; every field of a hit in its row
    text = page.plain
    assert text.index("a red circle moves left") < text.index("a blue square")
    for h in hits:
        assert h.video_id in text and h.path in text
    assert "4 of" not in text and "20 images" in text and "without thumbnails" not in text


def test_each_video_is_decoded_once(store, data, tmp_path, monkeypatch):
    calls = []

    def counting(path, times, height):
        calls.append(Path(path).name)
        return frames_at(path, times, height)

    monkeypatch.setattr(search_html, "frames_at", counting)
    hits = hits_for(store, "q1", [0, 1, 2]) + hits_for(store, "q2", [2, 1]) + hits_for(store, "q3", [0])
    write_html(tmp_path / "p.html", hits, store, data / "videos", thumbs=2)
    assert sorted(calls) == sorted(store.videos.path[[0, 1, 2]])


def test_a_bad_video_gets_a_placeholder_that_says_why(store, data, tmp_path):
    root = tmp_path / "videos"
    shutil.copytree(data / "videos", root)
    (root / store.videos.path[1]).unlink()
    (root / store.videos.path[2]).write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8)
    hits = hits_for(store, "q", [0, 1, 2, 3], uncertainty=0.25)
    out = write_html(tmp_path / "p.html", hits, store, root, thumbs=3)
    page = Page(out.read_text())
    kinds = [decoded_size(im["src"])[0] for im in page.images]
    assert kinds == ["JPEG"] * 3 + ["SVG", "SVG"] + ["JPEG"] * 3
    for im in page.images:
        assert decoded_size(im["src"])[1:] > (0, 0)
    assert page.images[3]["alt"] == "file missing" and page.images[4]["alt"] == "cannot decode the file"
    text = page.plain
    assert "no thumbnails: file missing" in text and "no thumbnails: cannot decode the file" in text
    assert "2 videos without thumbnails" in text
    assert "uncertainty" in text and "0.2500" in text


def test_without_a_video_root_every_hit_gets_a_placeholder(store, tmp_path):
    out = write_html(tmp_path / "p.html", hits_for(store, "q", [0, 1]), store, None)
    page = Page(out.read_text())
    assert [decoded_size(im["src"])[0] for im in page.images] == ["SVG", "SVG"]
    assert page.plain.count("no thumbnails: no video root given") == 2
    assert "uncertainty" not in page.plain  # no hit has one


def test_a_path_leading_out_of_the_video_root_is_never_opened(store, data, tmp_path, monkeypatch):
    """The store's paths are data: ``../``, an absolute path or a symlink out of the root get a placeholder that
    says so, and no file outside the root is decoded (the rule of tvrpipe serve's /media)."""
    root = tmp_path / "videos"
    shutil.copytree(data / "videos", root)
    outside = tmp_path / "outside.mp4"
    shutil.copy(root / store.videos.path[0], outside)  # a real video: decoded if it were ever opened
    (root / "link.mp4").symlink_to(outside)
    (root / "loop.mp4").symlink_to(root / "loop.mp4")
    opened = []
    monkeypatch.setattr(search_html, "frames_at", lambda path, *a: opened.append(Path(path)) or frames_at(path, *a))
    hits = (hits_for(store, "q", [0]) + hits_for(store, "q", [1], path="../outside.mp4")
            + hits_for(store, "q", [2], path="link.mp4") + hits_for(store, "q", [3], path=str(outside))
            + hits_for(store, "q", [4], path="loop.mp4") + hits_for(store, "q", [5], path="."))
    page = Page(write_html(tmp_path / "p.html", hits, store, root, thumbs=1).read_text())
    assert opened == [(root / store.videos.path[0]).resolve()]
    assert page.plain.count("no thumbnails: outside the video root") == 3
    assert "no thumbnails: cannot resolve the path" in page.plain and "no thumbnails: not a file" in page.plain
    assert [decoded_size(im["src"])[0] for im in page.images] == ["JPEG"] + ["SVG"] * 5
    assert search_html.file_inside(root, "../outside.mp4") == (None, "outside the video root")
    assert search_html.file_inside(tmp_path / "nowhere", "a.mp4") == (None, "video root missing")
    assert search_html.file_inside(root, "no-such.mp4") == (None, "file missing")


def test_text_is_escaped(store, data, tmp_path):
    query = '<script>alert("q")</script> & <b>bold</b>'
    path = '<img src="http://example.com/x.png">.mp4'
    hits = hits_for(store, query, [0]) + hits_for(store, "other", [1], path=path, video_id="<i>v</i>")
    raw = write_html(tmp_path / "p.html", hits, store, data / "videos", title="<title>&", thumbs=1).read_text()
    page = Page(raw)
    assert page.tags.count("script") == 1 and "b" not in page.tags and "i" not in page.tags
    assert len(page.images) == 2  # one thumbnail, one placeholder (that file does not exist)
    assert query in page.plain and path in page.plain and "<i>v</i>" in page.plain and "<title>&" in page.plain
    assert "<script>alert" not in raw and "&lt;script&gt;alert(&quot;q&quot;)&lt;/script&gt; &amp;" in raw


def test_the_page_loads_nothing_from_outside(store, data, tmp_path):
    hits = hits_for(store, "näive café ✓", [0, 3]) + hits_for(store, "q", [5])
    raw = write_html(tmp_path / "p.html", hits, store, data / "videos", thumbs=2).read_text()
    page = Page(raw)
    assert raw.isascii() and "näive café ✓" in page.plain  # character references, whatever the encoding
    assert "http://" not in raw and "https://" not in raw and "url(" not in raw and "@import" not in raw
    loads = [v for tag, k, v in page.urls if not (tag == "a" and k == "href")]
    assert loads and all(v.startswith("data:image/") for v in loads), page.urls
    # links are no loads: each opens a hit's own video file, when the reader follows it
    files = {(data / "videos" / store.videos.path[r]).absolute().as_uri() for r in (0, 3, 5)}
    assert all(v.partition("#")[0] in files for tag, k, v in page.urls if k == "href"), page.urls
    assert not {"link", "iframe", "object", "embed", "video", "audio", "source", "base"} & set(page.tags)
    assert "default-src 'none'; img-src data:;" in raw  # the page's CSP forbids any other load


def test_each_hit_links_its_video_at_its_moment_and_the_legend_says_what_numbers_mean(store, data, tmp_path):
    """The clip cell's link opens the file at the hit's bounds (a media fragment), each thumbnail's at its own
    frame time; the legend gives the head's meaning of the score and of the uncertainty, and which way is
    more uncertain."""
    from tvrpipe.search.html import Meaning

    v = store.videos
    whole = hits_for(store, "q", [1], uncertainty=0.5)
    moment = [Hit(query="q", rank=2, video_id="m", path=v.path[2], start_s=1.5, end_s=3.25, score=-0.2,
                  uncertainty=0.75, row=2),
              Hit(query="q", rank=3, video_id="n", path=v.path[3], start_s=None, end_s=2.0, score=-0.3,
                  uncertainty=0.25, row=3)]
    meaning = Meaning("minus a distance (higher ranks first)", "a variance: larger, less certain")
    raw = write_html(tmp_path / "p.html", whole + moment, store, data / "videos", thumbs=2, meaning=meaning).read_text()
    page = Page(raw)
    hrefs = [v for tag, k, v in page.urls if tag == "a" and k == "href"]
    url = {r: (data / "videos" / v.path[r]).absolute().as_uri() for r in (1, 2, 3)}
    opens = [h for h in hrefs if h in (url[1], f"{url[2]}#t=1.50,3.25", f"{url[3]}#t=0.00,2.00")]
    assert opens == [url[1], f"{url[2]}#t=1.50,3.25", f"{url[3]}#t=0.00,2.00"], hrefs
    for r in (1, 2, 3):  # each thumbnail opens its video at the frame it shows
        t = valid_times(store, r)[sample_indices(len(valid_times(store, r)), 2)]
        assert [f"{url[r]}#t={x:.2f}" for x in t] == [h for h in hrefs if h.startswith(url[r] + "#t=")
                                                       and "," not in h], hrefs
    assert "score minus a distance (higher ranks first)." in page.plain
    assert "uncertainty a variance: larger, less certain" in page.plain
    assert " ".join(SCALE.split()) in page.plain  # scores compare within one head
    # without the video folder there is nothing to open, and the legend says so
    page = Page(write_html(tmp_path / "q.html", whole, store, None).read_text())
    assert not [v for tag, k, v in page.urls if tag == "a"] and "there is no file to open" in page.plain


def test_write_is_atomic_and_errors_are_one_line(store, tmp_path):
    out = write_html(tmp_path / "new" / "deeper" / "p.html", hits_for(store, "q", [0]), store, None)
    assert out.is_file() and [p.name for p in out.parent.iterdir()] == ["p.html"]  # no temporary left
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(WriteError, match=r"file/p\.html: cannot write it") as err:
        write_html(blocker / "p.html", hits_for(store, "q", [0]), store, None)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="at least 1"):
        write_html(tmp_path / "p.html", [], store, None, thumbs=0)
    assert "No hits." in write_html(tmp_path / "empty.html", [], store, None).read_text()


# ----------------------------------------------------------------------------- frames_at


def counter_video(path: Path, n: int, width: int, height: int, rotate: int = 0) -> Path:
    """H.264 at 25 fps, a keyframe every 10 frames, B-frames on; frame k is grey 4 + 8 * (k % 31)
    over the left three quarters and white on the right quarter (to see the orientation)."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast", "qp": "0", "g": "10", "bf": "2"}
        if rotate:
            stream.set_display_rotation(rotate)
        for k in range(n):
            img = np.full((height, width, 3), 4 + 8 * (k % 31), np.uint8)
            img[:, 3 * width // 4 :] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def grey_counter(frame: np.ndarray) -> int:
    return round((frame[:, : frame.shape[1] // 2].mean() - 4) / 8)


def test_frames_at_gives_the_frames_extraction_recorded(tmp_path):
    path = counter_video(tmp_path / "c.mp4", 60, 80, 64)  # 80 px: a width decord 0.6 can return
    video = decode_video(path, 12, 64)  # decord, the extraction reader: its frames and their times
    assert video.reader == "decord"
    times = video.timestamps[video.mask]
    order = np.array([11, 0, 5, 5, 7, 2, 9, 1, 10, 3, 8, 4, 6])  # any order, repeats: each seeks anew
    frames = frames_at(path, times[order], 64)
    assert all(f.shape == (64, 80, 3) and f.dtype == np.uint8 for f in frames)
    want = [grey_counter(f) for f in video.frames[video.mask]]
    assert [grey_counter(f) for f in frames] == [want[i] for i in order]
    assert want == [(k % 31) for k in sample_indices(60, 12)]
    # past the end: the last frame; the aspect is kept at any height
    last, small = frames_at(path, [99.0, 0.0], 33)
    assert grey_counter(last) == 59 % 31 and last.shape == (33, 41, 3) and small.shape == (33, 41, 3)


def test_frames_at_applies_the_display_rotation(tmp_path):
    path = counter_video(tmp_path / "r.mp4", 5, 96, 64, rotate=90)  # shown 64 wide, 96 high
    (frame,) = frames_at(path, [0.0], 48)
    assert frame.shape == (48, 32, 3)
    assert frame[:4].mean() > 200 and frame[-20:].mean() < 60  # the white right edge is now on top


def test_frames_at_failures(tmp_path):
    with pytest.raises(DecodeFailure) as err:
        frames_at(tmp_path / "gone.mp4", [0.0], 32)
    assert err.value.kind == "missing"
    (tmp_path / "bad.mp4").write_bytes(b"not a video at all" * 50)
    with pytest.raises(DecodeFailure) as err:
        frames_at(tmp_path / "bad.mp4", [0.0], 32)
    assert err.value.kind == "unreadable"


# ----------------------------------------------------------------------------- in a real browser


@pytest.fixture
def browser() -> str:
    """Chromium's path; the test skips without it (before the store is built)."""
    found = next((p for p in map(shutil.which, BROWSERS) if p), None)
    if found is None:
        pytest.skip(f"Chromium not found (none of {', '.join(BROWSERS)} on PATH): install it with "
                    "`apt-get install chromium` to run this test (.ci/run does)")
    return found


def test_page_renders_offline_in_headless_chromium(browser, store, data, tmp_path):
    root = tmp_path / "videos"
    shutil.copytree(data / "videos", root)
    (root / store.videos.path[4]).unlink()  # its placeholder must render too
    hits = hits_for(store, "a <b>red</b> circle", [0, 1, 2]) + hits_for(store, "a blue square", [4, 3, 0])
    out = write_html(tmp_path / "page dir" / "search.html", hits, store, root, thumbs=4)
    n = len(Page(out.read_text()).images)
    assert n == 5 * 4 + 1
    cmd = [
        browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'profile'}", "--no-first-run", "--no-default-browser-check",
        "--disable-extensions", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--disable-default-apps",
        "--host-resolver-rules=MAP * ~NOTFOUND",  # offline: no name resolves; the page must not need one
        "--virtual-time-budget=5000", "--dump-dom", out.resolve().as_uri(),
    ]
    t0 = time.perf_counter()
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{browser} did not finish within 60 s; stderr ends:\n{(e.stderr or b'')[-2000:]!r}")
    tail = run.stderr[-2000:]
    assert run.returncode == 0, f"{browser} exited {run.returncode} after {time.perf_counter() - t0:.1f} s:\n{tail}"
    body = re.search(r"<body\b[^>]*>", run.stdout)
    assert body, f"no <body> in what {browser} dumped:\n{run.stdout[:500]}\nstderr:\n{tail}"
    counted = re.search(r'data-thumbs="(\d+)/(\d+)"', body.group(0))
    assert counted, f"the page's script did not run (blocked by its CSP?): {body.group(0)}\nstderr:\n{tail}"
    assert (int(counted.group(1)), int(counted.group(2))) == (n, n), (
        f"{counted.group(1)} of {counted.group(2)} images rendered, {n} expected\nstderr:\n{tail}")
    assert f"{n} of {n} rendered" in run.stdout
