// Starting points for the editors: JSON Schemas, a grammar, tools, and an argument and prompt
// for each built-in controller.

const PERSON = {
  type: "object",
  properties: {
    name: { type: "string", maxLength: 40 },
    age: { type: "integer", minimum: 0, maximum: 120 },
    city: { type: "string", maxLength: 30 },
  },
  required: ["name", "age", "city"],
};

export const SCHEMAS = {
  "A person": PERSON,
  "A list of cities": {
    type: "object",
    properties: {
      cities: {
        type: "array", minItems: 1, maxItems: 4,
        items: { type: "object", properties: { name: { type: "string", maxLength: 30 }, country: { type: "string", maxLength: 30 } },
                 required: ["name", "country"] },
      },
    },
    required: ["cities"],
  },
  "An answer with a reason": {
    type: "object",
    properties: { answer: { enum: ["yes", "no"] }, reason: { type: "string", maxLength: 120 } },
    required: ["answer", "reason"],
  },
  "A date": {
    type: "object",
    properties: { year: { type: "integer", minimum: 1900, maximum: 2100 }, month: { type: "integer", minimum: 1, maximum: 12 },
                  day: { type: "integer", minimum: 1, maximum: 31 } },
    required: ["year", "month", "day"],
  },
  "Any JSON": {},
};

export const GRAMMAR = `// Arithmetic: 1 + 2 * (3 - 4.5) / 6
start: expr
expr: expr "+" term | expr "-" term | term
term: term "*" factor | term "/" factor | factor
factor: NUMBER | "-" factor | "(" expr ")"
NUMBER: /[0-9]+(\\.[0-9]+)?/
%ignore /[ \\t]+/
`;

export const TOOLS = [
  {
    type: "function",
    function: {
      name: "get_weather",
      description: "The weather in a city now",
      parameters: {
        type: "object",
        properties: { city: { type: "string", maxLength: 30 }, unit: { enum: ["C", "F"] } },
        required: ["city", "unit"],
      },
    },
  },
  {
    type: "function",
    function: {
      name: "get_time",
      description: "The local time in a city",
      parameters: { type: "object", properties: { city: { type: "string", maxLength: 30 } }, required: ["city"] },
    },
  },
];

// Built-in controllers: an argument that shows what each does, and a prompt it suits.
export const BUILTIN = {
  backtrack: { arg: " very", prompt: "Describe a storm at sea." },
  choices: { arg: '["yes", "no"]', prompt: "Is the sea salty?" },
  force: { arg: "Dear sir,", prompt: "Write a letter." },
  fork: { arg: "3", prompt: "Give me a name for a boat." },
  grammar: { arg: GRAMMAR, prompt: "What is 2+3? Answer with an expression." },
  json: { arg: JSON.stringify(PERSON, null, 2), prompt: "Invent a person." },
  regex: { arg: "(Monday|Friday) at [0-9]{1,2}(am|pm)", prompt: "When shall we meet?" },
  triggers: {
    arg: JSON.stringify({ triggers: [{ begin: ".", json: { type: "object", properties: { city: { type: "string" } }, required: ["city"] }, stop: true }] }, null, 2),
    prompt: "Describe Paris in a sentence, then as JSON.",
  },
  uppercase: { arg: "", prompt: "Name three rivers." },
};
