"""Token-mask speed of constraint engines on the SmolLM2 vocabulary: ours (Wasm controllers)
against llguidance, xgrammar and outlines-core.

    .venv/bin/python benchmarks/masks.py [--cases regex,json-schema,json-free,tools-128,tools-auto,grammar] [--passes 3]
                                         [--json benchmarks/results/masks.json] [--plot masks.png]

Each case walks a FIXED valid document token by token (its SmolLM2 tokenization) and times,
per engine, the work that gives the mask of every step:
- ours: the controller's real step call through the host runtime (`Controller.mid_process`:
  the Wasm call, the guest's work and decoding the Branch), with fast-forward turned off
  (`max_ff_tokens=0`) so that every step is a mask;
- llguidance: `fill_next_token_bitmask`; xgrammar: `GrammarMatcher.fill_next_token_bitmask`;
  outlines-core: `Guide.write_mask_into` (consuming the token is not timed for the peers).
`compile` is the time from the grammar text to something that gives the first mask (ours:
starting a request, which compiles the argument inside the controller and prepares the first
answer). The cases: a regex, a 5-property schema, free JSON, a union of 128 tool schemas (its
compile goal is 50 ms), the server's tool_choice "auto" grammar over 8 tools (text or tagged
calls, the call schema embedded with `%json`) and an arithmetic grammar.

Cold: a fresh compile, then one walk (caches empty: what a new request pays). Warm: the same
compiled object walks the document again (ours: a backtrack to the start, then the walk).
Both are repeated `--passes` times and pooled. Peers are optional imports ("not installed").
Our column is "n/a (controller not built)" while a case's controller does not exist yet.
The machine is shared and noisy: compare engines within one run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "host"))

from rudder.controller import ControllerRuntime, Limits  # noqa: E402
from rudder.controller.build import BUILTIN_CONTROLLERS, builtin_controller  # noqa: E402
from rudder.model_files import fetch_model  # noqa: E402
from rudder.tokenizer import Tokenizer  # noqa: E402

GOALS = {"compile_ms": 5.0, "p99_us": 500.0}
ENGINES = ("ours", "llguidance", "xgrammar", "outlines")

# -- the cases ----------------------------------------------------------------------------------

CITY_REGEX = r"[A-Z][a-z]{2,10} [0-9]{1,4}(, [A-Z][a-z]+)*\."

PERSON_SCHEMA = json.dumps({
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
            "required": ["street", "city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,   # (explicit: absent means "any other keys" in JSON Schema)
})

# The documents are json.dumps'd with spaces, as the peers' default grammars allow: our json
# controller generates compact JSON unless the schema asks for flexible whitespace.
PERSON_SCHEMA_OURS = json.dumps({**json.loads(PERSON_SCHEMA), "x-rudder-whitespace": "flexible"})
FREE_JSON_OURS = json.dumps({"x-rudder-whitespace": "flexible"})

def tool_union(n: int) -> dict:
    """A "call one of these tools" schema: anyOf of n {name, arguments} objects (what
    tool_choice "required" with n tools becomes), each tool with a few typed arguments."""
    kinds = [{"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
             {"type": "string", "enum": ["low", "mid", "high"]}, {"type": "array", "items": {"type": "string"}}]
    words = ["city", "date", "query", "limit", "unit", "lang", "user", "id", "amount", "currency", "start", "end"]
    alts = []
    for i in range(n):
        args = {words[(i + k) % len(words)]: kinds[(i * 7 + k) % len(kinds)] for k in range(1 + i % 4)}
        alts.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                     "properties": {"name": {"const": f"tool_{i}_{words[i % len(words)]}"},
                                    "arguments": {"type": "object", "properties": args, "required": list(args)[:2],
                                                  "additionalProperties": False}}})
    return {"anyOf": alts}


TOOLS_128 = json.dumps(tool_union(128))
TOOLS_128_OURS = json.dumps({**json.loads(TOOLS_128), "x-rudder-whitespace": "flexible"})


def auto_tools_grammar(n: int) -> str:
    """The grammar of the server's tool_choice "auto" over the n tools of tool_union: text, or
    <tool_call> blocks holding the call schema as a %json element."""
    from rudder.server.tools import ToolPlan

    tools = [{"type": "function", "function": {"name": alt["properties"]["name"]["const"],
                                               "parameters": alt["properties"]["arguments"]}}
             for alt in tool_union(n)["anyOf"]]
    return ToolPlan.of(tools, "auto", True).constraint.arg


AUTO_TOOLS_8 = auto_tools_grammar(8)
# llguidance's %json made compact, as ours is by default
AUTO_TOOLS_8_LLG = AUTO_TOOLS_8.replace("%json {", '%json {"x-guidance": {"whitespace_flexible": false}, ')

ARITH_LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")" | "-" factor
NUMBER: /[0-9]+(\.[0-9]+)?/
%ignore " "
"""

