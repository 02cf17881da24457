"""The controller registry: uploaded modules by sha256 (content-addressed: uploading the same
bytes twice is one module), and tags naming them. The built-in controllers are tagged by name
at start-up. Compiled code is cached on disk by the runtime's ModuleCache; this keeps the
loaded modules of the server alive (the runtime's in-memory cache is an LRU)."""

from __future__ import annotations

import logging
import re
import threading
import time

from ..controller import ControllerError, ControllerModule, ControllerRuntime
from .errors import APIError, controller_error

log = logging.getLogger("rudder.server")
_MODULE_ID = re.compile(r"^[0-9a-f]{64}$")


class Registry:
    def __init__(self, runtime: ControllerRuntime, max_modules: int):
        self.runtime = runtime
        self.max_modules = max_modules
        self.modules: dict[str, ControllerModule] = {}
        self.tags: dict[str, str] = {}
        self.builtin: set[str] = set()
        self._lock = threading.Lock()

    def add(self, wasm: bytes) -> dict:
        """Validate, compile and keep a module; returns its description. Slow (compiles):
        call it off the event loop."""
        t0 = time.perf_counter()
        try:
            module = self.runtime.load(wasm)
        except ControllerError as e:
            raise controller_error(e) from None
        with self._lock:
            if module.sha256 not in self.modules and len(self.modules) >= self.max_modules:
                raise APIError("payload_too_large", f"the registry is full ({self.max_modules} modules)")
            self.modules[module.sha256] = module
        return {"module_id": module.sha256, "wasm_size": module.wasm_size, "compiled_size": module.compiled_size,
                "time_ms": round((time.perf_counter() - t0) * 1000, 3)}

    def add_builtins(self, names) -> None:
        """Build (first use only) and tag every built-in controller; one that fails to build
        is left out with a warning, not fatal."""
        from ..controller.build import BuildError, builtin_controller

        for name in names:
            try:
                info = self.add(builtin_controller(name).read_bytes())
            except (BuildError, APIError, OSError) as e:
                log.warning("built-in controller %s is unavailable: %s", name, str(e).splitlines()[0])
                continue
            self.tags[name] = info["module_id"]
            self.builtin.add(name)

    def tag(self, tag: str, module_id: str) -> None:
        with self._lock:
            if tag in self.builtin:
                raise APIError("forbidden", f"{tag!r} names a built-in controller and cannot be re-tagged")
            if module_id not in self.modules:
                raise APIError("not_found", f"no module {module_id}")
            self.tags[tag] = module_id

    def resolve(self, name: str) -> ControllerModule:
        """A module by tag or by module id."""
        module_id = self.tags.get(name, name)
        module = self.modules.get(module_id)
        if module is None:
            what = "module" if _MODULE_ID.match(name) else "controller tag"
            raise APIError("not_found", f"no {what} {name!r} (GET /v1/controllers/tags lists the tags)")
        return module

    def describe(self) -> list[dict]:
        names = {}
        for tag, mid in self.tags.items():
            names.setdefault(mid, []).append(tag)
        return [{"module_id": m.sha256, "wasm_size": m.wasm_size, "compiled_size": m.compiled_size,
                 "tags": sorted(names.get(sha, []))} for sha, m in self.modules.items()]
