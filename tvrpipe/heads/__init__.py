"""Retrieval heads: the interface (``base``) and one file per method, registered on import.

A new head is one file plus one import line here.
"""

from tvrpipe.heads.base import (
    Head,
    HeadConfig,
    LossOutput,
    TextBatch,
    VideoBatch,
    create_head,
    list_heads,
    register_head,
)

__all__ = ["Head", "HeadConfig", "LossOutput", "TextBatch", "VideoBatch", "create_head", "list_heads",
           "register_head"]

# One line per head: importing a head's module registers it.
from tvrpipe.heads import (
    duq,  # noqa: F401
    meanpool,  # noqa: F401
    prota,  # noqa: F401
    seqtransf,  # noqa: F401
    tmass,  # noqa: F401
    tokenwise,  # noqa: F401
    uatvr,  # noqa: F401
    xpool,  # noqa: F401
)
