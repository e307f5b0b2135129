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
``FRAMEWIRE_TOKEN``). Each integration declares the engine versions it was
verified at and probes every function it would hook before it does; a save is
routed only when framewire gives the engine's bytes with the engine's own
encoder. Any other save, any save while no worker answers within
``FRAMEWIRE_INTEGRATION_TIMEOUT_S``, and any output that does not check out against
the worker's sha256 runs the engine's original function; nothing of framewire's
raises into the engine (docs/engines.md).
"""

from __future__ import annotations

from framewire.integrations._switch import ENV, counts, enabled

__all__ = ["ENV", "counts", "enabled"]
