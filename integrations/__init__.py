"""framewire.integrations: stock engines save through the worker without an edit to them.

One module per engine, each standing on :mod:`framewire.client` alone:

- :mod:`framewire.integrations.sglang`: hooks SGLang's own save functions
  through its plugin loader (the ``sglang.multimodal_gen.plugins`` entry point);
- :mod:`framewire.integrations.vllm_omni`: loaded by vLLM-omni's
  ``vllm_omni.general_plugins`` entry point;
- :mod:`framewire.integrations.diffusers`: a drop-in ``export_to_video``.

Installed, they do nothing: the engines load every installed plugin, so an
integration acts only when ``FRAMEWIRE_INTEGRATIONS`` names it (or its
``install()`` is called). The worker is ``FRAMEWIRE_URL`` (its token
``FRAMEWIRE_TOKEN``). A save is routed only when framewire gives the engine's
bytes with the engine's own encoder; any other save, and any save while no
worker answers, runs the engine's original function (docs/engines.md).
"""

from __future__ import annotations

from framewire.integrations._route import ENV, counts, enabled

__all__ = ["ENV", "counts", "enabled"]