ARITH_GBNF = r"""
root ::= expr
expr ::= term (ws ("+" | "-") ws term)*
term ::= factor (ws ("*" | "/") ws factor)*
factor ::= number | "(" ws expr ws ")" | "-" factor
number ::= [0-9]+ ("." [0-9]+)?
ws ::= " "*
"""


@dataclass
class Case:
    """One constraint, as each engine spells it, and the document to walk. A spec is
    (kind, text); None: the engine cannot express it (the reason goes in `notes`)."""

    name: str
    document: str
    ours: tuple[str, str]                 # (controller, argument)
    llguidance: tuple[str, str] | None    # ("regex" | "json" | "lark", text)
    xgrammar: tuple[str, str] | None      # ("regex" | "json" | "builtin_json" | "ebnf", text)
    outlines: tuple[str, str] | None      # ("regex" | "json", text)
    notes: dict[str, str] = field(default_factory=dict)
    compile_goal_ms: float = GOALS["compile_ms"]


CASES = [
    Case("regex", "Paris 2024, London, Berlin, Kyoto, Oslo, Madrid, Rome, Vienna, Prague, Lisbon, Dublin.",
         ours=("regex", CITY_REGEX), llguidance=("regex", CITY_REGEX), xgrammar=("regex", CITY_REGEX),
         outlines=("regex", CITY_REGEX)),
    Case("json-schema",
         json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines"],
                     "address": {"street": "12 St James's Square", "city": "London"}}),
         ours=("json", PERSON_SCHEMA_OURS), llguidance=("json", PERSON_SCHEMA), xgrammar=("json", PERSON_SCHEMA),
         outlines=("json", PERSON_SCHEMA)),
    Case("json-free",
         json.dumps({"id": 7, "items": [1, 2.5, "x", None], "ok": True, "meta": {"a": {"b": [False, -3e2]}}}),
         ours=("json", FREE_JSON_OURS), llguidance=("json", "{}"), xgrammar=("builtin_json", ""),
         outlines=None, notes={"outlines": "n/a (a regex index of free JSON takes ~10 s to build)"}),
    Case("tools-128",
         json.dumps({"name": "tool_126_user", "arguments": {"user": "ada", "id": 3, "amount": 2.5}}),
         ours=("json", TOOLS_128_OURS), llguidance=("json", TOOLS_128), xgrammar=("json", TOOLS_128),
         outlines=("json", TOOLS_128), compile_goal_ms=50.0),
    Case("tools-auto",
         '<tool_call>\n{"name":"tool_7_id","arguments":{"id":3,"amount":2.5,"start":"mid"}}\n</tool_call>',
         ours=("grammar", AUTO_TOOLS_8), llguidance=("lark", AUTO_TOOLS_8_LLG), xgrammar=None, outlines=None,
         notes={"xgrammar": "n/a (its grammars here have no inline JSON Schema)",
                "outlines": "n/a (outlines-core has no context-free grammars)"}),
    Case("grammar", "(12 + 3.5) * 4 - 7 / (2 + 1) * 10 - -3 + (((8)))",
         # our grammar controller's syntax is the grammar helper's to define: Lark text here
         ours=("grammar", ARITH_LARK), llguidance=("lark", ARITH_LARK), xgrammar=("ebnf", ARITH_GBNF),
         outlines=None, notes={"outlines": "n/a (outlines-core has no context-free grammars)"}),
]

