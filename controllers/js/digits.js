// digits: the answer is a number (up to 6 tokens of digits), as the README's C controller.
import { Branch, Controller, TokenSet, eosToken } from "rudder";

const digit = (state, byte) => (byte >= 48 && byte <= 57 ? state + 1 : null);  // null rejects

export default class Digits extends Controller {
  init() {                                       // once per module and tokenizer, then saved
    this.digits = TokenSet.fromTrie(digit);      // every token made only of digits
    const eos = eosToken();
    this.digitsOrEnd = eos === null ? this.digits : this.digits.union(TokenSet.of([eos]));
  }

  midProcess(step) {
    if (step.generated.length >= 6) return null; // no branch: the sequence stops
    // may end after the first digit
    return Branch.sample(step.generated.length ? this.digitsOrEnd : this.digits);
  }
}
