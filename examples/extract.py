"""Schema-driven extraction: SmolLM2 reads a document and answers with JSON that is valid
against a JSON Schema, guaranteed by the `json` controller (fetched and built on first use).

    .venv/bin/python examples/extract.py
"""

import json

from rudder import LLM, SamplingParams

DOCUMENT = """\
Invoice 2024-117 from Nordlicht GmbH, Hafenstrasse 4, 20457 Hamburg, Germany.
Billed to Ana Pereira on 3 March 2024. Total due: 1,250.00 EUR, payable within 30 days.
"""

SCHEMA = {
    "type": "object",
    "properties": {
        "invoice_number": {"type": "string", "maxLength": 20},
        "seller": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "city": {"type": "string", "maxLength": 30},
                "country": {"type": "string", "maxLength": 30},
            },
            "required": ["name", "city", "country"],
        },
        "customer": {"type": "string", "maxLength": 40},
        "date": {"type": "string", "format": "date"},
        "total": {"type": "number", "minimum": 0},
        "currency": {"enum": ["EUR", "USD", "GBP"]},
    },
    "required": ["invoice_number", "seller", "customer", "date", "total", "currency"],
}

llm = LLM("smollm2")
prompt = f"Extract the invoice's fields as JSON.\n\n{DOCUMENT}"
[out] = llm.generate([prompt], SamplingParams(max_tokens=150, temperature=0), chat=True,
                     controller="json", controller_arg=json.dumps(SCHEMA))
record = json.loads(out.text)   # valid JSON, valid against SCHEMA
print(json.dumps(record, indent=2, ensure_ascii=False))
print(f"({len(out.token_ids)} tokens, {out.finish_reason})")