# -- engines: each returns (compile seconds, per-pass list of per-mask seconds) or a note --------


class NotAvailable(Exception):
    pass


def stats(seconds: list[float]) -> dict:
    us = np.asarray(seconds) * 1e6
    return {"median_us": float(np.median(us)), "p90_us": float(np.percentile(us, 90)),
            "p99_us": float(np.percentile(us, 99)), "max_us": float(us.max()), "n": int(us.size)}


class Ours:
    def __init__(self, tok: Tokenizer):
        self.rt = ControllerRuntime(tok, cache_dir=False, max_instances=16)
        self.modules = {}

    def run(self, case: Case, ids: list[int], passes: int):
        controller, arg = case.ours
        if controller not in BUILTIN_CONTROLLERS:
            raise NotAvailable("n/a (controller not built)")
        if controller not in self.modules:
            self.modules[controller] = self.rt.load(builtin_controller(controller))
        module = self.modules[controller]
        compiles, cold, warm = [], [], []
        for _ in range(passes):
            t0 = time.perf_counter()
            ctl = self.rt.start(module, arg, Limits(max_ff_tokens=0))
            compiles.append(time.perf_counter() - t0)
            try:
                cold += self._walk(ctl, [1], ids)
                warm += self._walk(ctl, [], ids, backtrack=len(ids))
            finally:
                ctl.close()
        return compiles, cold, warm

    @staticmethod
    def _walk(ctl, first: list[int], ids: list[int], backtrack: int = 0) -> list[float]:
        times = []
        t0 = time.perf_counter()
        branches = ctl.mid_process(0, backtrack, first)
        times.append(time.perf_counter() - t0)
        for t in ids:
            if not branches or branches[0].mask is None:
                raise RuntimeError(f"the controller did not give a mask before token {t}")
            t0 = time.perf_counter()
            branches = ctl.mid_process(0, 0, [t])
            times.append(time.perf_counter() - t0)
        return times[:-1]   # the last step follows the complete document: no mask needed there

    def close(self):
        self.rt.close()


class LLGuidance:
    def __init__(self, tok: Tokenizer, folder: Path):
        try:
            import llguidance
            import llguidance.numpy as llnp
        except ImportError:
            raise NotAvailable("not installed") from None
        self.ll, self.llnp = llguidance, llnp
        self.tok = llguidance.LLTokenizer(str(folder / "tokenizer.json"), eos_token=tok.eos_token_id)
        self.vocab = tok.vocab_size

    def grammar(self, spec):
        kind, text = spec
        M = self.ll.LLMatcher
        return {"regex": M.grammar_from_regex, "json": M.grammar_from_json_schema, "lark": M.grammar_from_lark}[kind](text)

    def run(self, case: Case, ids: list[int], passes: int):
        if case.llguidance is None:
            raise NotAvailable(case.notes.get("llguidance", "n/a"))
        bitmask = self.llnp.allocate_token_bitmask(1, self.vocab)
        compiles, cold, warm = [], [], []
        for _ in range(passes):
            t0 = time.perf_counter()
            m = self.ll.LLMatcher(self.tok, self.grammar(case.llguidance))
            compiles.append(time.perf_counter() - t0)
            if m.is_error():
                raise NotAvailable(f"error: {m.get_error()[:80]}")
            for sink in (cold, warm):
                m.reset()
                for t in ids:
                    t0 = time.perf_counter()
                    self.llnp.fill_next_token_bitmask(m, bitmask, 0)
                    sink.append(time.perf_counter() - t0)
                    if not m.consume_token(t):
                        raise NotAvailable(f"error: refused token {t}: {m.get_error()[:80]}")
        return compiles, cold, warm


