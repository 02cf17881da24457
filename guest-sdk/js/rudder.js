// The rudder guest SDK for JavaScript controllers (docs/components.md).
//
// A controller's script imports what it uses from "rudder" and default-exports one class that
// extends Controller; `rudder build my.js -o ctl.wasm` joins this SDK and the script into one
// module (the names below are in scope) and builds the component with componentize-js.
// The controller object is the state: every request starts from it as init() left it, and a
// fork gets a copy (saved and restored as data: plain objects, arrays, strings, numbers,
// TokenSet, typed arrays, Map and Set survive; other classes come back as plain objects).

import * as host from 'rudder:controller/host@1.0.0';

export const CONFIG_ABI_VERSION = 0, CONFIG_MAX_FORKS = 1, CONFIG_MAX_FF_TOKENS = 2, CONFIG_FLAGS = 3;
export const FLAG_FORKS = 1, FLAG_BACKTRACK = 2;

let vocab = -1;
export function vocabSize() {
  if (vocab < 0) vocab = host.vocabSize();
  return vocab;
}
export function eosToken() {
  const eos = host.eosToken();
  return eos < 0 ? null : eos;
}
export const config = (key) => host.config(key);
export function arg() {
  const a = host.arg();
  return a === undefined || a === null ? null : latin1ToBytes(a);
}
export const tokenize = (text) => Array.from(host.tokenize(text));
export const detokenize = (tokens) => latin1ToBytes(host.detokenize(Uint32Array.from(tokens)));
export const tokenBytes = (token) => detokenize([token]);
export function log(...parts) {
  host.log(parts.map(String).join(' ') + '\n');
}
export function varGet(key) {
  const v = host.varGet(key);
  return v === undefined || v === null ? null : latin1ToBytes(v);
}
export function varSet(key, value) {
  const bytes = typeof value === 'string' ? new TextEncoder().encode(value) : value;
  return host.varSet(key, bytesToLatin1(bytes));
}
// console.log goes to stdout, which the host puts in the request's log too.

export function latin1ToBytes(s) {
  const out = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
  return out;
}
export function bytesToLatin1(bytes) {
  let s = '';
  for (let i = 0; i < bytes.length; i += 8192) s += String.fromCharCode.apply(null, bytes.subarray(i, i + 8192));
  return s;
}

export class Refuse extends Error {}

// A set of token ids as a bitmask in the mask format of docs/abi.md.
export class TokenSet {
  constructor(words) {
    this.words = words || new Uint32Array((vocabSize() + 31) >>> 5);
    this._wire = null;
  }
  static of(tokens) {
    const t = new TokenSet();
    for (const id of tokens) if (id >= 0 && id < vocabSize()) t.add(id);
    return t;
  }
  static all() {
    const t = new TokenSet();
    t.words.fill(0xffffffff);
    const tail = vocabSize() & 31;
    if (tail) t.words[t.words.length - 1] = (1 << tail) - 1;
    return t;
  }
  // Every token whose bytes a byte-level recognizer accepts: push(state, byte) returns the next
  // state, or null to reject (the whole subtree of the token trie is skipped).
  static fromTrie(push, start = 0) {
    return Trie.get().tokens(push, start);
  }
  add(id) { this.words[id >>> 5] |= 1 << (id & 31); this._wire = null; }
  delete(id) { this.words[id >>> 5] &= ~(1 << (id & 31)); this._wire = null; }
  has(id) { return id >= 0 && (this.words[id >>> 5] >>> (id & 31) & 1) === 1; }
  get size() {
    let n = 0;
    for (let w of this.words) { w -= (w >>> 1) & 0x55555555; w = (w & 0x33333333) + ((w >>> 2) & 0x33333333); n += (((w + (w >>> 4)) & 0xf0f0f0f) * 0x1010101) >>> 24; }
    return n;
  }
  _zip(other, f) {
    const out = new Uint32Array(this.words.length);
    for (let i = 0; i < out.length; i++) out[i] = f(this.words[i], other.words[i]);
    return new TokenSet(out);
  }
  union(other) { return this._zip(other, (a, b) => a | b); }
  intersect(other) { return this._zip(other, (a, b) => a & b); }
  minus(other) { return this._zip(other, (a, b) => a & ~b); }
  // The mask as the host wants it (one char per byte), made once per value.
  wire() {
    if (this._wire === null) this._wire = bytesToLatin1(new Uint8Array(this.words.buffer, this.words.byteOffset, this.words.byteLength));
    return this._wire;
  }
}

