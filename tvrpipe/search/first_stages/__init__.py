"""First stages of a search: the interface and registry (``base``) and one module per backend, registered on
import.

A new first stage (another ANN library) is one module here plus one import line below: docs/search.md,
"A new first stage".
"""

from tvrpipe.search.first_stages.base import (
    AUTO,
    FOR_HEAD,
    FirstStageIndex,
    StageConfig,
    exportable_first_stages,
    first_stage_choices,
    first_stage_class,
    first_stage_for_head,
    first_stage_help,
    list_first_stages,
    register_first_stage,
    resolve_first_stage,
    stage_config,
)

__all__ = ["AUTO", "FOR_HEAD", "FirstStageIndex", "StageConfig", "exportable_first_stages", "first_stage_choices",
           "first_stage_class", "first_stage_for_head", "first_stage_help", "list_first_stages", "register_first_stage",
           "resolve_first_stage", "stage_config"]

# One line per first stage: importing its module registers it.
from tvrpipe.search.first_stages import (
    distilled,  # noqa: F401
    exact,  # noqa: F401
    faiss_hnsw,  # noqa: F401
    faiss_ivfpq,  # noqa: F401
    head_embedding,  # noqa: F401
    late_interaction,  # noqa: F401
)