class XGrammar:
    def __init__(self, tok: Tokenizer):
        try:
            import xgrammar
        except ImportError:
            raise NotAvailable("not installed") from None
        self.xgr = xgrammar
        specials = tok.special_token_ids
        vocab = [b"" if i in specials else b for i, b in enumerate(tok.token_bytes)]
        self.info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=tok.vocab_size,
                                           stop_token_ids=[tok.eos_token_id])
        self.vocab = tok.vocab_size

    def run(self, case: Case, ids: list[int], passes: int):
        if case.xgrammar is None:
            raise NotAvailable(case.notes.get("xgrammar", "n/a"))
        kind, text = case.xgrammar
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab)
        compiles, cold, warm = [], [], []
        for _ in range(passes):
            compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
            t0 = time.perf_counter()
            compiled = {"regex": compiler.compile_regex, "json": compiler.compile_json_schema,
                        "ebnf": compiler.compile_grammar,
                        "builtin_json": lambda _: compiler.compile_builtin_json_grammar()}[kind](text)
            m = self.xgr.GrammarMatcher(compiled)
            compiles.append(time.perf_counter() - t0)
            for sink in (cold, warm):
                m.reset()
                for t in ids:
                    t0 = time.perf_counter()
                    m.fill_next_token_bitmask(bitmask)
                    sink.append(time.perf_counter() - t0)
                    if not m.accept_token(t):
                        raise NotAvailable(f"error: refused token {t}")
        return compiles, cold, warm


class Outlines:
    def __init__(self, tok: Tokenizer):
        try:
            import outlines_core
        except ImportError:
            raise NotAvailable("not installed") from None
        self.oc = outlines_core
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(tok.token_bytes):
            if i not in tok.special_token_ids and b:
                by_bytes.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(tok.eos_token_id, by_bytes)
        self.words = (tok.vocab_size + 31) // 32

    def run(self, case: Case, ids: list[int], passes: int):
        if case.outlines is None:
            raise NotAvailable(case.notes.get("outlines", "n/a"))
        kind, text = case.outlines
        mask = np.zeros(self.words, dtype=np.int32)
        compiles, cold, warm = [], [], []
        for _ in range(passes):
            t0 = time.perf_counter()
            regex = text if kind == "regex" else self.oc.json_schema.build_regex_from_schema(text)
            guide = self.oc.Guide(self.oc.Index(regex, self.vocabulary))
            compiles.append(time.perf_counter() - t0)
            for sink in (cold, warm):
                guide.reset()
                for t in ids:
                    t0 = time.perf_counter()
                    guide.write_mask_into(mask.ctypes.data, mask.size, 4)
                    sink.append(time.perf_counter() - t0)
                    guide.advance(t, return_tokens=False)
        return compiles, cold, warm


# -- the run ------------------------------------------------------------------------------------


