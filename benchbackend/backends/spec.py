"""What a registry entry declares: a backend's identity, modes, precisions, devices and capabilities.

Everything here is plain data, readable without importing any framework: ``--help``, ``list``,
the CLI's validation, the README's backend table, the tests' parametrization and CI's extras all
read it. The adapter (``target``) is imported only by the worker.
"""
from __future__ import annotations

import importlib
import importlib.util
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class Mode:
    """One execution strategy of a backend (eager, compiled, XLA, static graph, tuned, ...)."""

    name: str
    description: str
    #: ``model.vocabulary`` words the mode is about (``attention`` for a fused attention kernel): on a
    #: workload with none of them it would time the default mode again, so its cells are ``unavailable``.
    needs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Capabilities:
    """What an adapter can do beyond the contract every adapter keeps (``backends.base.Backend``).

    The worker acts on these declarations, never on what an adapter object happens to have.
    """

    #: The adapter measures a GEMM peak in its own framework (``Backend.gemm_peak``); it joins the
    #: other probes on the device, the best of which is MFU's denominator (``benchbackend.run.peaks``).
    peak_probe: bool = False
    #: The adapter sets its intra-op threads from ``--threads`` and reports them (``Backend.threads``).
    thread_control: bool = False
    #: ``module:Class`` of the adapter that trains ``--replicas N`` > 1 on the framework's own
    #: data-parallel engine (``benchbackend.spec.replicas``); "" where there is none yet (``unavailable``).
    replicas: str = ""
    #: That adapter can also join a process group made outside its worker (``options.rendezvous``),
    #: so that under ``--executor ray`` Ray Train's ``TorchTrainer`` starts its replicas across nodes.
    ray_train: bool = False


def gpu_index(device: str, backend: str) -> Optional[int]:
    """The GPU index ``--device`` asks for, or None for ``cpu``: ``gpu``/``cuda`` is 0; ``gpu:N``,
    ``cuda:N`` and TensorFlow's ``/GPU:N`` are N. Any other form raises ``BackendUnavailable``
    (the registry has checked the forms a backend takes; this catches a direct caller)."""
    if device == "cpu":
        return None
    if device in ("gpu", "cuda"):
        return 0
    match = re.fullmatch(r"(?:gpu|cuda|/GPU):(\d+)", device)
    if match is None:
        from ..errors import BackendUnavailable

        raise BackendUnavailable(f"{backend}: unknown device {device!r}; use cpu, gpu, gpu:N or cuda:N")
    return int(match.group(1))


#: The network vocabulary every adapter builds (``model.vocabulary``'s words): the CNN layer types.
CNN_LAYERS = ("conv2d", "maxpool2d", "dropout", "flatten", "dense", "activation", "batchnorm", "add",
              "global_avgpool")
#: The transformer's words: its layer types, ``tokens`` for any layer reading a token sequence
#: (dense, dropout, add, global_avgpool on tokens) and ``gelu`` for the GELU activation.
TRANSFORMER_LAYERS = ("tokens", "class_token", "position_embedding", "layernorm", "attention", "select_token",
                      "gelu")
#: The decoder's words (language models): its layer types, the ``silu`` activation, and the
#: conventions each of which changes the numbers when an adapter ignores it (``model.vocabulary``).
DECODER_LAYERS = ("embedding", "rmsnorm", "multiply", "silu", "causal", "rope", "kv_heads", "no_bias", "tied",
                  "next_token")
#: Words that are not layer types: what ``cannot_build`` names as conventions.
_CONVENTIONS = {"causal": "the causal mask", "rope": "rotary positions", "kv_heads": "grouped key/value heads",
                "no_bias": "layers without biases", "tied": "tied embeddings", "next_token": "next-token training",
                "gelu": "the gelu activation", "silu": "the silu activation"}


def _no_env(device: str) -> dict[str, str]:
    return {}


