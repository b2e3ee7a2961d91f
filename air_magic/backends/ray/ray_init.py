"""``ray_init()``: start or join the Ray cluster that air_magic's Ray launches run on.

Ray is imported when ``ray_init()`` is first called, never by ``import air_magic``
(``pip install 'ray[default]>=2.40'``, or ``pip install '.[ray]'`` in the clone, installs it).

**Joining** (``address``, else ``RAY_ADDRESS``): Ray's own connection attempts retry for
many minutes when nothing answers at the address, so a plain TCP connection is tried
first: within ``connect_timeout`` seconds it says whether the address is refused, silent or
unknown, and the error names it. Then the address is asked for its cluster id as Ray asks
(gRPC, without a token): what answers otherwise is no Ray head, and a cluster that wants a
token this process lacks says so, both at once. Ray's own checks follow, each mapped to
an error that names the address (another Ray or Python version on the cluster, a token
it refuses). **Starting** (no address): a head on this machine with its GPUs, counted the way a
launch counts them (NVML, ``CUDA_VISIBLE_DEVICES`` honoured), or its CPUs.

Either way one line says what this process is connected to::

    [air_magic] Joined the Ray cluster at 127.0.0.1:6379: 2 nodes, 2 CPUs, 0 GPUs; dashboard http://127.0.0.1:8265

and ``min_gpus=N`` asks for at least N GPUs on the cluster's live nodes
(:class:`~air_magic.errors.AcceleratorMismatchError` otherwise, after leaving the cluster
again if this call joined or started it).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

from air_magic.errors import AcceleratorMismatchError, ConfigurationError, RayClusterError, RayNotInstalledError

__all__ = ["ClusterSummary", "cluster_summary", "ray_init"]

#: The port of a Ray head's GCS when ``ray start --head`` is given none.
DEFAULT_PORT = 6379

#: Ray's own setting for how many times a driver tries to reach the GCS (about 40 s each
#: when the address answers but is no GCS). ``ray_init`` tries once unless it is set.
_GCS_WAIT_ENV = "RAY_gcs_server_port_wait_time_s"

_HOW_TO_ADDRESS = (
    "Pass the head node's address as `ray start --head` prints it (host:port, port 6379 by default), "
    "or no address (and no RAY_ADDRESS) to start a Ray cluster on this machine."
)


@dataclass(frozen=True)
class ClusterSummary:
    """What the live nodes of the connected cluster offer (``ray.nodes()``)."""

    address: str
    nodes: int
    cpus: float
    gpus: float
    #: GPUs per model, from Ray's ``accelerator_type:<MODEL>`` node resources.
    gpu_models: dict[str, float] = field(default_factory=dict)
    dashboard_url: str | None = None

    def describe(self) -> str:
        """``2 nodes, 2 CPUs, 0 GPUs; dashboard http://127.0.0.1:8265``."""
        gpus = _count(self.gpus, "GPU")
        if self.gpu_models:
            gpus += " (" + ", ".join(f"{_number(n)} {m}" for m, n in sorted(self.gpu_models.items())) + ")"
        dashboard = f"dashboard {self.dashboard_url}" if self.dashboard_url else "no dashboard"
        return f"{_count(self.nodes, 'node')}, {_count(self.cpus, 'CPU')}, {gpus}; {dashboard}"


@dataclass
class _Connection:
    #: The address this process joined, as asked (None: the head was started here).
    address: str | None
    context: Any


_lock = threading.Lock()
_connection: _Connection | None = None


