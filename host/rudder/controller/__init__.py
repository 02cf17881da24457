"""The controller sandbox: runs untrusted WebAssembly controllers (docs/abi.md) that steer
decoding token by token.

    runtime = ControllerRuntime(tokenizer)          # one per LLM/server
    module = runtime.load(wasm_bytes_or_path)       # validated, compiled, cached by sha256
    ctl = runtime.start(module, arg, limits)        # one per request (rudder_init runs once)
    branches = ctl.mid_process(branch_idx, backtrack, tokens)   # each step
    child = ctl.fork(); ctl.close()

One sandbox for every controller shape. Shared: limits (Limits), errors (ControllerError),
budgets (guest memory, snapshots), capi (cffi binding of wasmtime's C API), engines (engines
and epoch tickers), store (one Store: limits, deadlines, memory accounting), host_api
(request and host state, the host functions' logic), module_cache / compiler (compiled code),
controller (the Controller and ControllerModule facade), runtime (ControllerRuntime: load,
init, start). What differs per shape - checks, instantiation, the calling convention, lifting
the answer, copying state - is in core (core modules: module, instance, result, snapshot,
host_api's imports) and component (components: component_types, component_instance,
component_result, component_host).
"""

from .controller import Controller, ControllerModule
from .errors import ControllerError
from .host_api import RequestContext
from .limits import Limits
from .runtime import ControllerRuntime
from .token_table import build_token_table, token_table_for

__all__ = ["Controller", "ControllerError", "ControllerModule", "ControllerRuntime", "Limits",
           "RequestContext", "build_token_table", "token_table_for"]
