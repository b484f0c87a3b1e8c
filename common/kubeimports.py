"""kubernetes_asyncio without its generated code: most of a node agent's memory.

kubernetes-asyncio 36.1 imports all its generated code from its package `__init__`s:
`kubernetes_asyncio/__init__.py` imports `client`, whose `__init__` imports every API
class and every model (about 1,000 modules, 35 MiB of a node agent's RSS), and
`client/api_client.py` imports the `client.models` package, whose `__init__` imports
every model again. Python runs each parent package's `__init__` before a submodule, so
even `import kubernetes_asyncio.config.kube_config` pays for all of it. gpudra uses
none of it: `common/kube.py` exchanges plain JSON and needs only `Configuration`, the
config loaders and the `ApiClient`'s auth and connection pool. The pinned version has
no lighter import path (upstream tracks lazy models as tomplus/kubernetes_asyncio#293).

Weighed and rejected: copying the config loaders (a fork of the auth code: exec
plugins, token refresh, OIDC, in-cluster token rotation); `importlib.util.LazyLoader`
(the import system reads a parent's `__path__` to import a submodule, which would run
the very `__init__` we defer).

What we do instead: the three package `__init__`s that pull the generated code in are
deferred, PEP 562 style. Each package exists with its real spec and `__path__`, so its
submodules import as usual; its module `__getattr__` imports a submodule on first access
and, for any other name, runs the package's real `__init__` once, in the package's own
namespace. So code that does use a model or an API class gets the same objects as
before, loaded at first use instead of at import. This is set up once, explicitly, by
`defer_generated_code()`, which `Kube.connect` calls before it imports the client:
that is the one place gpudra imports kubernetes_asyncio, so every entry point (the
node agent, the webhook, the CLI, the benchmarks) gets the light client from it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import threading
import types
from typing import Final

PACKAGES: Final = (
    "kubernetes_asyncio",
    "kubernetes_asyncio.client",
    "kubernetes_asyncio.client.models",
)

# What `client/__init__.py` defines by hand before its generated imports; the config
# loaders import `ApiClient` and `Configuration` from the package itself.
CLIENT_CORE: Final = (
    ("api_client", ("ApiClient",)),
    ("configuration", ("Configuration",)),
    (
        "exceptions",
        (
            "OpenApiException",
            "ApiTypeError",
            "ApiValueError",
            "ApiKeyError",
            "ApiAttributeError",
            "ApiException",
        ),
    ),
)


class DeferredInit:
    """The module `__getattr__` of a package whose `__init__` has not run yet.

    The real `__init__` runs under a lock, so a second thread asking meanwhile waits
    for it as it would for an import; this `__getattr__` is removed once it has run.
    """

    def __init__(self, package: types.ModuleType, loader: importlib.abc.Loader) -> None:
        self._package = package
        self._loader = loader
        self._lock = threading.RLock()
        self._ran = False

    def __call__(self, attr: str) -> object:
        name = self._package.__name__
        maybe_submodule = attr.isidentifier() and not attr.startswith("__")
        if maybe_submodule and importlib.util.find_spec(f"{name}.{attr}") is not None:
            return importlib.import_module(f"{name}.{attr}")
        with self._lock:
            if not self._ran:
                self._ran = True
                try:
                    self._loader.exec_module(self._package)
                finally:
                    self._package.__dict__.pop("__getattr__", None)
            elif "__getattr__" in self._package.__dict__:
                # Asked again, on this thread, while the `__init__` runs: what a
                # partially initialised module answers.
                raise AttributeError(
                    f"partially initialised module {name!r} has no attribute {attr!r}"
                )
        return getattr(self._package, attr)


def defer_package(name: str) -> types.ModuleType:
    """Put package `name` in `sys.modules` with its `__init__` deferred.

    A subpackage's parent must be imported, or deferred, first.
    """
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        raise ImportError(f"{name} is not an installed package; reinstall the one that has it")
    package = importlib.util.module_from_spec(spec)
    package.__dict__["__getattr__"] = DeferredInit(package, spec.loader)
    sys.modules[name] = package
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, package)
    return package


def defer_generated_code() -> None:
    """Import kubernetes_asyncio's packages with their generated code deferred.

    Idempotent: once kubernetes_asyncio is imported, deferred or in full (a test that
    imported it first), this does nothing. So it must run before the first import of
    kubernetes_asyncio anywhere in the process; gpudra imports it only in `Kube.connect`,
    after calling this.
    """
    if PACKAGES[0] in sys.modules:
        return
    try:
        for name in PACKAGES:
            defer_package(name)
        client = sys.modules["kubernetes_asyncio.client"]
        for module, names in CLIENT_CORE:
            source = importlib.import_module(f"kubernetes_asyncio.client.{module}")
            for attr in names:
                setattr(client, attr, getattr(source, attr))
    except BaseException:
        # Leave no half-deferred package behind: a later import then loads it in full.
        for name in [m for m in sys.modules if m.split(".")[0] == PACKAGES[0]]:
            del sys.modules[name]
        raise
