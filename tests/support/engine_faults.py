"""A failure of framewire's own, injected at one stage of an integration's life in an
engine's process (the drivers read ``FRAMEWIRE_TEST_INJECT``): the engine must go on
with its own code, nothing raised into it.

- ``probe``: the probe of the engine's targets fails;
- ``register``: putting a hook in place fails (SGLang's registry refuses it; vLLM-omni's
  replacements cannot be made);
- ``check``: the check of the hooks fails, after they took;
- ``save``: every routed save fails inside framewire, before the worker is asked.
"""

from __future__ import annotations

from typing import Any

STAGES = ("probe", "register", "check", "save")
# A newline in it: the log line it becomes must still be one line.
MESSAGE = "injected failure\nframewire: FORGED LINE"


def _fail(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(MESSAGE)


def inject_failure(stage: str | None, plugins: Any = None) -> None:
    """Make framewire fail at ``stage`` (None: nowhere) in this process. ``plugins``:
    SGLang's plugin module, whose hook registry refuses framewire's hooks."""
    if stage is None:
        return
    if stage not in STAGES:
        raise ValueError(f"no stage {stage!r}")
    import framewire.integrations._probe as probe
    import framewire.integrations._vllm_omni_hooks as vllm_omni_hooks
    import framewire.integrations._worker as worker
    import framewire.integrations.sglang as sglang
    import framewire.integrations.vllm_omni as vllm_omni

    if stage == "probe":
        probe.Probe.allows = _fail  # type: ignore[method-assign]
    elif stage == "register":
        vllm_omni_hooks.encode_bytes = _fail
        vllm_omni_hooks.replace_chunked = _fail
        if plugins is not None:
            own = plugins.HookRegistry.register.__func__

            def refuse(cls: Any, target: str, hook: Any, *args: Any, **kwargs: Any) -> Any:
                if hook.__module__.startswith("framewire."):
                    _fail()
                return own(cls, target, hook, *args, **kwargs)

            plugins.HookRegistry.register = classmethod(refuse)
    elif stage == "check":
        sglang.check = _fail
        vllm_omni.check = _fail
    else:
        worker.Worker.client = _fail  # type: ignore[method-assign]
