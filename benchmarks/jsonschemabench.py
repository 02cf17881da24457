"""JSONSchemaBench on the SmolLM2 vocabulary: our `json` controller against llguidance, xgrammar
and outlines-core, on the same files in one run.

    .venv/bin/python benchmarks/jsonschemabench.py [--data ../shared/jsonschemabench]
        [--engines ours,ours-default,llguidance,xgrammar,outlines] [--timeout 20] [--only PREFIX,...]
        [--limit N] [--timing mask|step] [--json benchmarks/results/jsonschemabench.json]
        [--plot jsonschemabench.png] [--resume]

The data: JSONSchemaBench files in MaskBench's format, `{"schema", "tests": [{"data", "valid"}]}`
(the default folder is `../shared/jsonschemabench` from the repository root). A file's source
subset is its name's prefix (`Github_hard---o123.json` -> `Github_hard`, `BFCL_simple_7.json`
-> `BFCL_simple`).

Per engine and schema, twice: in compact mode (no whitespace) and in flexible-whitespace mode.
1. compile the schema (timed: from the schema text to something that gives the first mask);
2. walk each test instance token by token on its SmolLM2 tokenization: the compact
   serialisation in compact mode, the instance's own indented text (`json.dumps(indent=2)`) in
   flexible mode. At each step the mask is computed (timed) and must allow the instance's next
   token; at the end the engine must allow EOS (or stop by itself).
A valid instance refused is a **validation error**, an invalid one accepted an **invalidation
error** (counted per instance).

Ours runs twice. `ours` is the specification's reading (`"x-rudder-undeclared": "allow"`: an
object without `additionalProperties` takes any key), which is what the test instances are
judged by: the coverage figures. `ours-default` is the controller's default (declared
properties only, docs/json-schema.md), where a valid instance with a key its schema does not
declare (or an item past a tuple) is refused by design: those refusals are counted apart
(`undeclared`: refused by ours-default and accepted by ours, and listed as explained when the
instance has a key no part of the schema names, or an array longer than a tuple of it), and
`pass*` counts the schemas that pass when they are set aside. A schema **passes** when it compiles in both modes and every
instance is judged right in both. Compile errors are counted per schema, with their messages in
the JSON file.

How each engine runs: in its own worker process, one schema at a time; a worker that takes
longer than `--timeout` seconds on one schema (both modes, all walks) is killed and restarted,
and the schema counts as a **timeout** (not passing). Ours: the real sandbox
(`rudder.controller.ControllerRuntime`), the built-in `json` controller, a request started per
mode with fast-forward off (`max_ff_tokens=0`: every step is a mask); a mask's time is the
whole step call through the host (the Wasm call, the guest's work, decoding the Branch), and
the compile time is starting the request. Walks after the first go back to the start with a
backtrack (caches stay warm, as the peers' `reset()`). llguidance: `LLMatcher` with
`whitespace_flexible` per mode, `fill_next_token_bitmask`. xgrammar: `compile_json_schema`
(`any_whitespace`, compact separators), `GrammarMatcher.fill_next_token_bitmask`.
outlines-core: `build_regex_from_schema` (whitespace pattern `""` or `[ \\t\\n\\r]*`), `Index`,
`Guide.write_mask_into`. With `--timing mask` (the default) consuming a token is not timed for
the peers: their time is the mask fill alone, ours the whole step. `--timing step` times the
peers' step as a decoding loop pays it, consuming the sampled token and filling the next mask
(`consume_token` / `accept_token` / `advance`, then the fill), which is what ours does in its one
call: a like-for-like comparison (the first mask, before any token, is not timed for anyone).

A full run takes hours (the peers' slow compiles and timeouts). With `--json`, the records so
far are saved every 50 files (`"partial": true`, the mask times beside it in `FILE.masks.npz`);
`--resume` goes on from such a checkpoint of the same files, engines and timeout.

The machine is shared and noisy: compare engines within one run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import re
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "host"))
sys.path.insert(0, str(ROOT / "benchmarks"))

ENGINES = ("ours", "ours-default", "llguidance", "xgrammar", "outlines")
DEFAULT_DATA = ROOT.parent / "shared" / "jsonschemabench"
GOALS = {"compile_p95_ms": 5.0, "mask_p99_us": 200.0}


def subset_of(name: str) -> str:
    stem = name[:-5] if name.endswith(".json") else name
    return re.sub(r"_\d+$", "", stem.split("---")[0])


def instance_texts(data) -> tuple[str, str]:
    """(compact, indented) serialisations of a test instance."""
    return (json.dumps(data, separators=(",", ":"), ensure_ascii=False),
            json.dumps(data, indent=2, ensure_ascii=False))


# -- engines (each lives in a worker process) ---------------------------------------------------


class CompileError(Exception):
    pass


def _allowed(mask, t: int) -> bool:
    return bool((int(mask[t >> 5]) >> (t & 31)) & 1)


def walk_peer(fill, mask, consume, ids, step: bool):
    """A peer's walk over `ids`: `fill()` writes the next mask into `mask` (bitmask words),
    `consume(t)` takes a token (False: refused). Timed per step: the fill alone, or (`step`)
    consuming the last token and the next fill. Returns (times, index where it stopped or None)."""
    times = []
    t0 = time.perf_counter()
    for i, t in enumerate(ids):
        if not step:
            t0 = time.perf_counter()
        fill()
        if i or not step:
            times.append(time.perf_counter() - t0)
        if not _allowed(mask, t):
            return times, i
        t0 = time.perf_counter()
        if not consume(t):
            return times, i
    fill()
    if step and ids:
        times.append(time.perf_counter() - t0)
    return times, None


class Ours:
    undeclared = "allow"   # the specification's reading: what the instances are judged by

    def __init__(self, tok, folder):
        from rudder.controller import ControllerRuntime
        from rudder.controller.build import builtin_controller

        self.tok = tok
        self.rt = ControllerRuntime(tok, cache_dir=False, max_instances=16)
        self.module = self.rt.load(builtin_controller("json"))
        self.rt.start(self.module, "{}").close()   # the module's one-time set-up, outside the timings

    @classmethod
    def argument(cls, schema, flexible: bool) -> str:
        options = {"x-rudder-whitespace": "flexible"} if flexible else {}
        if cls.undeclared:
            options["x-rudder-undeclared"] = cls.undeclared
        if options:
            schema = {**schema, **options} if isinstance(schema, dict) else {"allOf": [schema], **options}
        return json.dumps(schema, ensure_ascii=False)

    def compile(self, schema, flexible: bool):
        from rudder.controller import ControllerError, Limits

        try:
            ctl = self.rt.start(self.module, self.argument(schema, flexible), Limits(max_ff_tokens=0))
        except ControllerError as e:
            raise CompileError(f"{e.kind}: {str(e)[:300]}") from None
        return {"ctl": ctl, "generated": None}

    def walk(self, m, ids: list[int], step: bool = False):  # (one call: always the whole step)
        from rudder.controller import ControllerError

        ctl = m["ctl"]
        times = []
        try:
            if m["generated"] is None:
                branches = ctl.mid_process(0, 0, [self.tok.bos_token_id])
            else:
                branches = ctl.mid_process(0, m["generated"], [])
            m["generated"] = 0
            for i, t in enumerate(ids):
                if not branches or branches[0].mask is None or not _allowed(branches[0].mask, t):
                    return False, times, i
                t0 = time.perf_counter()
                branches = ctl.mid_process(0, 0, [t])
                times.append(time.perf_counter() - t0)
                m["generated"] += 1
            done = not branches or (branches[0].mask is not None and _allowed(branches[0].mask, self.tok.eos_token_id))
            return done, times, len(ids)
        except ControllerError as e:
            m["error"] = f"{e.kind}: {str(e)[:200]}"
            return False, times, -1

    def close(self, m):
        m["ctl"].close()


class OursDefault(Ours):
    undeclared = None   # the controller's default: declared properties only


class LLGuidance:
    def __init__(self, tok, folder):
        import llguidance
        import llguidance.numpy as llnp

        self.ll, self.llnp = llguidance, llnp
        self.lltok = llguidance.LLTokenizer(str(folder / "tokenizer.json"), eos_token=tok.eos_token_id)
        self.bitmask = llnp.allocate_token_bitmask(1, tok.vocab_size)
        self.eos = tok.eos_token_id

    def compile(self, schema, flexible: bool):
        opts = {"whitespace_flexible": flexible}
        if not flexible:
            opts.update(item_separator=",", key_separator=":")
        try:
            grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=opts)
            m = self.ll.LLMatcher(self.lltok, grammar)
        except Exception as e:   # noqa: BLE001 - the message is the result
            raise CompileError(str(e)[:300]) from None
        if m.is_error():
            raise CompileError(m.get_error()[:300])
        return m

    def walk(self, m, ids, step: bool = False):
        m.reset()
        times, stop = walk_peer(lambda: self.llnp.fill_next_token_bitmask(m, self.bitmask, 0), self.bitmask[0],
                                m.consume_token, ids, step)
        if stop is not None:
            return False, times, stop
        return _allowed(self.bitmask[0], self.eos) or m.is_stopped(), times, len(ids)

    def close(self, m):
        pass


class XGrammar:
    def __init__(self, tok, folder):
        import xgrammar

        self.xgr = xgrammar
        specials = tok.special_token_ids
        vocab = [b"" if i in specials else b for i, b in enumerate(tok.token_bytes)]
        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=tok.vocab_size,
                                      stop_token_ids=[tok.eos_token_id])
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.bitmask = xgrammar.allocate_token_bitmask(1, tok.vocab_size)
        self.eos = tok.eos_token_id

    def compile(self, schema, flexible: bool):
        try:
            compiled = self.compiler.compile_json_schema(
                json.dumps(schema), any_whitespace=flexible, separators=None if flexible else (",", ":"),
                strict_mode=False)
            return self.xgr.GrammarMatcher(compiled)
        except Exception as e:   # noqa: BLE001
            raise CompileError(str(e)[:300]) from None

    def walk(self, m, ids, step: bool = False):
        m.reset()
        times, stop = walk_peer(lambda: m.fill_next_token_bitmask(self.bitmask), self.bitmask[0], m.accept_token,
                                ids, step)
        if stop is not None:
            return False, times, stop
        return _allowed(self.bitmask[0], self.eos) or m.is_terminated(), times, len(ids)

    def close(self, m):
        pass


class Outlines:
    def __init__(self, tok, folder):
        import outlines_core

        self.oc = outlines_core
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(tok.token_bytes):
            if i not in tok.special_token_ids and b:
                by_bytes.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(tok.eos_token_id, by_bytes)
        self.mask = np.zeros((tok.vocab_size + 31) // 32, dtype=np.int32)
        self.eos = tok.eos_token_id

    def compile(self, schema, flexible: bool):
        try:
            regex = self.oc.json_schema.build_regex_from_schema(
                json.dumps(schema), whitespace_pattern=r"[ \t\n\r]*" if flexible else "")
            return self.oc.Guide(self.oc.Index(regex, self.vocabulary))
        except BaseException as e:   # noqa: BLE001 - pyo3 panics are BaseException
            raise CompileError(str(e)[:300]) from None

    def walk(self, g, ids, step: bool = False):
        g.reset()
        mask = self.mask

        def advance(t):
            try:
                g.advance(t, return_tokens=False)
                return True
            except BaseException:   # noqa: BLE001 - pyo3 panics are BaseException
                return False

        times, stop = walk_peer(lambda: g.write_mask_into(mask.ctypes.data, mask.size, 4), mask.view(np.uint32),
                                advance, ids, step)
        if stop is not None:
            return False, times, stop
        return _allowed(mask.view(np.uint32), self.eos) or g.is_finished(), times, len(ids)

    def close(self, g):
        pass


MAKERS = {"ours": Ours, "ours-default": OursDefault, "llguidance": LLGuidance, "xgrammar": XGrammar, "outlines": Outlines}


def run_schema(engine, tok, path: Path, step: bool = False) -> dict:
    """Compile and walk one file on one engine (both modes)."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    schema, tests = doc["schema"], doc.get("tests", [])
    res = {"compile_ms": [], "error": None, "walks": [], "mask_us": []}
    for flexible in (False, True):
        t0 = time.perf_counter()
        try:
            m = engine.compile(schema, flexible)
        except CompileError as e:
            res["error"] = f"{'flexible' if flexible else 'compact'}: {e}"
            return res
        res["compile_ms"].append((time.perf_counter() - t0) * 1e3)
        try:
            for k, test in enumerate(tests):
                text = instance_texts(test["data"])[1 if flexible else 0]
                ids = tok.encode(text)
                accepted, times, at = engine.walk(m, ids, step)
                res["mask_us"] += [x * 1e6 for x in times]
                walk = {"test": k, "flexible": flexible, "valid": bool(test["valid"]), "accepted": accepted,
                        "at": at, "n": len(ids)}
                if isinstance(m, dict) and m.get("error"):
                    walk["error"] = m.pop("error")
                res["walks"].append(walk)
        finally:
            engine.close(m)
    return res


