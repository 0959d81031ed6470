"""Registries of objectives and advantage estimators, in verl's pattern (core_algos.py: `register_policy_loss`,
`register_adv_est`), and the one builder both `grad` and `train` use.

    @register_policy_loss("my_loss")              # a class with from_config(cfg, batch) (losses/objective.py)
    @dataclass(kw_only=True)
    class MyLoss(TokenObjective): ...

    @register_adv_est("my_adv")                    # (rollouts, rewards, index, cfg) -> rollouts with advantages
    def my_adv(rollouts, rewards, index, cfg): ...

    objective = build_objective(cfg, batch)       # cfg: losses.config.ObjectiveConfig; batch: the GLOBAL batch

Adding an objective is one file (the class, decorated) and one line importing it in losses/__init__.py; a user's
own objective lives in their module, loaded by name at start-up (`load_plugins`: `grad --plugin MODULE`, the train
config's `algorithm.plugins`), without touching the package. The registries are the one module-level state of
the losses: written at import time by the decorators, read by name afterwards.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from megatron_branch.data import Rollout
from megatron_branch.errors import SettingError, UserError
from megatron_branch.losses.config import ObjectiveConfig

C = TypeVar("C")
T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """name -> entry, written by a decorator at import time: a name registered twice for different code is a
    programming error (ValueError; the same code again, e.g. a module imported under two names, is fine), an
    unknown name a SettingError listing the registered ones."""

    def __init__(self, what: str, setting: str, *, code: Callable[[T], Any] = lambda entry: entry) -> None:
        super().__init__()
        self.what = what
        """What an entry is, for the errors ("policy loss")."""
        self.setting = setting
        """The setting that names an entry (its spelling per entry point: rules/)."""
        self.code = code
        """entry -> the class or function it wraps (what "the same code" compares)."""

    def add(self, name: str, entry: T) -> None:
        old = self.get(name)
        if old is not None and _qualname(self.code(old)) != _qualname(self.code(entry)):
            raise ValueError(f"{self.what} {name!r} is already registered ({_qualname(self.code(old))})")
        self[name] = entry

    def lookup(self, name: str) -> T:
        entry = self.get(name)
        if entry is None:
            known = ", ".join(sorted(self))
            raise SettingError(
                lambda s: (
                    f"unknown {s.name(self.setting)} {name!r}; registered: {known} (a plugin module can "
                    f"register its own: {s.name('plugins')})"
                )
            )
        return entry


POLICY_LOSSES: Registry[Any] = Registry("policy loss", "policy_loss")
"""name -> objective class (with `from_config(cfg, batch)`)."""


def register_policy_loss(*names: str) -> Callable[[C], C]:
    """Class decorator: register an objective class under `names` (the first is its name, the rest aliases)."""
    assert names, "give the objective a name"

    def deco(cls: C) -> C:
        assert hasattr(cls, "from_config"), f"{cls!r} needs a from_config(cfg, batch) classmethod"
        for name in names:
            POLICY_LOSSES.add(name, cls)
        return cls

    return deco


def objective_class(name: str) -> Any:
    """The registered objective class `name`; an unknown name is a SettingError listing the registered ones. A
    name "family:member" is the class registered as "family:" (e.g. "verl:gspo": verl's own loss function), which
    checks the member (`check_name`)."""
    family, sep, member = name.partition(":")
    if sep and member:
        cls = POLICY_LOSSES.lookup(family + sep)
        cls.check_name(name)
        return cls
    return POLICY_LOSSES.lookup(name)


def build_objective(cfg: ObjectiveConfig, batch: Sequence[Rollout]) -> Any:
    """The objective `cfg.policy_loss` names, with cfg's settings, normalised on the GLOBAL batch `batch` (every
    rollout of the update, on every rank)."""
    return objective_class(cfg.policy_loss).from_config(cfg, batch)


# ---- advantage estimators --------------------------------------------------------------------------------------

AdvantageFn = Callable[[Sequence[Rollout], Sequence[float], Sequence[Hashable], Any], list[Rollout]]
"""(rollouts, rewards [one per rollout], index [the prompt instance of each rollout: verl's uid], cfg) -> the
rollouts with `advantage` (or per-token `advantages`, and `returns` for a critic) set."""


@dataclass(frozen=True, kw_only=True)
class AdvantageEstimator:
    """A registered estimator and what it needs from the loop."""

    name: str
    compute: AdvantageFn
    needs_values: bool = False
    """The rollouts must carry the critic's per-token `values` before `compute` (a critic is trained: PPO)."""
    group_relative: bool = False
    """Advantages compare the rollouts of one prompt: a group of one learns nothing (rollout.n >= 2)."""


ADV_ESTIMATORS: Registry[AdvantageEstimator] = Registry(
    "advantage estimator", "adv_estimator", code=lambda est: est.compute
)


def register_adv_est(
    name: str, *, needs_values: bool = False, group_relative: bool = False
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Function decorator: register an advantage estimator (the function is returned unchanged)."""

    def deco(fn: AdvantageFn) -> AdvantageFn:
        est = AdvantageEstimator(
            name=name, compute=fn, needs_values=needs_values, group_relative=group_relative
        )
        ADV_ESTIMATORS.add(name, est)
        return fn

    return deco


ADV_FAMILIES: dict[str, Callable[[str], AdvantageEstimator]] = {}
"""prefix ("verl:") -> factory of the estimator "prefix + member" (a one-line SettingError for a member it cannot
run)."""


def register_adv_family(
    prefix: str,
) -> Callable[[Callable[[str], AdvantageEstimator]], Callable[[str], AdvantageEstimator]]:
    """Function decorator: estimators named `prefix + member`, built by the decorated factory(member)."""
    assert prefix.endswith(":"), "a family prefix ends with ':'"

    def deco(factory: Callable[[str], AdvantageEstimator]) -> Callable[[str], AdvantageEstimator]:
        ADV_FAMILIES[prefix] = factory
        return factory

    return deco


def get_adv_estimator(name: str) -> AdvantageEstimator:
    """The estimator `name`: a registered one, or a family's member ("verl:gpg": verl's own function)."""
    family, sep, member = name.partition(":")
    if sep and member and family + sep in ADV_FAMILIES:
        return ADV_FAMILIES[family + sep](member)
    return ADV_ESTIMATORS.lookup(name)


# ---- plugins ---------------------------------------------------------------------------------------------------


def load_plugins(specs: Sequence[str]) -> None:
    """Import each plugin: a dotted module on sys.path, or a .py file. Its decorators register what it defines. A
    module already imported (by the same name or from the same file) is not imported again."""
    for spec in specs:
        try:
            _import(spec)
        except UserError:
            raise
        except Exception as exc:  # ImportError, or the module's own error at import time
            raise SettingError(
                lambda s, spec=spec, exc=exc: (
                    f"cannot import {s.name('plugins')} {spec!r}: {type(exc).__name__}: {exc}".replace(
                        "\n", " "
                    )
                )
            ) from None


def _import(spec: str) -> None:
    if not spec.endswith(".py") and "/" not in spec:
        found = importlib.util.find_spec(spec)
        if found is None:
            raise ModuleNotFoundError(f"no module named {spec!r}")
        if not (found.origin and _imported(Path(found.origin).resolve())):
            importlib.import_module(spec)
        return
    path = Path(spec).resolve()
    if not path.is_file():
        raise SettingError(lambda s: f"{s.name('plugins')} {spec!r}: no such file")
    if _imported(path):
        return
    name = f"megatron_branch_plugin_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)


def _imported(path: Path) -> bool:
    """Some imported module comes from this file (pytest imported the test file that registers a toy objective,
    under its own name): importing it again would register its objects twice."""
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if f is not None and Path(f).resolve() == path:
            return True
    return False


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
