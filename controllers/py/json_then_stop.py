"""json_then_stop: the answer is one JSON document valid against the schema in the argument
({} = any JSON), written under the built-in JSON Schema engine; then the sequence stops."""
import json

from rudder_sdk import Controller, HandOff, Refuse, detokenize, log


class JsonThenStop(Controller):
    def start(self, arg):
        try:
            self.schema = json.loads(arg or b"{}")
        except ValueError as e:
            raise Refuse(f"json_then_stop: the argument is not JSON: {e}")
        self.handed = False

    def mid_process(self, step):
        if not self.handed:
            self.handed = True
            return HandOff.json(self.schema)   # masks come from the C engine, in its own sandbox
        # the span is over: step.tokens holds every token the JSON engine let through
        log("json_then_stop: the document is", detokenize(step.generated).decode("utf-8", "replace"))
        return None                            # stop