def worker(name: str, data_dir: str, conn, step: bool = False) -> None:
    """Serves one engine: receives file names, answers result dicts (or None for 'done')."""
    from rudder.model_files import fetch_model
    from rudder.tokenizer import Tokenizer

    folder = fetch_model(progress=False)
    tok = Tokenizer.from_folder(folder)
    try:
        engine = MAKERS[name](tok, folder)
    except ImportError as e:
        conn.send({"unavailable": f"not installed ({e})"})
        return
    conn.send({"ready": True})
    while True:
        try:
            file_name = conn.recv()
        except EOFError:   # the main process is gone
            return
        if file_name is None:
            return
        try:
            res = run_schema(engine, tok, Path(data_dir) / file_name, step)
        except Exception:   # noqa: BLE001 - a crash of the engine on this schema is its result
            res = {"compile_ms": [], "error": "crash: " + traceback.format_exc(limit=2)[-300:], "walks": [], "mask_us": []}
        conn.send(res)


class Worker:
    """One engine's worker process; restarted after a timeout."""

    def __init__(self, name: str, data_dir: Path, step: bool = False):
        self.name, self.data_dir, self.step = name, str(data_dir), step
        self.proc = None
        self.unavailable = None
        self.start()

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker, args=(self.name, self.data_dir, child, self.step), daemon=True)
        self.proc.start()
        hello = self.conn.recv()
        self.unavailable = hello.get("unavailable")

    def run(self, file_name: str, timeout: float) -> dict:
        self.conn.send(file_name)
        if self.conn.poll(timeout):
            return self.conn.recv()
        self.proc.kill()
        self.proc.join()
        self.start()
        return {"timeout": True}

    def close(self) -> None:
        if self.proc and self.proc.is_alive():
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(timeout=5)
            if self.proc.is_alive():
                self.proc.kill()