def ray_init(
    address: str | None = None,
    *,
    min_gpus: int | None = None,
    connect_timeout: float = 10.0,
    **kwargs: Any,
) -> Any:
    """Join the Ray cluster at ``address`` (else ``RAY_ADDRESS``), or start one on this machine.

    Parameters
    ----------
    address:
        The head node's ``host:port`` (as ``ray start --head`` prints it; a ``ray://`` client
        address or ``"auto"`` work too). ``None``: ``RAY_ADDRESS``, and when that is unset a
        new head on this machine with its GPUs (or CPUs only).
    min_gpus:
        At least this many GPUs must be on the cluster's live nodes, else
        :class:`AcceleratorMismatchError` (the cluster is left again if this call joined or
        started it).
    connect_timeout:
        Seconds to wait for the address to answer at all before
        :class:`RayClusterError` says it does not.
    **kwargs:
        Passed to ``ray.init`` when this call connects (``runtime_env``, ``namespace``,
        ``num_cpus`` for a new head ...); given while connected already, an error.

    Returns
    -------
    object
        Ray's context: what ``ray.init`` returns (``.dashboard_url``, ``.address_info``). Calling it again
        with the same cluster (or no address) returns the same context; another address while
        connected is a :class:`RayClusterError`.
    """
    asked = _check_address(address)
    if min_gpus is not None and (isinstance(min_gpus, bool) or not isinstance(min_gpus, int) or min_gpus < 0):
        raise ConfigurationError(f"min_gpus must be a whole number of GPUs (0 or more), got {min_gpus!r}.")
    if isinstance(connect_timeout, bool) or not isinstance(connect_timeout, (int, float)) or not connect_timeout > 0:
        raise ConfigurationError(f"connect_timeout must be a number of seconds > 0, got {connect_timeout!r}.")
    source = ""
    if asked is None:
        from_env = os.environ.get("RAY_ADDRESS", "").strip()
        if from_env:
            asked, source = _check_address(from_env, "RAY_ADDRESS"), " (from RAY_ADDRESS)"
    if asked == "local":  # Ray's word for "start a new cluster here"
        asked = None
    ray = _import_ray()
    global _connection
    with _lock:
        if ray.is_initialized():
            context, shown = _connected_already(ray, asked)
            if kwargs:
                raise RayClusterError(
                    f"this process is already connected to the Ray cluster at {shown}, and ray.init()'s arguments "
                    f"({', '.join(sorted(kwargs))}) apply when it connects. Call ray.shutdown() first to connect "
                    "again with them."
                )
            verb, joined_now = "Already connected to the Ray cluster at", False
        elif asked is None:
            if min_gpus:
                _check_local_gpus(min_gpus)
            context = _start_here(ray, kwargs)
            shown = _gcs_address(ray, context) or "this machine"
            verb, joined_now = "Started a Ray cluster on this machine at", True
            _connection = _Connection(None, context)
        else:
            context = _join(ray, asked, source, float(connect_timeout), kwargs)
            shown = asked
            verb, joined_now = "Joined the Ray cluster at", True
            _connection = _Connection(asked, context)
        summary = cluster_summary(ray, shown, context)
        if min_gpus and summary.gpus < min_gpus:
            if joined_now:
                ray.shutdown()
                _connection = None
            left = " (this process left it again)" if joined_now else ""
            raise AcceleratorMismatchError(
                f"min_gpus={min_gpus} was asked for, but the Ray cluster at {shown} has "
                f"{_count(summary.gpus, 'GPU')} on {_count(summary.nodes, 'live node')}{left}. "
                "Join a cluster with GPU nodes, add GPU nodes to this one, or ask for fewer GPUs."
            )
    print(f"[air_magic] {verb} {shown}: {summary.describe()}", flush=True)
    return context


def cluster_summary(ray: Any, address: str, context: Any = None) -> ClusterSummary:
    """Count the CPUs and GPUs of the connected cluster's live nodes."""
    nodes = cpus = gpus = 0.0
    models: dict[str, float] = {}
    for node in ray.nodes():
        if not node.get("Alive", node.get("alive", False)):
            continue
        resources = node.get("Resources") or {}
        nodes += 1
        cpus += resources.get("CPU", 0.0)
        node_gpus = resources.get("GPU", 0.0)
        gpus += node_gpus
        for key in resources:
            if key.startswith("accelerator_type:") and node_gpus:
                model = key.split(":", 1)[1]
                models[model] = models.get(model, 0.0) + node_gpus
    return ClusterSummary(
        address=address,
        nodes=int(nodes),
        cpus=cpus,
        gpus=gpus,
        gpu_models=models,
        dashboard_url=_dashboard_url(context),
    )


# -- the three ways in ---------------------------------------------------------------------


def _start_here(ray: Any, kwargs: dict[str, Any]) -> Any:
    from air_magic.accelerators import detect_hardware

    options = dict(kwargs)
    options.setdefault("num_gpus", detect_hardware().gpu_count)
    try:
        # "local": a new head, even where ray.init() would join a cluster it finds running here
        return ray.init(address="local", **options)
    except ValueError as exc:
        _leave(ray)
        raise ConfigurationError(f"ray.init() refused the arguments: {exc}") from exc
    except Exception as exc:
        _leave(ray)
        raise RayClusterError(f"could not start a Ray cluster on this machine: {type(exc).__name__}: {exc}") from exc


def _join(ray: Any, address: str, source: str, timeout: float, kwargs: dict[str, Any]) -> Any:
    where = f"{address}{source}"
    refused_without_token = False
    if address != "auto":
        _probe(address, where, timeout)
        if "://" not in address:
            refused_without_token = _probe_gcs(address, where, timeout)
    saved = os.environ.get(_GCS_WAIT_ENV)
    if saved is None:
        os.environ[_GCS_WAIT_ENV] = "1"
    try:
        return ray.init(address=address, **kwargs)
    except Exception as exc:
        _leave(ray)
        raise _join_error(exc, where, refused_without_token) from exc
    finally:
        if saved is None:
            os.environ.pop(_GCS_WAIT_ENV, None)


