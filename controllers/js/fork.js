// fork: at the first step splits the request into N (arg, default 3) freely sampled sequences.
import { Branch, CONFIG_FLAGS, CONFIG_MAX_FORKS, Controller, FLAG_FORKS, Refuse, config, log } from "rudder";

export default class Fork extends Controller {
  start(arg) {
    const text = new TextDecoder().decode(arg) || "3";
    if (!/^[0-9]+$/.test(text)) throw new Refuse(`fork: the argument must be a number, not "${text}"`);
    this.n = Number(text);
    const allowed = config(CONFIG_FLAGS) & FLAG_FORKS;
    if (this.n < 1 || (this.n > 1 && (!allowed || this.n > config(CONFIG_MAX_FORKS))))
      throw new Refuse(`fork: cannot fork into ${this.n} sequences`);
  }

  midProcess(step) {
    if (step.index === 0) return Array.from({ length: this.n }, () => Branch.sample());  // each fork samples
    if (step.index === 1) log(`fork: this is fork ${step.branch} of ${this.n}`);
    return Branch.sample();
  }
}