# -- aggregation -----------------------------------------------------------------------------------


def summarize(records: dict[str, dict], mask_us: np.ndarray) -> dict:
    """Counts and percentiles over the files in `records` (file -> per-schema record)."""
    s = {"schemas": len(records), "passing": 0, "compile_errors": 0, "timeouts": 0,
         "validation_errors": 0, "invalidation_errors": 0, "schemas_with_validation_errors": 0,
         "schemas_with_invalidation_errors": 0}
    compile_ms = []
    for r in records.values():
        if r.get("timeout"):
            s["timeouts"] += 1
            continue
        if r["error"]:
            s["compile_errors"] += 1
            continue
        compile_ms.append(r["compile_ms"][0])
        bad_valid = sum(1 for w in r["walks"] if w["valid"] and not w["accepted"])
        bad_invalid = sum(1 for w in r["walks"] if not w["valid"] and w["accepted"])
        s["validation_errors"] += bad_valid
        s["invalidation_errors"] += bad_invalid
        s["schemas_with_validation_errors"] += bad_valid > 0
        s["schemas_with_invalidation_errors"] += bad_invalid > 0
        s["passing"] += bad_valid == 0 and bad_invalid == 0
    if compile_ms:
        c = np.asarray(compile_ms)
        s.update(compile_p50_ms=float(np.median(c)), compile_p95_ms=float(np.percentile(c, 95)),
                 compile_max_ms=float(c.max()))
    if mask_us.size:
        s.update(mask_p50_us=float(np.median(mask_us)), mask_p99_us=float(np.percentile(mask_us, 99)),
                 mask_max_us=float(mask_us.max()), masks=int(mask_us.size))
    return s


