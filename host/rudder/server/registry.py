"""The controller registry: uploaded modules by sha256 (content-addressed: the same bytes are one
module, whoever uploads them) and tags naming them, owned by the tenant that created them.

Durable and shared: modules and tags live in a RegistryStore (store.py), so a restart keeps
every acknowledged upload and tag, and replicas on one host sharing a state directory see each
other's. A module is loaded (validated, compiled or read from the compiled cache) on first use
in this process and kept in a small LRU: modules on disk are not modules in memory.

The built-in controllers are tagged by name at start-up, in memory only (they are built from
this version's sources); their names cannot be taken. Each built-in declares its backtrack depth
(`max_backtrack`, the streaming hold-back of openai_api.py; None = unknown).
"""

from __future__ import annotations

import collections
import logging
import re
import threading
import time
from dataclasses import dataclass

from ..controller import ControllerError, ControllerModule, ControllerRuntime
from .auth import Principal
from .errors import APIError, controller_error
from .store import RegistryStore, TagOwned

log = logging.getLogger("rudder.server")
MODULE_ID = re.compile(r"^[0-9a-f]{64}$")
COMPILE_RETRY_S = 5  # what a 503 for a busy compiler tells the client to wait

# Each built-in's backtrack depth N (once N tokens follow a token, it never takes that token
# back): the constraint controllers and the others never backtrack on their own; `backtrack`
# removes the tokens of its banned word (its argument, default " very"), at most one per byte,
# and a new occurrence may begin in the bytes just before its previous cut: twice the length.
BUILTIN_BACKTRACK = {"backtrack": lambda arg: 2 * len((arg or " very").encode("utf-8"))}


@dataclass
class Resolved:
    """What a request's `controller` names: the loaded module, its id, the tag it came by (if
    any) and its declared backtrack depth (None: unknown)."""

    module: ControllerModule
    module_id: str
    tag: str | None
    max_backtrack: int | None
    builtin: bool = False

    def backtrack_for(self, arg: str) -> int | None:
        rule = BUILTIN_BACKTRACK.get(self.tag) if self.builtin else None
        return rule(arg) if rule is not None else self.max_backtrack