def _connected_already(ray: Any, asked: str | None) -> tuple[Any, str]:
    global _connection
    current = _gcs_address(ray, None)
    if _connection is not None and current and _gcs_address(ray, _connection.context) not in (None, current):
        _connection = None  # left with ray.shutdown() and connected again with ray.init()
    ours = _connection.address if _connection else None
    if asked not in (None, "auto") and not any(_same_place(asked, other) for other in (ours, current) if other):
        raise RayClusterError(
            f"this process is already connected to the Ray cluster at {ours or current or 'another address'}; "
            f"it cannot join {asked} as well. Call ray.shutdown() first to leave it, "
            "or call ray_init() without an address to keep using it."
        )
    if _connection is None:  # ray.init() was called directly: Ray gives its context again
        _connection = _Connection(asked, ray.init(ignore_reinit_error=True))
    return _connection.context, ours or current or asked or "this machine"


# -- checks --------------------------------------------------------------------------------


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        if exc.name == "ray":
            raise RayNotInstalledError(
                f"ray_init() needs Ray, which is not installed in this Python environment ({sys.executable}): "
                "pip install 'ray[default]>=2.40' (in a notebook: %pip install 'ray[default]>=2.40')."
            ) from None
        raise RayNotInstalledError(f"Ray is installed but cannot be imported: {exc}") from exc
    if not hasattr(ray, "init"):  # a folder named ray on sys.path, and no Ray
        where = ", ".join(getattr(ray, "__path__", None) or [str(getattr(ray, "__file__", "?"))])
        raise RayNotInstalledError(
            f"ray_init() needs Ray, and `import ray` finds {where}, which is not Ray: "
            "pip install 'ray[default]>=2.40' (in a notebook: %pip install 'ray[default]>=2.40')."
        )
    return ray


def _check_address(address: Any, name: str = "address") -> str | None:
    if address is None:
        return None
    if not isinstance(address, str):
        raise ConfigurationError(f"{name} must be a string 'host:port', got {type(address).__name__} {address!r}.")
    address = address.strip()
    if not address:
        return None
    if address in ("auto", "local"):
        return address
    host, port = _split(address)
    if not host or port is None:
        raise ConfigurationError(f"{name}={address!r} is not 'host:port'. {_HOW_TO_ADDRESS}")
    return address


def _split(address: str) -> tuple[str, int | None]:
    """``host`` and ``port`` of ``host:port``, ``[v6]:port`` or ``ray://host:port``."""
    rest = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return rest, None
    return host.strip("[]"), int(port)


def _probe(address: str, where: str, timeout: float) -> None:
    """Is anything listening at ``address``? Refused, silent or unknown: a clear error, fast."""
    host, port = _split(address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return
    except socket.gaierror as exc:
        reason = f"the host name {host!r} is not known ({exc.strerror})"
    except ConnectionRefusedError:
        reason = "the connection was refused (nothing listens there)"
    except (TimeoutError, socket.timeout):
        reason = f"no answer within {_number(timeout)} s (the host is down, or a firewall drops the connection)"
    except OSError as exc:
        reason = (exc.strerror or str(exc)).lower()
    raise RayClusterError(f"cannot reach the Ray cluster at {where}: {reason}. {_HOW_TO_ADDRESS}")


def _token_mode() -> bool:
    return os.environ.get("RAY_AUTH_MODE", "").strip().lower() == "token"


def _token_hint(where: str, has_token: bool) -> str:
    if has_token:
        problem = "refused this process's authentication token"
    else:
        problem = "asks for an authentication token, and this process has none"
    return (
        f"the Ray cluster at {where} {problem}: set RAY_AUTH_MODE=token and give this process the cluster's "
        "token (in ~/.ray/auth_token, in the file RAY_AUTH_TOKEN_PATH names, or in RAY_AUTH_TOKEN) before it "
        "starts; for a notebook, in the environment of its kernel."
    )


def _probe_gcs(address: str, where: str, timeout: float) -> bool:
    """Ask the address for its cluster id the way Ray does, without a token: a Ray head
    answers, or says it wants a token; anything else is no Ray head, said fast (Ray itself
    would retry for about 40 s). True when the cluster wants a token this process has."""
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except Exception:  # another Ray layout: Ray's own checks follow
        return False
    channel = grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)])
    try:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        request = gcs_service_pb2.GetClusterIdRequest()  # type: ignore[attr-defined]  # (not in Ray's stubs)
        stub.GetClusterId(request, timeout=timeout)
        return False
    except grpc.RpcError as exc:
        code = exc.code()
    finally:
        channel.close()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        if _token_mode():
            return True  # Ray sends the token
        raise RayClusterError(_token_hint(where, has_token=False))
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        detail = f"it accepts connections but says nothing within {_number(timeout)} s"
    elif code == grpc.StatusCode.UNIMPLEMENTED:
        detail = f"it is a gRPC server of another kind (a Ray Client server is one: join that as 'ray://{address}')"
    elif code == grpc.StatusCode.UNAVAILABLE:
        detail = "it does not speak gRPC"
    else:
        return False
    raise RayClusterError(f"something answers at {where}, but it is not a Ray head (GCS): {detail}. {_HOW_TO_ADDRESS}")