# Formats the json controller enforces (docs/json-schema.md); others are annotations there.
ENFORCED_FORMATS = {"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                    "uri-reference", "uuid"}


# Keywords whose value maps names to subschemas: those names are data, not keywords.
NAMED_SUBSCHEMAS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"}


def relaxed(schema):
    """The schema as docs/json-schema.md says the json controller enforces it: no `uniqueItems`,
    `oneOf` generated like `anyOf`, formats it does not know as annotations."""
    if isinstance(schema, list):
        return [relaxed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "uniqueItems" or (key == "format" and isinstance(value, str) and value not in ENFORCED_FORMATS):
            continue
        if key in NAMED_SUBSCHEMAS and isinstance(value, dict):
            out[key] = {name: relaxed(sub) for name, sub in value.items()}
        else:
            out["anyOf" if key == "oneOf" else key] = relaxed(value)
    return out


def documented_invalidations(records: dict[str, dict], data: Path) -> tuple[int, int, list[str]]:
    """(documented, undocumented, files with undocumented ones) among the invalid instances an
    engine accepted: documented when the instance is valid under `relaxed(schema)` (checked
    with the `jsonschema` package), i.e. a relaxation docs/json-schema.md lists explains it."""
    import jsonschema

    documented = undocumented = 0
    files = []
    for f, r in records.items():
        bad = {w["test"] for w in r.get("walks", []) if not w["valid"] and w["accepted"]}
        if not bad:
            continue
        doc = json.loads((data / f).read_text())
        schema = relaxed(doc["schema"])
        cls = jsonschema.validators.validator_for(schema)
        for k in sorted(bad):
            walks = sum(1 for w in r["walks"] if w["test"] == k and not w["valid"] and w["accepted"])
            try:
                ok = cls(schema, format_checker=cls.FORMAT_CHECKER).is_valid(doc["tests"][k]["data"])
            except Exception:  # noqa: BLE001 - a schema the validator cannot take explains nothing
                ok = False
            if ok:
                documented += walks
            else:
                undocumented += walks
                files.append(f)
    return documented, undocumented, sorted(set(files))


def declared_names(schema) -> tuple[set[str], list[str], int]:
    """Every key any part of the schema names (properties, required, dependentRequired,
    propertyNames enums), its patternProperties patterns, and its longest tuple (0: none)."""
    names, patterns, longest = set(), [], 0

    def visit(s):
        nonlocal longest
        if isinstance(s, list):
            for x in s:
                visit(x)
            return
        if not isinstance(s, dict):
            return
        for key, value in s.items():
            if key == "properties" and isinstance(value, dict):
                names.update(value)
            elif key == "patternProperties" and isinstance(value, dict):
                patterns.extend(value)
            elif key == "required" and isinstance(value, list):
                names.update(v for v in value if isinstance(v, str))
            elif key in ("dependentRequired", "dependencies") and isinstance(value, dict):
                names.update(value)
                for v in value.values():
                    if isinstance(v, list):
                        names.update(x for x in v if isinstance(x, str))
            elif key == "propertyNames" and isinstance(value, dict) and isinstance(value.get("enum"), list):
                names.update(v for v in value["enum"] if isinstance(v, str))
            elif key == "prefixItems" and isinstance(value, list) or key == "items" and isinstance(value, list):
                longest = max(longest, len(value))
            if key in NAMED_SUBSCHEMAS and isinstance(value, dict):
                for sub in value.values():
                    visit(sub)
            elif key not in ("enum", "const", "default", "examples", "example"):
                visit(value)

    visit(schema)
    return names, patterns, longest


def has_undeclared(data, names: set[str], patterns: list[str], longest: int) -> bool:
    """Does the instance hold a key the schema names nowhere (and no pattern matches), or an
    array past the schema's longest tuple (when it has one)?"""
    if isinstance(data, dict):
        for k, v in data.items():
            if k not in names and not any(_search(p, k) for p in patterns):
                return True
            if has_undeclared(v, names, patterns, longest):
                return True
    elif isinstance(data, list):
        return (longest and len(data) > longest) or any(has_undeclared(v, names, patterns, longest) for v in data)
    return False


def _search(pattern: str, text: str) -> bool:
    try:
        return re.search(pattern, text) is not None
    except re.error:
        return True   # (a pattern Python cannot read: count the key as matched, conservatively)


def default_mode_breakdown(default: dict[str, dict], spec: dict[str, dict], data: Path) -> dict:
    """ours-default's validation errors split: a valid instance it refuses that ours (the
    specification's reading) accepts is refused for its undeclared keys or items, by design;
    the rest are ordinary validation errors. `passing_set_aside`: the schemas that pass when
    those refusals are not counted."""
    out = {"undeclared": 0, "undeclared_explained": 0, "other_validation_errors": 0, "passing_set_aside": 0,
           "unexplained_files": []}
    for f, r in default.items():
        if r.get("timeout") or r["error"]:
            continue
        s = spec.get(f)
        accepted = {(w["test"], w["flexible"]) for w in (s or {}).get("walks", []) if w["accepted"]}
        doc, info = None, None
        bad = False
        for w in r["walks"]:
            if w["valid"] and not w["accepted"]:
                if (w["test"], w["flexible"]) in accepted:
                    out["undeclared"] += 1
                    if doc is None:
                        doc = json.loads((data / f).read_text(encoding="utf-8"))
                        info = declared_names(doc["schema"])
                    if has_undeclared(doc["tests"][w["test"]]["data"], *info):
                        out["undeclared_explained"] += 1
                    elif f not in out["unexplained_files"]:
                        out["unexplained_files"].append(f)
                else:
                    out["other_validation_errors"] += 1
                    bad = True
            elif not w["valid"] and w["accepted"]:
                bad = True
        out["passing_set_aside"] += not bad
    return out


def error_reasons(records: dict[str, dict], n: int = 8) -> list[tuple[int, str]]:
    """The most common compile errors, paths and quoted names cut out (to group them)."""
    counts: dict[str, int] = {}
    for r in records.values():
        msg = "timeout" if r.get("timeout") else r.get("error")
        if msg:
            msg = msg.split("json: ", 1)[1] if "json: " in msg else msg.split(": ", 1)[-1]   # (ours: its own message)
            msg = re.sub(r'"[^"]*"|\'[^\']*\'|#[^ ]*|\d+', "_", msg)[:110]
            counts[msg] = counts.get(msg, 0) + 1
    return sorted(((c, m) for m, c in counts.items()), reverse=True)[:n]


def fmt(s: dict) -> str:
    def g(k, f="{:.1f}"):
        return f.format(s[k]) if k in s else "-"
    pct = 100 * s["passing"] / max(s["schemas"], 1)
    return (f"{s['passing']:>5} {pct:5.1f}% {s['compile_errors']:>5} {s['timeouts']:>4} {s['validation_errors']:>5}"
            f" {s['invalidation_errors']:>5} | {g('compile_p50_ms', '{:.2f}'):>7} {g('compile_p95_ms', '{:.2f}'):>7}"
            f" {g('compile_max_ms', '{:.0f}'):>7} | {g('mask_p50_us'):>6} {g('mask_p99_us'):>7} {g('mask_max_us', '{:.0f}'):>7}")


HEADER = (f"{'engine':<13} {'pass':>5} {'%':>6} {'c.err':>5} {'t/o':>4} {'v.err':>5} {'i.err':>5} |"
          f" {'c p50ms':>7} {'c p95':>7} {'c max':>7} | {'m p50us':>6} {'p99':>7} {'max':>7}")


def plot(summary: dict, masks: dict[str, np.ndarray], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = [e for e in summary["total"] if "schemas" in summary["total"][e]]
    subsets = sorted(summary["subsets"])
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [3, 1]})
    ax = axes[0]
    width = 0.8 / max(len(engines), 1)
    for k, e in enumerate(engines):
        vals = [100 * summary["subsets"][sub][e]["passing"] / max(summary["subsets"][sub][e]["schemas"], 1)
                for sub in subsets]
        ax.bar(np.arange(len(subsets)) + k * width, vals, width, label=f"{e} ({summary['total'][e]['passing']})")
    ax.set_xticks(np.arange(len(subsets)) + 0.4 - width / 2, subsets, rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("% of schemas passing")
    ax.legend(fontsize=8)
    ax.set_title("Passing schemas per subset (compiled, every instance judged right, both modes)", fontsize=9)
    ax = axes[1]
    data = [np.maximum(masks[e], 0.1) for e in engines if masks[e].size]
    ax.boxplot(data, whis=(1, 99), showfliers=False)
    ax.set_xticks(range(1, len(data) + 1), [e for e in engines if masks[e].size], rotation=30, fontsize=8)
    ax.set_yscale("log")
    ax.axhline(GOALS["mask_p99_us"], color="red", linestyle=":", linewidth=1)
    ax.set_ylabel("µs per mask (whiskers p1-p99)")
    ax.set_title("Mask time", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def save_checkpoint(path: Path, files: list[str], data: Path, timeout: float, records: dict, masks: dict,
                    done: int) -> None:
    """The records of the first `done` files, and their mask times (one array per engine, with
    the count per file), written beside each other; each file is replaced whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for e, per_file in masks.items():
        arrays[f"{e}.us"] = np.concatenate(per_file) if per_file else np.zeros(0, np.float32)
        arrays[f"{e}.n"] = np.asarray([m.size for m in per_file], dtype=np.int64)
    tmp = path.with_name(path.name + ".masks.tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path.with_name(path.name + ".masks.npz"))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"partial": True, "done": done, "files": len(files), "file_names": files,
                               "data": str(data), "timeout_s": timeout, "engines": list(records),
                               "records": records}) + "\n")
    tmp.replace(path)


def load_checkpoint(path: Path, files: list[str], engines: list[str], timeout: float):
    """(records, masks, done) from a checkpoint of this very run (same files, engines, timeout)."""
    d = json.loads(path.read_text())
    if not d.get("partial"):
        raise SystemExit(f"{path} is not a checkpoint (a finished run, or another file)")
    if d["file_names"] != files or d["engines"] != engines or d["timeout_s"] != timeout:
        raise SystemExit(f"{path} is a checkpoint of other files, engines or timeout")
    done = d["done"]
    arrays = np.load(path.with_name(path.name + ".masks.npz"))
    masks = {}
    for e in engines:
        counts = arrays[f"{e}.n"]
        if len(counts) != done:
            raise SystemExit(f"{path}: the mask times do not match the records")
        masks[e] = list(np.split(arrays[f"{e}.us"], np.cumsum(counts)[:-1])) if done else []
    return d["records"], masks, done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, from: " + ", ".join(ENGINES))
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds per schema and engine (both modes, all walks)")
    ap.add_argument("--only", default="", help="comma-separated file name prefixes")
    ap.add_argument("--limit", type=int, default=0, help="the first N files (after --only)")
    ap.add_argument("--json", type=Path, help="write the summary and per-schema records here")
    ap.add_argument("--plot", type=Path, help="draw passing per subset and mask times (PNG)")
    ap.add_argument("--resume", action="store_true", help="go on from the checkpoint in --json")
    ap.add_argument("--timing", choices=("mask", "step"), default="mask",
                    help="the peers' timed unit: the mask fill alone, or consuming a token and the next fill")
    args = ap.parse_args()
    if args.resume and not args.json:
        ap.error("--resume needs --json (the checkpoint)")
    engines = args.engines.split(",")
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        ap.error(f"unknown engine(s): {', '.join(unknown)}")
    files = sorted(p.name for p in args.data.glob("*.json"))
    if args.only:
        files = [f for f in files if f.startswith(tuple(args.only.split(",")))]
    if args.limit:
        files = files[: args.limit]
    if not files:
        ap.error(f"no .json files in {args.data}")

    workers = {e: Worker(e, args.data, args.timing == "step") for e in engines}
    for e, w in list(workers.items()):
        if w.unavailable:
            print(f"{e}: {w.unavailable}")
            w.close()
            del workers[e]
    records = {e: {} for e in workers}
    masks = {e: [] for e in workers}
    done = 0
    if args.resume:
        records, masks, done = load_checkpoint(args.json, files, list(workers), args.timeout)
        print(f"resuming after {done} files", file=sys.stderr, flush=True)
    t_start = time.perf_counter()
    try:
        for i, f in enumerate(files):
            if i < done:
                continue
            for e, w in workers.items():
                r = w.run(f, args.timeout)
                m = np.asarray(r.pop("mask_us", []), dtype=np.float32)
                masks[e].append(m)
                if m.size:
                    r["mask_max_us"] = float(m.max())
                records[e][f] = r
            if (i + 1) % 100 == 0 or i + 1 == len(files):
                line = ", ".join(f"{e} {sum(1 for r in records[e].values() if not r.get('timeout') and not r['error'])}"
                                 for e in workers)
                print(f"[{i + 1}/{len(files)} files, {time.perf_counter() - t_start:.0f} s] compiled: {line}",
                      file=sys.stderr, flush=True)
            if args.json and (i + 1) % 50 == 0 and i + 1 < len(files):
                save_checkpoint(args.json, files, args.data, args.timeout, records, masks, i + 1)
    finally:
        for w in workers.values():
            w.close()

    by_subset: dict[str, list[int]] = {}
    for i, f in enumerate(files):
        by_subset.setdefault(subset_of(f), []).append(i)
    all_masks = {e: np.concatenate(masks[e]) if masks[e] else np.zeros(0) for e in workers}
    summary = {"total": {}, "subsets": {}}
    for e in workers:
        summary["total"][e] = summarize(records[e], all_masks[e])
    for sub, idx in sorted(by_subset.items()):
        summary["subsets"][sub] = {}
        for e in workers:
            recs = {files[i]: records[e][files[i]] for i in idx}
            m = np.concatenate([masks[e][i] for i in idx]) if idx else np.zeros(0)
            summary["subsets"][sub][e] = summarize(recs, m)

    # the files every engine compiled (both modes): validation errors and speed on equal terms
    common = [i for i, f in enumerate(files) if all(not records[e][f].get("timeout") and not records[e][f]["error"] for e in workers)]
    summary["common"] = {e: summarize({files[i]: records[e][files[i]] for i in common},
                                      np.concatenate([masks[e][i] for i in common]) if common else np.zeros(0))
                         for e in workers}
    print(f"\n{len(files)} files from {args.data}; SmolLM2 vocabulary; timeout {args.timeout:g} s per schema and engine;"
          f" {time.perf_counter() - t_start:.0f} s; timing: {args.timing}\n")
    print(HEADER)
    for e in workers:
        print(f"{e:<13} {fmt(summary['total'][e])}")
    print(f"\non the {len(common)} files every engine compiled:")
    for e in workers:
        print(f"{e:<13} {fmt(summary['common'][e])}")
    print("\nper subset:")
    for sub in summary["subsets"]:
        print(f"{sub} ({summary['subsets'][sub][next(iter(workers))]['schemas']} files)")
        for e in workers:
            print(f"  {e:<13} {fmt(summary['subsets'][sub][e])}")
    print("\nmost common compile errors:")
    for e in workers:
        summary["total"][e]["error_reasons"] = error_reasons(records[e])
        for count, msg in summary["total"][e]["error_reasons"]:
            print(f"  {e:<13} {count:>4}  {msg}")
    if "ours-default" in workers and "ours" in workers:
        b = default_mode_breakdown(records["ours-default"], records["ours"], args.data)
        summary["total"]["ours-default"]["breakdown"] = b
        print(f"\nours-default (declared properties only): {b['undeclared']} valid instances refused for keys or items "
              f"their schema does not declare (accepted in the specification's reading; {b['undeclared_explained']} hold a "
              f"key no part of the schema names or an array past its tuples"
              + (f"; the others in {', '.join(b['unexplained_files'][:10])}" if b["unexplained_files"] else "")
              + f"), {b['other_validation_errors']} other validation errors; passing with those refusals set aside: "
              f"{b['passing_set_aside']}")
    if "ours" in workers:
        t = summary["total"]["ours"]
        checks = []
        for peer in ("llguidance",):
            if peer in workers:
                p = summary["total"][peer]
                checks.append(f"passing >= {peer}'s: {'ok' if t['passing'] >= p['passing'] else 'MISSED'}")
                checks.append(f"validation errors <= {peer}'s: "
                              f"{'ok' if t['validation_errors'] <= p['validation_errors'] else 'MISSED'}")
        if "compile_p95_ms" in t:
            checks.append(f"compile p95 <= {GOALS['compile_p95_ms']:g} ms: "
                          f"{'ok' if t['compile_p95_ms'] <= GOALS['compile_p95_ms'] else 'MISSED'}")
        if "mask_p50_us" in t:
            peers = [summary["total"][p]["mask_p50_us"] for p in ("llguidance", "xgrammar")
                     if p in workers and "mask_p50_us" in summary["total"][p]]
            if peers:
                checks.append(f"mask p50 <= min(llguidance, xgrammar): {'ok' if t['mask_p50_us'] <= min(peers) else 'MISSED'}")
            checks.append(f"mask p99 <= {GOALS['mask_p99_us']:g} µs: {'ok' if t['mask_p99_us'] <= GOALS['mask_p99_us'] else 'MISSED'}")
        documented, undocumented, files_undoc = documented_invalidations(records["ours"], args.data)
        t.update(invalidation_documented=documented, invalidation_undocumented=undocumented,
                 invalidation_undocumented_files=files_undoc)
        print(f"\nours: invalidation errors explained by a documented relaxation {documented}, not explained "
              f"{undocumented}" + (f" ({', '.join(files_undoc[:10])})" if files_undoc else ""))
        checks.append(f"no undocumented invalidation error: {'ok' if undocumented == 0 else 'MISSED'}")
        print("\ngoals (ours): " + "; ".join(checks))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"files": len(files), "data": str(args.data), "timeout_s": args.timeout,
                                         "timing": args.timing,
                                         "summary": summary, "records": records}, indent=1) + "\n")
        print(f"saved {args.json}")
    if args.plot:
        plot(summary, all_masks, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
