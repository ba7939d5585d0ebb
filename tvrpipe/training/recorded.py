"""A run's recorded trainer settings read back and checked: train-head's ``train`` section as a
:class:`~tvrpipe.training.settings.TrainConfig`, finetune's ``finetune`` and ``execution`` sections as a
:class:`~tvrpipe.training.finetune.config.FinetuneConfig` (above both, so neither imports the other)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tvrpipe.config import field_types
from tvrpipe.errors import ConfigError, RunError
from tvrpipe.training.settings import TrainConfig


def trainer_config(run: Path, config: Mapping[str, Any], known_only: bool = False) -> Any:
    """The trainer settings a run's ``config.yaml`` (``config``) records, rebuilt and checked as the trainer checks
    its options: train-head's ``train`` as a :class:`TrainConfig`, finetune's ``finetune`` and ``execution`` as a
    :class:`FinetuneConfig`. Every problem is named as the file's key, never as the CLI option it stands for: the
    user typed no option, the file holds the value.

    Args:
        known_only: leave out keys that are not fields of the config (a run written by another tvrpipe) instead
            of refusing them.

    Raises:
        RunError: a key that is not a field (unless ``known_only``), a value of the wrong type or out of the field's
            range, or settings that do not go together, naming ``config.yaml`` and the key.
    """
    from tvrpipe.rundir import CONFIG
    from tvrpipe.training.finetune.config import FinetuneConfig

    path = Path(run) / CONFIG
    if "train" in config:
        return _section_config(path, {"train": config["train"]}, TrainConfig, "trainer config", known_only)
    return _section_config(path, {k: config.get(k) or {} for k in ("finetune", "execution")}, FinetuneConfig,
                           "finetune config", known_only)


def _section_config(path: Path, sections: Mapping[str, Any], cls: type, what: str, known_only: bool) -> Any:
    """``cls`` built from the sections of ``config.yaml`` (``{section: values}``); where it refuses them, its
    message is told as the file's key it names."""
    from tvrpipe.rundir import check_types

    hints = field_types(cls)
    values: dict[str, Any] = {}
    where: dict[str, str] = {}  # key -> its section
    for name, section in sections.items():
        check_types(path, f"{name}.", section, hints)
        unknown = sorted(map(str, set(section) - set(hints)))
        if unknown and not known_only:
            raise RunError(f"{path}: its {name} section is not a {what} (unknown key(s) {', '.join(unknown)}); "
                           "restore it or train the run again into a new --out")
        values.update({k: v for k, v in section.items() if k in hints})
        where.update({k: name for k in section if k in hints})
    try:
        return cls(**values)
    except ConfigError as e:
        key, problem = _named_key(str(e), cls)
        said = f"{where[key]}.{key} {problem}" if key in where else f"{' and '.join(sections)}: {e}"
        raise RunError(f"{path}: {said}; restore it or train the run again into a new --out") from None


def _named_key(message: str, cls: type) -> tuple[str | None, str]:
    """The field of the config class ``cls`` that its refusal ``message`` opens with (by its CLI option,
    ``--name``, or ``owner: name``), and the message without that name: ``--epochs must be >= 0, got -3`` ->
    ``("epochs", "must be >= 0, got -3")``; ``(None, message)`` where it names no field."""
    for f in dataclasses.fields(cls):
        names = [re.escape(n) for n in (f.metadata.get("option"), f"--{f.name.replace('_', '-')}") if n]
        m = re.match(rf"(?:{'|'.join(names)}|\w+(?:: |\.){re.escape(f.name)})(?=[ =:]|$)", message)
        if m is None:
            continue
        rest = message[m.end():]
        if rest.startswith("="):  # "--lr=nan: it must be ...": the key names it
            rest = rest.partition(": ")[2]
        return f.name, rest.strip().removeprefix("it ") or message
    return None, message
