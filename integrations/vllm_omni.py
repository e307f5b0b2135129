"""vLLM-omni (0.30.0): loaded by ``load_omni_general_plugins`` (entry point ``framewire``
of ``vllm_omni.general_plugins``).

``VLLM_PLUGINS``, when set, is an allow-list for vLLM's ``vllm.general_plugins`` and
vLLM-omni's group alike: it must name ``framewire`` (and, for vLLM-omni's own models,
what vLLM-omni registers there too).
"""

from __future__ import annotations

from framewire.integrations._route import enabled, say_once


def register() -> None:
    """The plugin's entry point, called in every rank, the stage process and the API
    server. vLLM-omni's saves are not routed yet: they return MP4 bytes, and the
    worker's outputs to memory are still to come (docs/engines.md)."""
    if enabled("vllm-omni"):
        say_once("vllm-omni:none", "framewire: no vLLM-omni save is routed yet; "
                 "vLLM-omni's own code runs")  # fmt: skip