const RTT1 = 0x31545452;
let trie = null;

// The token trie of the host's token table (docs/abi.md, "The token table").
export class Trie {
  static get() {
    if (trie === null) trie = new Trie(latin1ToBytes(host.tokenTable()));
    return trie;
  }
  constructor(table) {
    const words = new Uint32Array(table.buffer, table.byteOffset, table.byteLength >>> 2);
    if (words[0] !== RTT1) throw new Error('not an RTT1 token table');
    const v = words[1], n = words[2];
    this.vocabSize = v;
    this.offsets = words.subarray(4, 4 + v + 1);
    this.nodes = words.subarray(4 + v + 1, 4 + v + 1 + 2 * n);
    this.bytes = table.subarray(4 * (4 + v + 1 + 2 * n));
  }
  tokenBytes(id) { return this.bytes.subarray(this.offsets[id], this.offsets[id + 1]); }
  tokens(push, start = 0) {
    const nodes = this.nodes, set = new TokenSet();
    const stack = [[1, nodes.length >>> 1, start]];
    while (stack.length) {
      let [i, end, state] = stack.pop();
      while (i < end) {
        const w0 = nodes[2 * i], size = nodes[2 * i + 1];
        const s = push(state, w0 & 0xff);
        if (s === null || s === undefined) { i += size; continue; }
        const tid = w0 >>> 8;
        if (tid) set.add(tid - 1);
        if (size > 1) {
          stack.push([i + size, end, state]);
          end = i + size; i = i + 1; state = s;
        } else {
          i += 1;
        }
      }
    }
    return set;
  }
}

// What one sequence does next (docs/abi.md): backtrack, then sample (under a mask, with ff lists
// for the sampled token) or fast-forward (ff without a mask: one list).
export class Branch {
  constructor(backtrack = 0, mask = null, ff = []) {
    this.backtrack = backtrack; this.mask = mask; this.ff = ff;
  }
  static sample(mask = null, ffLists = [], backtrack = 0) { return new Branch(backtrack, mask, ffLists); }
  static fastForward(tokens, backtrack = 0) { return new Branch(backtrack, null, [tokens]); }
  static takeBack(n) { return new Branch(n, null, [[]]); }
}

// Hand the sequence to a built-in constraint controller until it stops.
export class HandOff {
  constructor(controller, arg = '') { this.controller = controller; this.arg = arg; }
  static json(schema) { return new HandOff('json', typeof schema === 'string' ? schema : JSON.stringify(schema)); }
  static regex(pattern) { return new HandOff('regex', pattern); }
  static grammar(text) { return new HandOff('grammar', text); }
}

export class Step {
  constructor(index, branch, backtrack, tokens, seq, promptLen) {
    this.index = index; this.branch = branch; this.backtrack = backtrack;
    this.tokens = tokens; this.seq = seq; this.promptLen = promptLen;
  }
  get generated() { return this.seq.slice(this.promptLen); }
}

export class Controller {
  init() {}
  start(arg) {}
  midProcess(step) { throw new Error('a controller must define midProcess(step)'); }
}

// ------------------------------------------------------------------- the component's exports

let ctl = null;
let ControllerClass = null;

export function __rudderRegister(cls) {
  ControllerClass = cls;
}

function failure(e) {
  if (e instanceof Refuse) return { payload: { tag: 'refused', val: String(e.message || 'refused') } };
  // SpiderMonkey throws the bare string "out of memory" when an allocation fails.
  const text = String(e && e.message !== undefined ? e.message : e);
  if (/out of memory|allocation size overflow/i.test(text)) return { payload: { tag: 'out-of-memory', val: text } };
  const where = e && e.stack ? ' ' + String(e.stack).split('\n')[0] : '';
  log(`${e && e.name ? e.name : 'Error'}: ${e && e.message !== undefined ? e.message : e}\n${e && e.stack ? e.stack : ''}`);
  return { payload: { tag: 'exception', val: `${e && e.name ? e.name : 'Error'}: ${e && e.message !== undefined ? e.message : e}${where}`.slice(0, 400) } };
}