class Registry:
    def __init__(self, runtime: ControllerRuntime, store: RegistryStore, max_modules: int = 256,
                 tenant_max_modules: int | None = None, max_loaded: int = 64):
        self.runtime = runtime
        self.store = store
        self.max_modules = max_modules
        self.tenant_max_modules = tenant_max_modules
        self.max_loaded = max_loaded
        self.builtin: dict[str, ControllerModule] = {}
        self._builtin_bytes: dict[str, bytes] = {}  # by module id: a tag may name a built-in's module
        self._loaded: "collections.OrderedDict[str, ControllerModule]" = collections.OrderedDict()
        self.in_use: collections.Counter = collections.Counter()  # module id -> live requests here
        self._lock = threading.Lock()

    # -- modules --------------------------------------------------------------------------------

    def add(self, wasm: bytes, who: Principal) -> dict:
        """Validate, compile and durably store a module; returns its description. Slow
        (compiles, fsyncs): call it off the event loop. A module over a compile limit is a 413
        naming the limit; no compile slot within the server's wait, a 503 with Retry-After."""
        t0 = time.perf_counter()
        try:
            module = self.runtime.load(wasm)
        except ControllerError as e:
            if e.busy:
                raise APIError("unavailable", f"the server is busy compiling other modules: {e}", code="compile_busy",
                               headers={"Retry-After": str(COMPILE_RETRY_S)}) from None
            if e.kind == "limit":
                raise APIError("payload_too_large", str(e), code="compile_limit", kind="limit") from None
            raise controller_error(e) from None
        sha = module.sha256
        if not self.store.has_module(sha):
            if self.store.count_modules() >= self.max_modules:
                raise APIError("payload_too_large", f"the registry is full ({self.max_modules} modules)",
                               code="registry_full")
        if self.tenant_max_modules is not None and self.store.uploads(who.tenant) >= self.tenant_max_modules \
                and who.tenant not in self._uploaders(sha):
            raise APIError("forbidden", f"tenant {who.tenant!r} has uploaded its {self.tenant_max_modules} "
                           "modules (ask an admin to remove unused ones)", code="module_quota")
        self.store.put_module(sha, wasm, who.tenant, module.compiled_size)
        self._keep(sha, module)
        return {"module_id": sha, "wasm_size": module.wasm_size, "compiled_size": module.compiled_size,
                "time_ms": round((time.perf_counter() - t0) * 1000, 3),
                "time": round((time.perf_counter() - t0) * 1000)}  # AICI's name for it

    def _uploaders(self, sha: str) -> list[str]:
        return next((m["uploaded_by"] for m in self.store.modules() if m["module_id"] == sha), [])

    def _keep(self, sha: str, module: ControllerModule) -> None:
        with self._lock:
            self._loaded[sha] = module
            self._loaded.move_to_end(sha)
            while len(self._loaded) > self.max_loaded:
                self._loaded.popitem(last=False)

    def add_builtins(self, names) -> None:
        """Build (first use only) and tag every built-in controller; one that fails to build
        is left out with a warning, not fatal."""
        from ..controller.build import BuildError, builtin_controller

        for name in names:
            try:
                wasm = builtin_controller(name).read_bytes()
                self.builtin[name] = module = self.runtime.load(wasm)
                self._builtin_bytes[module.sha256] = wasm
            except (BuildError, ControllerError, OSError) as e:
                log.warning("built-in controller %s is unavailable: %s", name, str(e).splitlines()[0])

    def remove_module(self, module_id: str, who: Principal) -> None:
        """An admin removes a module that no tag names and no request of this process runs."""
        if not who.admin:
            raise APIError("forbidden", "only an admin key may remove modules", code="admin_only")
        if module_id in {m.sha256 for m in self.builtin.values()}:
            raise APIError("forbidden", "built-in controllers cannot be removed")
        tags = [t["tag"] for t in self.store.tags() if t["module_id"] == module_id]
        if tags:
            raise APIError("conflict", f"the module is tagged ({', '.join(tags)}); delete its tags first",
                           code="module_tagged")
        if self.in_use[module_id]:
            raise APIError("conflict", f"{self.in_use[module_id]} running request(s) use the module",
                           code="module_in_use")
        try:
            removed = self.store.delete_module(module_id)
        except ValueError:  # tagged meanwhile, by another replica
            raise APIError("conflict", "the module is tagged", code="module_tagged") from None
        if not removed:
            raise APIError("not_found", f"no module {module_id}", param="module_id")
        with self._lock:
            self._loaded.pop(module_id, None)

    def prune(self, who: Principal) -> list[str]:
        """Remove every module no tag names and no request of this process runs (admin)."""
        if not who.admin:
            raise APIError("forbidden", "only an admin key may remove modules", code="admin_only")
        tagged = {t["module_id"] for t in self.store.tags()}
        removed = []
        for m in self.store.modules():
            sha = m["module_id"]
            if sha in tagged or self.in_use[sha]:
                continue
            try:
                if self.store.delete_module(sha):
                    removed.append(sha)
            except ValueError:
                continue
            with self._lock:
                self._loaded.pop(sha, None)
        return removed

    # -- tags -----------------------------------------------------------------------------------

    def tag(self, tag: str, module_id: str, who: Principal, max_backtrack: int | None = None) -> dict:
        """Create or move a tag. A tag belongs to the tenant that created it: only that tenant
        or an admin may move it."""
        if tag in self.builtin:
            raise APIError("forbidden", f"{tag!r} names a built-in controller and cannot be re-tagged",
                           param="tag", code="builtin_tag")
        if module_id in self._builtin_bytes and not self.store.has_module(module_id):
            # a built-in's module under a new name: stored, so the tag outlives this version's build
            builtin = next(m for m in self.builtin.values() if m.sha256 == module_id)
            self.store.put_module(module_id, self._builtin_bytes[module_id], who.tenant, builtin.compiled_size)
        try:
            info = self.store.set_tag(tag, module_id, who.tenant, max_backtrack,
                                      only_if_owner=None if who.admin else who.tenant)
        except KeyError:
            raise APIError("not_found", f"no module {module_id}", param="module_id") from None
        except TagOwned as e:
            raise APIError("forbidden", f"tag {tag!r} belongs to tenant {e.owner!r}", param="tag",
                           code="tag_owned") from None
        return self._tag_view(info, self._sizes())

    def untag(self, tag: str, who: Principal) -> None:
        if tag in self.builtin:
            raise APIError("forbidden", f"{tag!r} names a built-in controller", param="tag", code="builtin_tag")
        try:
            found = self.store.delete_tag(tag, only_if_owner=None if who.admin else who.tenant)
        except TagOwned as e:
            raise APIError("forbidden", f"tag {tag!r} belongs to tenant {e.owner!r}", param="tag",
                           code="tag_owned") from None
        if not found:
            raise APIError("not_found", f"no tag {tag!r}", param="tag")

    def _sizes(self) -> dict[str, tuple[int, int]]:
        return {m["module_id"]: (m["wasm_size"], m["compiled_size"]) for m in self.store.modules()}

    @staticmethod
    def _tag_view(t: dict, sizes: dict) -> dict:
        wasm_size, compiled_size = sizes.get(t["module_id"], (None, None))
        return {"tag": t["tag"], "module_id": t["module_id"], "owner": t["owner"], "builtin": False,
                "max_backtrack": t["max_backtrack"], "wasm_size": wasm_size, "compiled_size": compiled_size,
                "created_at": t["created_at"], "updated_at": t["updated_at"], "updated_by": t["updated_by"]}

    def tags(self) -> list[dict]:
        """Every tag, the built-ins first (AICI's list shape, plus owner and max_backtrack)."""
        out = [{"tag": name, "module_id": m.sha256, "owner": None, "builtin": True,
                "max_backtrack": None if name in BUILTIN_BACKTRACK else 0, "wasm_size": m.wasm_size,
                "compiled_size": m.compiled_size, "updated_at": 0, "updated_by": "rudder"}
               for name, m in sorted(self.builtin.items())]
        sizes = self._sizes()
        return out + [self._tag_view(t, sizes) for t in self.store.tags()]

    def describe(self) -> list[dict]:
        names: dict[str, list[str]] = {}
        for t in self.tags():
            names.setdefault(t["module_id"], []).append(t["tag"])
        out = [{"module_id": m.sha256, "wasm_size": m.wasm_size, "compiled_size": m.compiled_size,
                "builtin": True, "uploaded_by": [], "tags": sorted(names.get(m.sha256, []))}
               for m in self.builtin.values()]
        for m in self.store.modules():
            out.append({"module_id": m["module_id"], "wasm_size": m["wasm_size"], "compiled_size": m["compiled_size"],
                        "builtin": False,
                        "uploaded_by": m["uploaded_by"], "created_at": m["created_at"],
                        "tags": sorted(names.get(m["module_id"], []))})
        return out

    # -- resolving a request's controller ---------------------------------------------------------

    def resolve_builtin(self, name: str) -> Resolved | None:
        """A built-in by name, in memory (no I/O): the fast path of every constrained request."""
        module = self.builtin.get(name)
        if module is None:
            return None
        return Resolved(module, module.sha256, name, 0, builtin=True)

    def resolve(self, name: str) -> Resolved:
        """A module by tag or module id, loaded from the store on first use in this process.
        Slow on first use (reads and maybe compiles): call it off the event loop."""
        found = self.resolve_builtin(name)
        if found is not None:
            return found
        tag = self.store.tag(name)
        module_id = tag["module_id"] if tag is not None else name
        module = self._module(module_id)
        if module is None:
            what = "module" if MODULE_ID.match(name) else "controller tag"
            raise APIError("not_found", f"no {what} {name!r} (GET /v1/controllers/tags lists the tags)",
                           param="controller", code="controller_not_found")
        return Resolved(module, module_id, tag["tag"] if tag else None, tag["max_backtrack"] if tag else None)

    def _module(self, module_id: str) -> ControllerModule | None:
        for m in self.builtin.values():
            if m.sha256 == module_id:
                return m
        with self._lock:
            module = self._loaded.get(module_id)
            if module is not None:
                self._loaded.move_to_end(module_id)
                return module
        if not MODULE_ID.match(module_id):
            return None
        wasm = self.store.module_bytes(module_id)
        if wasm is None:
            return None
        try:
            module = self.runtime.load(wasm)
        except ControllerError as e:  # stored by another version whose checks differed
            raise controller_error(e) from None
        self._keep(module_id, module)
        return module
