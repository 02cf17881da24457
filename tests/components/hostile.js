// hostile: misbehaves in the way its argument names, at its first step (tests only).
import { Branch, Controller, log } from "rudder";

export default class Hostile extends Controller {
  start(arg) {
    this.mode = new TextDecoder().decode(arg);
  }

  midProcess(step) {
    const mode = this.mode;
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
