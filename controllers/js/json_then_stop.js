// json_then_stop: the answer is one JSON document valid against the schema in the argument
// ({} = any JSON), written under the built-in JSON Schema engine; then the sequence stops.
import { Controller, HandOff, Refuse, detokenize, log } from "rudder";

export default class JsonThenStop extends Controller {
  start(arg) {
    try {
      this.schema = JSON.parse(new TextDecoder().decode(arg) || "{}");
    } catch (e) {
      throw new Refuse(`json_then_stop: the argument is not JSON: ${e.message}`);
    }
    this.handed = false;
  }

  midProcess(step) {
    if (!this.handed) {
      this.handed = true;
      return HandOff.json(this.schema);   // masks come from the C engine, in its own sandbox
    }
    log("json_then_stop: the document is", new TextDecoder().decode(detokenize(step.generated)));
    return null;                          // stop
  }
}
