"""The finder that serves ``transformer_engine.*`` from transformer_fa, and the placeholders.

A placeholder stands for a TE name whose feature transformer_fa lacks. Module-level code of
TE's tests may touch it (``Float8Quantizer(...)`` in a parametrize list, ``DType.kFloat8E4M3``)
so that collection succeeds; attribute access, calls and indexing give further placeholders.
Any use that needs a real value (truth, iteration, arithmetic) raises NotInTransformerFA.
Every touch is recorded in ``touched``: the runner's plugin fails a test that touched one
while running, so a test that needs a missing feature cannot pass by accident.
"""
import importlib
import importlib.abc
import importlib.util
import sys
import types

from ._mapping import MODULES

touched = []  # "TE name (reason)" for every placeholder use since the plugin last cleared it


class NotInTransformerFA(RuntimeError):
    pass


def _touch(what: str, reason: str):
    touched.append(f"{what} ({reason})")
    return _AbsentValue(what, reason)


def _refuse(what, reason):
    raise NotInTransformerFA(f"{what} is TE's, not transformer_fa's: {reason}")


class _AbsentMeta(type):
    """Metaclass of top-level placeholders: classes, so ``isinstance(x, Float8Quantizer)``
    is simply False."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _touch(f"{cls._what}.{name}", cls._reason)

    def __call__(cls, *args, **kwargs):
        return _touch(f"{cls._what}(...)", cls._reason)

    def __getitem__(cls, key):
        return _touch(f"{cls._what}[{key!r}]", cls._reason)

    def __bool__(cls):
        _refuse(cls._what, cls._reason)

    def __repr__(cls):
        return f"<absent {cls._what}: {cls._reason}>"


def placeholder(what: str, reason: str) -> type:
    return _AbsentMeta(what.rsplit(".", 1)[-1], (), {"_what": what, "_reason": reason})


class _AbsentValue:
    """What a placeholder returns: more of the same, refusing any use that needs a value."""

    def __init__(self, what, reason):
        object.__setattr__(self, "_what", what)
        object.__setattr__(self, "_reason", reason)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _touch(f"{self._what}.{name}", self._reason)

    def __call__(self, *args, **kwargs):
        return _touch(f"{self._what}(...)", self._reason)

    def __getitem__(self, key):
        return _touch(f"{self._what}[{key!r}]", self._reason)

    def __repr__(self):
        return f"<absent {self._what}>"

    def _use(self, *args):
        _refuse(self._what, self._reason)

    __bool__ = __iter__ = __len__ = __index__ = __int__ = __float__ = __setattr__ = _use
    __lt__ = __le__ = __gt__ = __ge__ = __add__ = __sub__ = __mul__ = __truediv__ = _use


def _resolve_alias(alias: str):
    module_name, attr = alias.split(":")
    return getattr(importlib.import_module(module_name), attr)


class _ShimModule(types.ModuleType):
    """A TE module name whose attributes come from ``_mapping.MODULES[name]``."""

    def __init__(self, name, entry):
        super().__init__(name)
        self.__path__ = []  # a package, so that TE's submodules import under it
        self._entry = entry
        self._target = None
        if entry.target is not None:
            try:
                self._target = importlib.import_module(entry.target)
            except ImportError:
                if entry.absent is None:
                    raise

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        entry = self._entry
        value = entry.names.get(name)
        if value is not None:
            value = _resolve_alias(value) if ":" in value else placeholder(
                f"{self.__name__}.{name}", value)
        elif self._target is not None and hasattr(self._target, name):
            value = getattr(self._target, name)
        elif entry.absent is not None:
            value = placeholder(f"{self.__name__}.{name}", entry.absent)
        else:
            raise AttributeError(
                f"{self.__name__}.{name}: no transformer_fa equivalent is mapped (add one to "
                f"tools/te_suite/shim/transformer_engine/_mapping.py, or deselect the tests "
                f"that need it in tools/te_suite/deselect.py)")
        setattr(self, name, value)  # one object per name, as with a real module
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in MODULES:
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _ShimModule(spec.name, MODULES[spec.name])

    def exec_module(self, module):
        pass


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
