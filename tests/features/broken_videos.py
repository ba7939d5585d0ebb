"""Generated videos with two that every extraction records as failed: what the extraction tests extract."""

from __future__ import annotations

from pathlib import Path


def synth_with_broken_videos(d: Path, n: int, seed: int) -> Path:
    """``n`` generated videos and their manifest in ``d``, plus a zero-byte and a corrupt video (a good file's
    header, then garbage) in the manifest, each with a caption: two videos every extraction records as failed."""
    from tvrpipe.data.manifest import make_tables, read_manifest, write_manifest
    from tvrpipe.worlds.videos import synthesize

    synthesize(d, n, seed=seed, progress=False)
    root = d / "videos"
    (root / "zero.mp4").write_bytes(b"")
    good = sorted(root.glob("synth_*.mp4"))[0].read_bytes()
    (root / "corrupt.mp4").write_bytes(good[:200] + bytes(range(256)) * 4)
    m = read_manifest(d / "manifest")
    extra_v = [{"video_id": v, "path": f"{v}.mp4", "split": "test"} for v in ("zero", "corrupt")]
    extra_c = [{"caption_id": f"{v}#0", "video_id": v, "text": f"a broken {v} video", "split": "test"}
               for v in ("zero", "corrupt")]
    v, c = make_tables(m.videos.to_dict("records") + extra_v, m.captions.to_dict("records") + extra_c)
    write_manifest(d / "manifest", v, c, m.meta)
    return d
