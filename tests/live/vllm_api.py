"""The connector contract of a vLLM release, read from its `kv_connector/v1/base.py` source.

`contract(source)` gives `KVConnectorBase_V1`'s methods with their parameter names, and which
classes the module defines. The releases the project supports are kept as JSON in
tests/data/vllm_api/ (`python tests/live/vllm_api.py BASE_PY > tests/data/vllm_api/V.json`
records one from an unpacked wheel, without installing it); the installed release is read
from its own file.
"""

from __future__ import annotations

import ast
import json
import sys
from typing import Any


def contract(source: str) -> dict[str, Any]:
    tree = ast.parse(source)
    classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
    methods: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "KVConnectorBase_V1":
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = item.args
                    methods[item.name] = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    return {"classes": classes, "methods": methods}


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as f:
        print(json.dumps(contract(f.read()), indent=1, sort_keys=True))
