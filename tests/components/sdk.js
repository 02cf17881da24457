// sdk: the JavaScript SDK's cases for the tests, one component (a componentize-js build costs
// far more than the code in it). The argument picks the case: "" digits (up to 6 digit tokens,
// as controllers/js/digits.js); loop, memory, file, socket, env, log, branch, ff: misbehaves
// that way at its first step.
import { Branch, Controller, TokenSet, eosToken, log } from "rudder";

const digit = (state, byte) => (byte >= 48 && byte <= 57 ? state + 1 : null);

export default class Cases extends Controller {
  init() {
    this.digits = TokenSet.fromTrie(digit);
    const eos = eosToken();
    this.digitsOrEnd = eos === null ? this.digits : this.digits.union(TokenSet.of([eos]));
  }

  start(arg) {
    this.mode = new TextDecoder().decode(arg);
  }

  midProcess(step) {
    const mode = this.mode;
    if (mode === "") {
      if (step.generated.length >= 6) return null;
      return Branch.sample(step.generated.length ? this.digitsOrEnd : this.digits);
    }
    if (mode === "loop") for (;;) {}
    if (mode === "memory") {
      const hoard = [];
      for (;;) hoard.push(new Uint8Array(8 << 20));   // no fill: fast on any machine
    }
    if (mode === "file") log("read", fetch("file:///etc/passwd"));      // no file system, no fetch
    if (mode === "socket") log("got", fetch("http://127.0.0.1:9/"));   // no network
    if (mode === "env") log("HOME is", globalThis.process.env.HOME);   // no environment
    if (mode === "log") for (;;) console.log("x".repeat(100000));          // until its deadline
    if (mode === "branch") return Branch.sample(new Uint8Array([1, 2, 3]));   // a mask of the wrong size
    if (mode === "ff") return Branch.fastForward([1e9]);                      // a token id past the vocabulary
    return Branch.sample();
  }
}