def fmt_row(name: str, r: dict) -> str:
    if "note" in r:
        return f"  {name:<11} {r['note']}"
    c, w = r["cold"], r["warm"]
    return (f"  {name:<11} {r['compile_ms']:>9.2f} | {c['median_us']:>8.1f} {c['p90_us']:>8.1f} {c['p99_us']:>8.1f}"
            f" {c['max_us']:>9.1f} | {w['median_us']:>8.1f} {w['p90_us']:>8.1f} {w['p99_us']:>8.1f} {w['max_us']:>9.1f}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, len(names), figsize=(max(7, 5 * len(names)), 4.8), squeeze=False)
    for ax, case in zip(axes[0], names):
        data, labels = [], []
        for eng in ENGINES:
            r = results[case]["engines"].get(eng, {})
            for phase in ("cold", "warm"):
                if "samples_us" in r:
                    data.append(np.maximum(r["samples_us"][phase], 0.1))
                    labels.append(f"{eng} {phase}")
        if data:
            ax.boxplot(data, whis=(1, 99), showfliers=True, flierprops={"markersize": 2})
            ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=7, rotation=35, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("µs per mask")
        ax.axhline(GOALS["p99_us"], color="red", linestyle=":", linewidth=1)
        ax.set_title(case)
    fig.suptitle("Per-mask time on the SmolLM2 vocabulary (whiskers: p1-p99; red: the p99 goal)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(c.name for c in CASES),
                    help=f"comma-separated, from: {', '.join(c.name for c in CASES)}")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, from: " + ", ".join(ENGINES))
    ap.add_argument("--passes", type=int, default=3, help="cold compiles (each followed by a warm walk)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--plot", type=Path, help="also draw the per-mask time distributions (PNG)")
    args = ap.parse_args()
    wanted = args.cases.split(",")
    unknown = sorted(set(wanted) - {c.name for c in CASES})
    if unknown:
        ap.error(f"unknown case(s): {', '.join(unknown)}")
    engines = args.engines.split(",")

    folder = fetch_model(progress=False)
    tok = Tokenizer.from_folder(folder)
    makers = {"ours": lambda: Ours(tok), "llguidance": lambda: LLGuidance(tok, folder),
              "xgrammar": lambda: XGrammar(tok), "outlines": lambda: Outlines(tok)}
    runners = {}
    for eng in engines:
        try:
            runners[eng] = makers[eng]()
        except NotAvailable as e:
            runners[eng] = str(e)

    print(f"goals: compile <= {GOALS['compile_ms']:g} ms; our median <= llguidance's; "
          f"p99 <= {GOALS['p99_us']:g} µs")
    print(f"vocabulary: SmolLM2 ({tok.vocab_size} tokens); {args.passes} passes (cold: fresh compile + walk; "
          "warm: the same object walks again)\n")
    results = {}
    for case in (c for c in CASES if c.name in wanted):
        ids = tok.encode(case.document)
        print(f"{case.name}: {len(ids)} masks per walk; document {case.document[:60]!r}"
              f"{'...' if len(case.document) > 60 else ''}")
        print(f"  {'engine':<11} {'compile ms':>9} | {'cold: med':>8} {'p90':>8} {'p99':>8} {'max µs':>9} |"
              f" {'warm: med':>8} {'p90':>8} {'p99':>8} {'max µs':>9}")
        case_res = {"document": case.document, "n_tokens": len(ids), "engines": {}}
        for eng in engines:
            runner = runners[eng]
            if isinstance(runner, str):
                r = {"note": runner}
            else:
                try:
                    compiles, cold, warm = runner.run(case, ids, args.passes)
                    r = {"compile_ms": float(np.median(compiles)) * 1e3, "cold": stats(cold), "warm": stats(warm),
                         "samples_us": {"cold": [x * 1e6 for x in cold], "warm": [x * 1e6 for x in warm]}}
                except NotAvailable as e:
                    r = {"note": str(e)}
            case_res["engines"][eng] = r
            print(fmt_row(eng, r))
        ours, ll = case_res["engines"].get("ours", {}), case_res["engines"].get("llguidance", {})
        if "cold" in ours:
            checks = [f"compile <= {case.compile_goal_ms:g} ms {'ok' if ours['compile_ms'] <= case.compile_goal_ms else 'MISSED'}",
                      f"p99 cold {'ok' if ours['cold']['p99_us'] <= GOALS['p99_us'] else 'MISSED'}",
                      f"p99 warm {'ok' if ours['warm']['p99_us'] <= GOALS['p99_us'] else 'MISSED'}"]
            if "cold" in ll:
                for phase in ("cold", "warm"):
                    ok = ours[phase]["median_us"] <= ll[phase]["median_us"]
                    checks.append(f"median {phase} vs llguidance {'ok' if ok else 'MISSED'}")
            print("  goals (ours): " + "; ".join(checks))
        print()
        results[case.name] = case_res
    for r in runners.values():
        if hasattr(r, "close"):
            r.close()
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out = {name: {**res, "engines": {e: {k: v for k, v in r.items() if k != "samples_us"}
                                          for e, r in res["engines"].items()}} for name, res in results.items()}
        args.json.write_text(json.dumps({"goals": GOALS, "passes": args.passes, "cases": out}, indent=2) + "\n")
        print(f"saved {args.json}")


if __name__ == "__main__":
    main()