@dataclass(frozen=True)
class BackendSpec:
    """A backend's registry entry: everything the CLI, ``list`` and the runner need without importing it.

    ``modes``: the first is the default. ``precisions``: ``fp32`` always. ``trains``: False for
    inference-only runtimes, which get build, parity and inference rows only.
    """

    name: str
    #: "package.module:ClassName" of the adapter (imported by the worker only).
    target: str
    #: Top-level modules the adapter needs, first the framework itself: all must be importable.
    requires: tuple[str, ...]
    #: Distribution whose version ``list`` shows.
    dist_name: str
    #: The command that installs it.
    install: str
    description: str
    modes: tuple[Mode, ...]
    precisions: tuple[str, ...] = ("fp32",)
    trains: bool = True
    #: Environment variables of its worker, set before the framework is imported (by device asked).
    env: Callable[[str], dict[str, str]] = field(default=_no_env)
    #: The ``pyproject.toml`` extra that installs it (None: no extra, e.g. an isolated environment).
    extra: Optional[str] = None
    #: Modules the adapter imports only on some paths (CuPy on a GPU): never imported by the CLI either.
    optional: tuple[str, ...] = ()
    #: None: runs in the current interpreter; else the name of an isolated env (``benchbackend setup NAME``).
    isolated_env: Optional[str] = None
    #: An explicit interpreter for the workers (configs/backends.yaml), else None.
    python: Optional[str] = None
    #: ``--device`` forms it takes: literal names, ``N`` for an index, ``<...>`` for any id.
    devices: tuple[str, ...] = ("cpu", "gpu")
    capabilities: Capabilities = Capabilities()
    #: What its adapter builds, in ``model.vocabulary``'s words; a workload asking for more gets an
    #: ``unavailable`` row (``plan.cells``), decided before any worker starts.
    builds: tuple[str, ...] = CNN_LAYERS
    #: Why it does not build the rest (the framework lacks the ops, say); "" for "not yet".
    builds_note: str = ""
    #: ``--scenario``: the mode each scenario runs in where ``--mode`` names none of this backend's
    #: (OpenVINO's latency or throughput hint follows the scenario); a scenario not named: the default mode.
    scenario_modes: tuple[tuple[str, str], ...] = ()

    def cannot_build(self, words: Any, mode: Optional[str] = None) -> str:
        """Why its adapter cannot build a network of ``words`` (``model.vocabulary``) in ``mode``
        (default: its first), "" when it can."""
        missing = sorted(set(words) - set(self.builds))
        if missing:
            types = [w for w in missing if w not in _CONVENTIONS]
            others = [_CONVENTIONS[w] for w in missing if w in _CONVENTIONS]
            parts = ([f"layer types {', '.join(types)}"] if types else []) + others
            what = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
            plural = len(parts) > 1 or bool(types)
            why = f": {self.builds_note}" if self.builds_note else " by this adapter yet"
            return f"{self.name}: {what} {'are' if plural else 'is'} not implemented{why}"
        needs = next((m.needs for m in self.modes if m.name == mode), ())
        if needs and not set(needs) & set(words):
            return (f"{self.name}:{mode} is about {' or '.join(needs)} layers and this network has none "
                    f"(it would time {self.name}:{self.default_mode} again)")
        return ""

    def accepts(self, device: str) -> bool:
        """Whether ``--device`` has one of the forms in ``devices`` ("cuda:N": N digits; "<id>": any id)."""
        for form in self.devices:
            if form.startswith("<"):
                return True
            pattern = re.escape(form).replace("N", r"\d+")
            if re.fullmatch(pattern, device):
                return True
        return False

    @property
    def import_name(self) -> str:
        """The framework's own top-level module."""
        return self.requires[0]

    @property
    def mode_names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.modes)

    @property
    def default_mode(self) -> str:
        return self.modes[0].name

    def missing(self) -> list[str]:
        """The required modules that cannot be imported in this interpreter (none imported to find out)."""
        return [m for m in self.requires if importlib.util.find_spec(m) is None]

    def load_class(self) -> Any:
        return load_class(self.target)


def load_class(target: str) -> Any:
    """The adapter class named ``package.module:ClassName`` (importing it imports its framework)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
