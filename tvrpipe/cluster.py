"""Ray, started or joined once per process, for every stage that runs on it (extract, finetune's Ray
Train workers, sweep): the address checked before Ray is asked to connect, its output kept quiet, and
GPU requests checked against the cluster before Ray would wait forever to place them."""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager

from tvrpipe.errors import ConfigError


def ray_init(address: str | None, num_cpus: int | None = None, data: bool = True) -> None:
    """Start (or join, with ``address`` / ``RAY_ADDRESS``) Ray for this process, once.

    Quiet unless logging is at INFO or below (the CLI's ``-v``): Ray's own INFO lines, its
    start-up notices and its C++ log lines (e.g. core_worker's note on actor constructor
    arguments, which looks like an error and is not one) are hidden, so a user sees tvrpipe's
    progress bars and summaries; a failed start still shows what Ray printed. ``data=False`` leaves
    Ray Data unimported (0.3-0.5 s; ``extract`` runs plain actors) and unconfigured.
    """
    import ray

    quiet = logging.getLogger().getEffectiveLevel() > logging.INFO
    if ray.is_initialized():
        if data and "ray.data" not in sys.modules:  # joined without Ray Data (by extract): configure it now
            _quiet_ray_data(quiet)
        return
    if quiet:
        os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")  # the driver's C++ lines on stderr
    address, option = ray_address(address)
    with stderr_held(quiet):  # the token-authentication notice is printed by Ray's C++ start-up
        if address:
            check_reachable(address, option=option)
            try:
                ray.init(address=address, log_to_driver=False,
                         logging_level=logging.WARNING if quiet else logging.INFO)
            except (ConnectionError, RuntimeError, ray.exceptions.AuthenticationError) as e:
                raise ConfigError(
                    f"--address {address}: cannot connect to the Ray cluster ({' '.join(str(e).split())[:200]}). "
                    "Check the address (`ray status` on the head node); a cluster started with token "
                    "authentication needs RAY_AUTH_MODE=token and its token in RAY_AUTH_TOKEN or "
                    "~/.ray/auth_token (`ray get-auth-token` on the head prints it); see docs/cluster.md"
                ) from None
        else:
            # "local": a private instance even when a cluster started with `ray start` runs on this
            # machine (plain ray.init() would join that one instead)
            ray.init(address="local", num_cpus=num_cpus or local_cpus(), include_dashboard=False,
                     log_to_driver=False, configure_logging=False)
    for name in ("ray", "ray.train", "ray.tune"):
        logging.getLogger(name).setLevel(logging.ERROR if quiet else logging.INFO)
    if data:
        _quiet_ray_data(quiet)


def _quiet_ray_data(quiet: bool) -> None:
    import ray.data  # configures its loggers on import: set their level after

    logging.getLogger("ray.data").setLevel(logging.ERROR if quiet else logging.INFO)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.verbose_progress = False


def ray_running() -> bool:
    """This process has joined or started Ray (checked without importing it)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def stop_ray() -> None:
    """Leave Ray now (a local instance this process started stops with it): a command that is done with
    Ray calls this rather than leave it to Ray's exit hook, which first sleeps half a second for late
    log lines."""
    if ray_running():
        sys.modules["ray"].shutdown()


def require_gpus(need: float, option: str, instead: str, per_task: float | None = None) -> None:
    """After :func:`ray_init`: fail, naming ``option``, when the Ray cluster has fewer than ``need``
    GPUs in all, or no node with ``per_task`` of them (default ``need``; a task is placed on one
    node); Ray would otherwise wait forever to place the work (extract's encoders, finetune's
    workers, a sweep's runs). ``instead`` says what to do."""
    import ray

    have = ray.cluster_resources().get("GPU", 0)
    one = per_task if per_task is not None else need
    node = max((n.get("Resources", {}).get("GPU", 0) for n in ray.nodes() if n.get("Alive")), default=0)
    if have < need:
        raise ConfigError(f"{option}: needs {need:g} GPU{'s' if need > 1 else ''}, and the Ray cluster has "
                          f"{have:g}; {instead}, or run on a cluster whose nodes have GPUs")
    if node < one:
        raise ConfigError(f"{option}: a task needs {one:g} GPUs on one node, and the largest node has {node:g}; "
                          f"{instead}, or run on nodes with more GPUs")


def ray_address(address: str | None) -> tuple[str | None, str]:
    """The cluster to join, ``address`` or else ``RAY_ADDRESS`` (None: a local instance), and the option
    that named it, for messages. ``local`` asks for a local instance even where ``RAY_ADDRESS`` is set."""
    if address == "local":
        return None, "--address"
    if address:
        return address, "--address"
    return os.environ.get("RAY_ADDRESS") or None, "RAY_ADDRESS"


def check_reachable(address: str, timeout: float = 10.0, option: str = "--address") -> None:
    """Fail fast, naming ``option``, when nothing listens where ``address`` points: Ray itself retries such
    a connection for minutes, and forever for ``auto`` whose cluster has stopped (it reads the address of
    the last cluster started on this machine, which outlives the cluster). Every form is checked:
    ``HOST:PORT``, ``ray://HOST:PORT`` and ``auto``."""
    import re
    import socket

    target, how = address, ""
    if address == "auto":
        try:
            # Ray has no public form of its own `auto` lookup; a failure falls back to ray.init below
            from ray._private.services import canonicalize_bootstrap_address  # noqa: PLC2701

            target = canonicalize_bootstrap_address("auto")
        except Exception:  # Ray's own lookup failed, or its private API moved: leave it to ray.init
            return
        if target is None:
            raise ConfigError(f"{option} auto: no Ray cluster was started on this machine; start one with "
                              "`ray start --head`, or leave the option out to run here; see docs/cluster.md")
        how = f" (auto: the last cluster started on this machine, at {target})"
    m = re.fullmatch(r"(?:ray://)?\[?([^\[\]/]+?)\]?:(\d+)", target)
    if not m:
        return
    try:
        socket.create_connection((m.group(1), int(m.group(2))), timeout=timeout).close()
    except OSError as e:
        stopped = "; that cluster has stopped" if how else ""
        raise ConfigError(f"{option} {address}{how}: cannot connect to the Ray cluster (nothing answers there: "
                          f"{e.strerror or e}){stopped}; start it with `ray start --head --port {m.group(2)}` or "
                          "check the address (`ray status` on the head node prints it); see docs/cluster.md") from None


@contextmanager
def stderr_held(hold: bool):
    """Hold what is written to file descriptor 2 (C++ included) while active; replay it if the block
    fails, drop it if it succeeds. A no-op unless ``hold``."""
    if not hold:
        yield
        return
    import sys
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            tmp.seek(0)
            sys.stderr.write(tmp.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def local_cpus() -> int:
    """The cores this process may use (its affinity: a container's or ``taskset``'s share, not the host's): a
    local Ray instance's CPUs, and extraction's decoders and CPU encoder threads without Ray, so that both count
    the same cores (and a CPU encoder runs its matrix products on as many threads under either)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def cluster_cpus() -> int:
    import ray

    return max(1, int(ray.cluster_resources().get("CPU", os.cpu_count() or 1)))