function wireMask(m) {
  if (m === null || m === undefined) return undefined;
  if (m instanceof TokenSet) return m.wire();
  if (m instanceof Uint32Array) return bytesToLatin1(new Uint8Array(m.buffer, m.byteOffset, m.byteLength));
  if (m instanceof Uint8Array) return bytesToLatin1(m);
  throw new TypeError('a mask is a TokenSet, Uint32Array or Uint8Array');
}

const NO_FF = [];

function wireBranch(b) {
  if (!(b instanceof Branch)) throw new TypeError('midProcess must return Branch objects');
  const ff = b.ff.length ? b.ff.map((l) => Uint32Array.from(l)) : NO_FF;
  return { backtrack: b.backtrack >>> 0, mask: b.mask === null ? undefined : wireMask(b.mask), ff };
}

function wireStep(answer) {
  if (answer === null || answer === undefined) return { tag: 'branches', val: [] };
  if (answer instanceof HandOff) return { tag: 'hand-off', val: { controller: answer.controller, arg: answer.arg } };
  if (answer instanceof Branch) return { tag: 'branches', val: [wireBranch(answer)] };
  return { tag: 'branches', val: Array.from(answer, wireBranch) };
}

export function init() {
  try {
    ctl = new ControllerClass();
    ctl.seq = []; ctl.promptLen = 0; ctl.__steps = 0;
    ctl.init();
  } catch (e) { throw failure(e); }
}

export function start() {
  try {
    ctl.start(arg() || new Uint8Array(0));
  } catch (e) { throw failure(e); }
}

export function midProcess(branchIdx, backtrack, tokens) {
  try {
    const seq = ctl.seq;
    if (backtrack) seq.length = seq.length - backtrack;
    for (let i = 0; i < tokens.length; i++) seq.push(tokens[i]);
    if (ctl.__steps === 0) ctl.promptLen = seq.length;
    const step = new Step(ctl.__steps, branchIdx, backtrack, tokens, seq, ctl.promptLen);
    ctl.__steps++;
    return wireStep(ctl.midProcess(step));
  } catch (e) { throw failure(e); }
}

function encode(v) {
  if (v instanceof TokenSet) return { $ts: bytesToLatin1(new Uint8Array(v.words.buffer, v.words.byteOffset, v.words.byteLength)) };
  if (v instanceof Uint32Array) return { $u32: Array.from(v) };
  if (v instanceof Uint8Array) return { $u8: bytesToLatin1(v) };
  if (v instanceof Map) return { $map: Array.from(v, ([k, x]) => [encode(k), encode(x)]) };
  if (v instanceof Set) return { $set: Array.from(v, encode) };
  if (Array.isArray(v)) return v.map(encode);
  if (v && typeof v === 'object') {
    const o = {};
    for (const k of Object.keys(v)) if (k !== '_wire') o[k] = encode(v[k]);
    return { $obj: o };
  }
  return v;
}

function decode(v) {
  if (Array.isArray(v)) return v.map(decode);
  if (v && typeof v === 'object') {
    if ('$ts' in v) { const b = latin1ToBytes(v.$ts); return new TokenSet(new Uint32Array(b.buffer)); }
    if ('$u32' in v) return Uint32Array.from(v.$u32);
    if ('$u8' in v) return latin1ToBytes(v.$u8);
    if ('$map' in v) return new Map(v.$map.map(([k, x]) => [decode(k), decode(x)]));
    if ('$set' in v) return new Set(v.$set.map(decode));
    const o = {};
    for (const k of Object.keys(v.$obj)) o[k] = decode(v.$obj[k]);
    return o;
  }
  return v;
}

export function save() {
  try {
    const fields = {};
    for (const k of Object.keys(ctl)) fields[k] = encode(ctl[k]);
    return bytesToLatin1(new TextEncoder().encode(JSON.stringify(fields)));
  } catch (e) { throw failure(e); }
}

export function restore(state) {
  try {
    const fields = JSON.parse(new TextDecoder().decode(latin1ToBytes(state)));
    ctl = new ControllerClass();
    for (const k of Object.keys(fields)) ctl[k] = decode(fields[k]);
  } catch (e) { throw failure(e); }
}
