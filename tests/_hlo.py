"""Reading XLA's compiled HLO text in tests."""

import re


def fused_bodies(text: str, result: str) -> list[tuple[str, ...]]:
    """The bodies of the fusions whose result type is ``result`` (as the HLO text
    writes it, e.g. ``f32[64,8]{1,0}``), one per fusion, with instruction names and
    metadata dropped: two equal bodies are one computation, which XLA:CPU compiles
    to one kernel."""
    called = re.findall(r"= " + re.escape(result) + r" fusion\(.*?calls=(%[\w.]+)", text)

    def body(name):
        block = re.search("\n" + re.escape(name) + r" .*?\n\}", text, re.S).group(0)
        lines = [re.sub(r", metadata=\{.*", "", line) for line in block.splitlines()[2:]]
        return tuple(re.sub(r"%[\w.\-]+|param_\d+\.\d+", "%", line) for line in lines)

    return [body(name) for name in called]