_VERSIONS = re.compile(
    r"started with:\s*Ray: (?P<ray>\S+)\s*Python: (?P<python>\S+).*?"
    r"was started with:\s*Ray: (?P<my_ray>\S+)\s*Python: (?P<my_python>\S+)",
    re.DOTALL,
)


def _join_error(exc: Exception, where: str, wants_token: bool) -> Exception:
    text = str(exc)
    versions = _VERSIONS.search(text) if "Version mismatch" in text else None
    if versions:
        theirs, mine = (versions["ray"], versions["python"]), (versions["my_ray"], versions["my_python"])
        fixes = []
        if theirs[0] != mine[0]:
            fixes.append(f"Ray {theirs[0]} (pip install 'ray[default]=={theirs[0]}')")
        if theirs[1] != mine[1]:
            fixes.append(f"Python {theirs[1]}")
        return RayClusterError(
            f"the Ray cluster at {where} runs Ray {theirs[0]} on Python {theirs[1]}, and this process Ray "
            f"{mine[0]} on Python {mine[1]}: Ray wants the same versions on both sides. Use an environment "
            f"with {' and '.join(fixes)}, or a cluster started with this process's versions."
        )
    if type(exc).__name__ == "AuthenticationError":  # RAY_AUTH_MODE=token, and no token to be found
        return RayClusterError(_token_hint(where, has_token=False))
    if wants_token and isinstance(exc, ConnectionError):
        return RayClusterError(_token_hint(where, has_token=True))
    if isinstance(exc, ValueError):
        return ConfigurationError(f"ray.init() refused the arguments: {exc}")
    if isinstance(exc, ConnectionError) and where.startswith("auto"):
        return RayClusterError(f"no Ray cluster runs on this machine (address='auto'). Ray said: {_first_line(text)}")
    return RayClusterError(f"could not join the Ray cluster at {where}: {type(exc).__name__}: {_first_line(text)}")


def _check_local_gpus(min_gpus: int) -> None:
    from air_magic.accelerators import detect_hardware

    hardware = detect_hardware()
    if hardware.gpu_count < min_gpus:
        have = f"{_count(hardware.gpu_count, 'GPU')}" if hardware.gpu_count else "no NVIDIA GPU (CPU only)"
        raise AcceleratorMismatchError(
            f"min_gpus={min_gpus} was asked for, but this machine has {have}, so a Ray cluster started here "
            "would not have them. Pass the address of a cluster with GPU nodes, or ask for fewer GPUs."
        )


# -- helpers -------------------------------------------------------------------------------


def _leave(ray: Any) -> None:
    """After a failed ``ray.init``: no half-made connection stays behind."""
    global _connection
    _connection = None
    try:
        if ray.is_initialized():
            ray.shutdown()
    except Exception:  # pragma: no cover - best effort
        pass


def _gcs_address(ray: Any, context: Any) -> str | None:
    info = getattr(context, "address_info", None)
    if isinstance(info, dict) and info.get("gcs_address"):
        return str(info["gcs_address"])
    try:
        return str(ray.get_runtime_context().gcs_address) or None
    except Exception:
        return None


def _dashboard_url(context: Any) -> str | None:
    try:
        url = getattr(context, "dashboard_url", None)
    except Exception:
        url = None
    if not url:
        return None
    url = str(url)
    return url if "://" in url else f"http://{url}"


def _same_place(one: str, other: str) -> bool:
    """The same cluster address: equal, or one port on hosts that are both this machine."""
    if one == other:
        return True
    (host_a, port_a), (host_b, port_b) = _split(one), _split(other)
    if port_a != port_b or ("://" in one) != ("://" in other):
        return False
    if host_a == host_b:
        return True
    local = set(_local_names())
    return all(_is_loopback(host) or host in local for host in (host_a, host_b))


def _local_names() -> Iterator[str]:
    yield "localhost"
    yield socket.gethostname()
    try:
        import ray

        yield ray.util.get_node_ip_address()
    except Exception:
        pass


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "(no message)"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _count(value: float, noun: str) -> str:
    return f"{_number(value)} {noun}{'' if value == 1 else 's'}"
