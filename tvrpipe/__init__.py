"""tvrpipe: CLIP-based text-video retrieval, from manifests to features to heads.

The public API is re-exported here as the stages land; see docs/ for the user guide.
"""

from __future__ import annotations

from tvrpipe.errors import TvrpipeError

__version__ = "0.1.0"

__all__ = ["TvrpipeError", "__version__"]
